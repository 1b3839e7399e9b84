"""Shared pieces of the local infrastructure: where state lives, ports, processes.

Everything `sluice infra` starts is recorded under one state directory
(default `~/.cache/sluice/infra`, or `SLUICE_STATE_DIR`), so `down` can stop
exactly the processes `up` started, by their PID, and nothing else.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path


class InfraError(RuntimeError):
    """A local-infrastructure failure with a message a person can act on."""


# A cluster's nodes listen 100 ports apart (39092, 39192, 39292 by default), clear of
# each other's controller ports and of the TLS and PostgreSQL defaults.
NODE_PORT_STRIDE = 100
MAX_BROKERS = 9


LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class NodeHost:
    """Where a node (a Kafka node, PostgreSQL) runs: the address it listens on and
    advertises, and the prefix of the command that launches it there. The default is
    this machine's loopback; `infra.netns` hosts have an address of their own and are
    entered with `ip netns exec NAME`."""

    address: str = LOOPBACK
    launch_prefix: tuple[str, ...] = ()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice"


@dataclass(frozen=True, slots=True)
class InfraConfig:
    """Where the local broker and database live and which loopback ports they use."""

    state_dir: Path
    kafka_port: int = 39092
    kafka_controller_port: int = 39093
    postgres_port: int = 39432
    jar_cache_dir: Path | None = None
    # None: 512 MB - 1 GB for a single broker, less for each node of a cluster.
    kafka_heap: str | None = None
    # `--secure`: SASL_SSL on kafka_port, mutual TLS on kafka_tls_port, ACLs enforced,
    # PostgreSQL over TLS only.
    secure: bool = False
    kafka_tls_port: int = 39094
    # `--brokers N`: N combined broker+controller nodes; node k (0-based) listens
    # NODE_PORT_STRIDE * k above kafka_port / kafka_controller_port.
    brokers: int = 1
    # Networked runs (`sluice bench chaos --networked`): each Kafka node, and PostgreSQL,
    # on a host of its own (plaintext only). Empty / the default: all on 127.0.0.1.
    kafka_hosts: tuple[NodeHost, ...] = ()
    postgres_host: NodeHost = NodeHost()

    def __post_init__(self) -> None:
        if not 1 <= self.brokers <= MAX_BROKERS:
            raise InfraError(f"--brokers must be between 1 and {MAX_BROKERS}, not {self.brokers}")
        if self.kafka_hosts and len(self.kafka_hosts) != self.brokers:
            raise InfraError(f"{len(self.kafka_hosts)} Kafka hosts for {self.brokers} brokers")
        if self.secure and (self.kafka_hosts or self.postgres_host != NodeHost()):
            raise InfraError("the secure mode runs on 127.0.0.1 only, not on other hosts")

    @classmethod
    def from_env(cls, **overrides: object) -> InfraConfig:
        env = os.environ
        values: dict[str, object] = {
            "state_dir": Path(env.get("SLUICE_STATE_DIR") or default_cache_dir() / "infra"),
            "kafka_port": int(env.get("SLUICE_INFRA_KAFKA_PORT", 39092)),
            "kafka_controller_port": int(env.get("SLUICE_INFRA_KAFKA_CONTROLLER_PORT", 39093)),
            "postgres_port": int(env.get("SLUICE_INFRA_POSTGRES_PORT", 39432)),
            "kafka_tls_port": int(env.get("SLUICE_INFRA_KAFKA_TLS_PORT", 39094)),
            "secure": env.get("SLUICE_INFRA_SECURE", "").lower() in ("1", "true", "yes"),
            "brokers": int(env.get("SLUICE_INFRA_BROKERS") or 1),
        }
        if env.get("SLUICE_JAR_CACHE"):
            values["jar_cache_dir"] = Path(env["SLUICE_JAR_CACHE"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["state_dir"] = Path(values["state_dir"]).expanduser().resolve()  # type: ignore[arg-type]
        return cls(**values)  # type: ignore[arg-type]

    @property
    def jars_root(self) -> Path:
        return self.jar_cache_dir or default_cache_dir() / "kafka-jars"

    def kafka_node_ports(self) -> list[tuple[int, int]]:
        """(listener, controller) port of each Kafka node, node 1 first."""
        return [(self.kafka_port + NODE_PORT_STRIDE * k,
                 self.kafka_controller_port + NODE_PORT_STRIDE * k)
                for k in range(self.brokers)]

    def kafka_host(self, k: int) -> NodeHost:
        """Where node k (0-based) runs."""
        return self.kafka_hosts[k] if self.kafka_hosts else NodeHost()


def require_tool(name: str, install_hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise InfraError(f"`{name}` was not found on PATH. {install_hint}")
    return path


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def free_port() -> int:
    """A free loopback port below Linux's ephemeral range (32768 and up): a port in that
    range can be taken by any outgoing connection between this check and its use."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32000")


def port_answers(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def pid_cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return raw.replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_pid(pid: int, sig: signal.Signals, timeout: float) -> bool:
    """Signal `pid` and wait until it exits; SIGKILL after `timeout`. True if it exited."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    return not pid_alive(pid)


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:])
