"""The cluster a chaos run has to itself: three Kafka nodes and a PostgreSQL on free
ports, and the worker processes the load is served by and the faults strike."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.chaos_report import MODEL
from infra.common import InfraConfig, free_port, port_in_use


def cluster_config(state_dir: Path) -> InfraConfig:
    """Three Kafka nodes and a PostgreSQL on free ports (node k 100*k above node 1)."""
    for _ in range(50):
        cfg = InfraConfig.from_env(state_dir=state_dir, kafka_port=free_port(),
                                   kafka_controller_port=free_port(),
                                   postgres_port=free_port(), secure=False, brokers=3)
        ports = [port for pair in cfg.kafka_node_ports() for port in pair] + [cfg.postgres_port]
        if len(set(ports)) == len(ports) and not any(port_in_use(p) for p in ports):
            return cfg
    raise RuntimeError("no free ports for a three-node cluster")


class Workers:
    """The worker processes, each under its own --replica, with a log file."""

    def __init__(self, settings_env: dict[str, str], count: int, logs: Path):
        self._env = settings_env
        self._logs = logs
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._log_paths: dict[int, Path] = {}
        for replica in range(count):
            self.start(replica)

    def start(self, replica: int) -> None:
        path = self._logs / f"worker-{replica}-{len(self._log_paths)}-{time.time():.0f}.log"
        self._log_paths[replica] = path
        with path.open("wb") as log:
            self.procs[replica] = subprocess.Popen(
                [sys.executable, "-m", "sluice", "worker", "--model", MODEL, "--replica",
                 str(replica)], env=self._env, stdout=log, stderr=subprocess.STDOUT)

    def log(self, replica: int) -> str:
        return self._log_paths[replica].read_text(errors="replace")

    async def wait_serving(self, replica: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "serving chaos as" not in self.log(replica):
            if time.monotonic() > deadline or self.procs[replica].poll() is not None:
                raise RuntimeError(f"worker {replica} did not serve:\n{self.log(replica)[-3000:]}")
            await asyncio.sleep(0.2)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

