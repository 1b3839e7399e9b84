"""A local Apache Kafka broker (KRaft, one combined broker+controller node), or a
cluster of such nodes (`sluice infra up --brokers 3`).

The broker is Apache Kafka itself: its jars come from Maven Central through
Maven (`infra/kafka/pom.xml`) into a cache that outlives the state directory,
and Java runs `kafka.Kafka`. Storage is formatted on first start.

A cluster (`--brokers N`, plaintext) is N combined broker+controller nodes on
loopback: one cluster id, each node its own process, log dir and ports (node k,
counting from 0, listens `NODE_PORT_STRIDE * k` above the first node's ports), and
a static controller quorum of all N (`controller.quorum.voters`). Its defaults are
a production cluster's: replication factor min(3, N) for every topic (internal
ones too) and `min.insync.replicas=2` once that factor is 3. The node count, ports
and cluster id are remembered in `<state>/kafka-cluster/cluster.json`, so `down`,
`status` and `env` find the cluster without flags, and `up` restarts only the
nodes that are not running.

`secure` mode (`sluice infra up --secure`) runs a broker as a managed Kafka
would: clients connect with SASL_SSL (SCRAM-SHA-256/512, or PLAIN) on
`kafka_port` or with mutual TLS on `kafka_tls_port`, the broker's own traffic
(controller, inter-broker) is mutual TLS with its certificate, and the KRaft
`StandardAuthorizer` enforces ACLs. One super user, `admin`, is created at
format time with a generated password; the client certificate's principal
`sluice-client` is a super user too. Other users and ACLs are the operator's
(see `infra/helm/sluice/README.md`). Plain and secure brokers keep separate
data; one runs at a time on the same ports.

This module formats each node's storage and starts the nodes; `kafka_config.py`
writes what they start from, and `kafka_process.py` finds, probes and stops them.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import subprocess
import time
import uuid

from infra.common import InfraConfig, InfraError, port_answers, port_in_use, tail
from infra.kafka_config import (
    ADMIN_USER,
    Node,
    admin_password,
    bootstrap,
    client_env,
    cluster_config,
    ensure_jars,
    nodes,
    remember_cluster,
    remembered_cluster,
    write_configs,
)
from infra.kafka_process import (
    MAIN_CLASS,
    down,
    every_node_live,
    purge,
    running_config,
    running_pid,
    running_pids,
    status,
    stop_pids,
)

# What the rest of sluice calls on `kafka_broker`; the pieces live in kafka_config
# and kafka_process.
__all__ = [
    "bootstrap",
    "client_env",
    "down",
    "kraft_cluster_id",
    "purge",
    "running_config",
    "running_pid",
    "status",
    "up",
]

SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
SINGLE_HEAP = "-Xms512m -Xmx1g"
# Three JVMs share a small machine; with the log cleaner's buffer cut to match
# (`log.cleaner.dedupe.buffer.size` in kafka_config) a node runs well in 384 MB.
CLUSTER_NODE_HEAP = "-Xms256m -Xmx384m"


def _cluster_id(cfg: InfraConfig) -> str:
    """The cluster's id: remembered, else read from a node already formatted, else new
    (every node of a cluster must be formatted with the same one)."""
    info = remembered_cluster(cfg) or {}
    if isinstance(info.get("cluster_id"), str):
        return info["cluster_id"]
    for node in nodes(cfg):
        meta = node.files["data"] / "meta.properties"
        with contextlib.suppress(OSError):
            for line in meta.read_text().splitlines():
                if line.startswith("cluster.id="):
                    return line.split("=", 1)[1].strip()
    return kraft_cluster_id()


def _format_storage(cfg: InfraConfig, node: Node, classpath: str,
                    cluster_id: str | None = None) -> None:
    paths = node.files
    if (paths["data"] / "meta.properties").exists():
        return
    cmd = [
        "java", "-cp", classpath, "kafka.tools.StorageTool", "format",
        f"--cluster-id={cluster_id or kraft_cluster_id()}", "-c", str(paths["props"]),
    ]
    # One node is a dynamic quorum of itself; a cluster's static quorum is in its config.
    cmd += ["--standalone", "-g"] if cfg.brokers == 1 else ["-g"]
    if cfg.secure:  # SCRAM users exist in the metadata log from the start
        password = admin_password(cfg)
        for mechanism in SCRAM_MECHANISMS:
            cmd += ["--add-scram", f"{mechanism}=[name={ADMIN_USER},password={password}]"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise InfraError(f"formatting Kafka storage failed:\n{result.stdout}{result.stderr}")


def kraft_cluster_id() -> str:
    """A random cluster id in Kafka's form: a UUID as 22 URL-safe base64 characters.

    Like Kafka's own ``Uuid.randomUuid``, never one that begins with ``-``: the storage
    tool's argument parser would read such an id as an option.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _mode(cfg: InfraConfig) -> str:
    if cfg.brokers > 1:
        return f"a {cfg.brokers}-broker cluster"
    return "secure" if cfg.secure else "plaintext"


def _check_mode(cfg: InfraConfig) -> InfraConfig:
    """Refuse to start `cfg` over Kafka that runs differently from this state directory;
    returns the configuration that runs (or `cfg`)."""
    if cfg.secure and cfg.brokers > 1:
        raise InfraError("--secure runs a single broker: use --brokers 1 with --secure, "
                         "or start the cluster without --secure")
    current = running_config(cfg)
    if not running_pids(current):
        return cfg
    this, other = _mode(cfg), _mode(current)
    if this != other and cfg.brokers == current.brokers == 1:
        raise InfraError(
            f"the local Kafka broker runs {other} on these ports; stop it with "
            f"`sluice infra down` before starting it {this}"
            + ("" if cfg.secure else " (or add --secure / SLUICE_INFRA_SECURE=1)"))
    if this != other:
        runs = other if current.brokers > 1 else f"as a single {other} broker"
        wanted = this if cfg.brokers > 1 else f"a single {this} broker"
        hint = f" (or add --brokers {current.brokers})" if current.brokers > 1 else ""
        raise InfraError(f"the local Kafka runs {runs} on these ports; stop it with "
                         f"`sluice infra down` before starting {wanted}{hint}")
    if cfg.brokers > 1 and bootstrap(current) != bootstrap(cfg):
        raise InfraError(f"the local Kafka cluster runs at {bootstrap(current)}; stop it "
                         "with `sluice infra down` before starting it on other ports")
    return current


def _check_node_count(cfg: InfraConfig) -> None:
    """A cluster's data holds its quorum of voters: another node count needs new data."""
    if cfg.brokers == 1:
        return
    before = cluster_config(cfg)
    if before is not None and before.brokers != cfg.brokers and any(
            (node.files["data"] / "meta.properties").exists() for node in nodes(before)):
        raise InfraError(
            f"the local Kafka cluster in {cfg.state_dir} has {before.brokers} brokers; "
            f"delete it with `sluice infra down --purge` to start one of {cfg.brokers}")


def _java_command(cfg: InfraConfig, node: Node, classpath: str) -> list[str]:
    heap = cfg.kafka_heap or (SINGLE_HEAP if cfg.brokers == 1 else CLUSTER_NODE_HEAP)
    return [
        *node.host.launch_prefix,
        "java", *heap.split(), "-XX:+UseG1GC", "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={node.files['log4j']}",
        "-cp", classpath, MAIN_CLASS, str(node.files["props"]),
    ]


def up(cfg: InfraConfig, wait_s: float = 90.0) -> dict[str, object]:
    """Start the broker, or the cluster's nodes that do not run; a no-op when all run."""
    cfg = _check_mode(cfg)
    _check_node_count(cfg)
    running = running_pids(cfg)
    all_nodes = nodes(cfg)
    if len(running) == len(all_nodes) and every_node_live(cfg):
        return status(cfg)
    to_start = [node for node in all_nodes if node.node_id not in running]
    for node in to_start:
        ports = [node.port, node.controller_port]
        if cfg.secure:
            ports.append(cfg.kafka_tls_port)
        for port in ports:
            if port_in_use(port, node.host.address):
                raise InfraError(
                    f"port {port} on {node.host.address} is taken by another process, so the "
                    "local Kafka broker cannot listen there. Stop that process or pick other ports "
                    "with --kafka-port/--kafka-controller-port/--kafka-tls-port (or "
                    "SLUICE_INFRA_KAFKA_PORT, ...)."
                )
    libs = ensure_jars(cfg)
    classpath = f"{libs}/*"
    cluster_id = None
    if cfg.brokers > 1:
        cluster_id = _cluster_id(cfg)
        remember_cluster(cfg, cluster_id)
    for node in to_start:
        node.files["root"].mkdir(parents=True, exist_ok=True)
        write_configs(cfg, node)
    # Each format is a JVM start: format a cluster's nodes side by side.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(to_start))) as pool:
        for done in [pool.submit(_format_storage, cfg, node, classpath, cluster_id)
                     for node in to_start]:
            done.result()
    started: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for node in to_start:
            with node.files["stdout"].open("ab") as out:
                started[node.node_id] = subprocess.Popen(
                    _java_command(cfg, node, classpath), stdout=out,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, cwd=node.files["root"],
                )
            node.files["pid"].write_text(f"{started[node.node_id].pid}\n")
        failed = _wait_until_ready(cfg, started, wait_s)
        if failed is None:
            return status(cfg)
    except BaseException:
        _stop_started(all_nodes, started)
        raise
    _stop_started(all_nodes, started)
    node = next(n for n in all_nodes if n.node_id == failed) if failed else all_nodes[0]
    paths = node.files
    what = "the Kafka broker" if cfg.brokers == 1 else f"Kafka node {node.node_id}"
    why = ("exited" if failed else "did not answer a metadata request within "
           f"{wait_s:.0f} s" + ("" if cfg.brokers == 1 else " with every node live"))
    raise InfraError(
        f"{what} {why}. Last lines of {paths['log']}:\n{tail(paths['log'])}\n"
        f"--- {paths['stdout']}:\n{tail(paths['stdout'], 10)}"
    )


def _stop_started(all_nodes: list[Node], started: dict[int, subprocess.Popen[bytes]]) -> None:
    stop_pids([proc.pid for proc in started.values() if proc.poll() is None], 10)
    for node in all_nodes:
        if node.node_id in started:
            node.files["pid"].unlink(missing_ok=True)


def _wait_until_ready(cfg: InfraConfig, started: dict[int, subprocess.Popen[bytes]],
                      wait_s: float) -> int | None:
    """None once every node is a live broker; else the id of a node that exited, or 0
    when time ran out."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for node_id, proc in started.items():
            if proc.poll() is not None:
                return node_id
        if all(port_answers(node.port, node.host.address) for node in nodes(cfg)) \
                and every_node_live(cfg):
            return None
        time.sleep(0.5)
    return 0
