"""The cluster a chaos run has to itself: three Kafka nodes and a PostgreSQL on free
ports, and the worker processes the load is served by and the faults strike.

Networked (`ChaosConfig.networked`), each node and each worker runs on a host of its
own, a network namespace of `infra.netns`: `kafka1`-`kafka3`, `postgres`, `worker<i>`;
the run's client stays in this namespace and reaches them over the bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.chaos_report import MODEL, ChaosConfig
from common.settings import Settings
from infra.common import InfraConfig, NodeHost, free_port, port_in_use
from infra.netns import Network

BROKER_HOSTS = ("kafka1", "kafka2", "kafka3")
POSTGRES_HOST = "postgres"
STOP_LINE = "stopping the worker"


def worker_host(replica: int) -> str:
    return f"worker{replica}"


def host_names(workers: int) -> list[str]:
    return [*BROKER_HOSTS, POSTGRES_HOST, *(worker_host(r) for r in range(workers))]


def cluster_config(state_dir: Path, net: Network | None = None) -> InfraConfig:
    """Three Kafka nodes and a PostgreSQL on free ports (node k 100*k above node 1), on
    the network's hosts when there is one."""
    hosts: dict[str, object] = {}
    if net is not None:
        def at(name: str) -> NodeHost:
            return NodeHost(net.host(name).address, net.host(name).launch_prefix)
        hosts = {"kafka_hosts": tuple(at(name) for name in BROKER_HOSTS),
                 "postgres_host": at(POSTGRES_HOST)}
    for _ in range(50):
        cfg = InfraConfig.from_env(state_dir=state_dir, kafka_port=free_port(),
                                   kafka_controller_port=free_port(),
                                   postgres_port=free_port(), secure=False, brokers=3, **hosts)
        ports = [port for pair in cfg.kafka_node_ports() for port in pair] + [cfg.postgres_port]
        if len(set(ports)) == len(ports) and not any(port_in_use(p) for p in ports):
            return cfg
    raise RuntimeError("no free ports for a three-node cluster")


class Workers:
    """The worker processes, each under its own --replica, with a log file; launched
    with `prefixes[replica]` (`ip netns exec NAME`) when given."""

    def __init__(self, settings_env: dict[str, str], count: int, logs: Path,
                 prefixes: Sequence[tuple[str, ...]] = ()):
        self._env = settings_env
        self._logs = logs
        self._prefixes = prefixes
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._log_paths: dict[int, Path] = {}
        self._killed: set[int] = set()  # PIDs the nemesis killed
        self.exits: list[str] = []  # exits it did not cause
        for replica in range(count):
            self.start(replica)

    def start(self, replica: int) -> None:
        self._note_exit(replica)
        path = self._logs / f"worker-{replica}-{len(self._log_paths)}-{time.time():.0f}.log"
        self._log_paths[replica] = path
        prefix = self._prefixes[replica] if self._prefixes else ()
        with path.open("wb") as log:
            self.procs[replica] = subprocess.Popen(
                [*prefix, sys.executable, "-m", "sluice", "worker", "--model", MODEL,
                 "--replica", str(replica)], env=self._env, stdout=log, stderr=subprocess.STDOUT)

    def kill(self, replica: int) -> None:
        """SIGKILL the worker and wait for it (the nemesis's own exit, not counted; one
        that had exited already is, and is started again like a killed one)."""
        self._note_exit(replica)
        proc = self.procs[replica]
        self._killed.add(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def log(self, replica: int) -> str:
        return self._log_paths[replica].read_text(errors="replace")

    async def wait_serving(self, replica: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "serving chaos as" not in self.log(replica):
            if time.monotonic() > deadline or self.procs[replica].poll() is not None:
                raise RuntimeError(f"worker {replica} did not serve:\n{self.log(replica)[-3000:]}")
            await asyncio.sleep(0.2)

    def stop_lines(self) -> list[str]:
        """Every log line, of every worker started, that says it stops."""
        return [f"{path.name}: {line.strip()}" for path in sorted(self._logs.glob("worker-*.log"))
                for line in path.read_text(errors="replace").splitlines() if STOP_LINE in line]

    def stop_all(self) -> None:
        for replica in self.procs:
            self._note_exit(replica)
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

    def _note_exit(self, replica: int) -> None:
        proc = self.procs.get(replica)
        if proc is not None and proc.poll() is not None and proc.pid not in self._killed:
            self._killed.add(proc.pid)  # noted once
            self.exits.append(f"worker {replica} (pid {proc.pid}) exited with code "
                              f"{proc.returncode}")


@dataclass(slots=True)
class Cluster:
    """What the nemesis strikes, and the seeded dice it throws."""

    cfg: ChaosConfig
    rng: random.Random
    settings: Settings
    workers: Workers
    infra: InfraConfig
    net: Network | None = None


async def request_leaders(settings: Settings) -> Counter[int]:
    """Node id -> how many of the model's request partitions it leads."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        described = (await admin.describe_topics([settings.requests_topic(MODEL)]))[0]
    finally:
        await admin.close()
    return Counter(p["leader"] for p in described["partitions"] if p["leader"] >= 0)
