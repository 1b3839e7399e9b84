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
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from infra.common import (
    InfraConfig,
    InfraError,
    pid_alive,
    pid_cmdline,
    port_answers,
    port_in_use,
    read_pid,
    require_tool,
    stop_pid,
    tail,
)
from infra.tls import BROKER_CN, CLIENT_CN, TlsFiles, ensure_tls

POM_PATH = Path(__file__).parent / "kafka" / "pom.xml"
MAIN_CLASS = "kafka.Kafka"
ADMIN_USER = "admin"
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
CLUSTER_DIR = "kafka-cluster"
SINGLE_HEAP = "-Xms512m -Xmx1g"
# Three JVMs share a small machine; with the log cleaner's buffer cut to match
# (`log.cleaner.dedupe.buffer.size` below) a node runs well in 384 MB.
CLUSTER_NODE_HEAP = "-Xms256m -Xmx384m"


def kafka_version() -> str:
    match = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM_PATH.read_text())
    if match is None:
        raise InfraError(f"no <kafka.version> in {POM_PATH}")
    return match.group(1)


def jars_dir(cfg: InfraConfig) -> Path:
    return cfg.jars_root / kafka_version()


def ensure_jars(cfg: InfraConfig) -> Path:
    """Resolve the broker's jars with Maven once; later calls reuse the cache."""
    target = jars_dir(cfg)
    if (target / ".complete").exists():
        return target
    mvn = require_tool(
        "mvn", "Install Maven 3 (Debian: `apt-get install -y maven`); it fetches the Kafka jars."
    )
    require_tool("java", "Install Java 17 (Debian: `apt-get install -y openjdk-17-jre-headless`).")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="jars-", dir=target.parent))
    cmd = [
        mvn, "-q", "-B", "-f", str(POM_PATH), "dependency:copy-dependencies",
        "-DincludeScope=runtime", f"-DoutputDirectory={staging}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        out = (result.stdout + result.stderr).strip().splitlines()[-20:]
        raise InfraError("Maven could not resolve the Kafka jars:\n" + "\n".join(out))
    (staging / ".complete").write_text(kafka_version())
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _files(root: Path) -> dict[str, Path]:
    """The files of one node, all under its own directory."""
    return {
        "root": root,
        "data": root / "data",
        "props": root / "server.properties",
        "log4j": root / "log4j2.properties",
        "log": root / "kafka.log",
        "stdout": root / "stdout.log",
        "pid": root / "kafka.pid",
    }


def _paths(cfg: InfraConfig, secure: bool | None = None) -> dict[str, Path]:
    """The single broker's files (plain or secure)."""
    secure = cfg.secure if secure is None else secure
    root = cfg.state_dir / ("kafka-secure" if secure else "kafka")
    return {
        **_files(root),
        "password": root / "admin.password",
        "keystore": root / "server-keystore.pem",
    }


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Node:
    """One combined broker+controller process."""

    node_id: int
    port: int
    controller_port: int
    files: dict[str, Path]


def nodes(cfg: InfraConfig) -> list[Node]:
    if cfg.brokers == 1:
        return [Node(1, cfg.kafka_port, cfg.kafka_controller_port, _paths(cfg))]
    root = cfg.state_dir / CLUSTER_DIR
    return [Node(k + 1, port, ctrl, _files(root / f"node-{k + 1}"))
            for k, (port, ctrl) in enumerate(cfg.kafka_node_ports())]


def _cluster_file(cfg: InfraConfig) -> Path:
    return cfg.state_dir / CLUSTER_DIR / "cluster.json"


def _remembered_cluster(cfg: InfraConfig) -> dict[str, Any] | None:
    try:
        info = json.loads(_cluster_file(cfg).read_text())
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def _cluster_config(cfg: InfraConfig) -> InfraConfig | None:
    """The cluster this state directory last started, with its own count and ports."""
    info = _remembered_cluster(cfg)
    try:
        return None if info is None else dataclasses.replace(
            cfg, secure=False, brokers=int(info["brokers"]),
            kafka_port=int(info["kafka_port"]),
            kafka_controller_port=int(info["kafka_controller_port"]))
    except (KeyError, TypeError, ValueError, InfraError):
        return None


def _remember_cluster(cfg: InfraConfig, cluster_id: str) -> None:
    path = _cluster_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "brokers": cfg.brokers, "kafka_port": cfg.kafka_port,
        "kafka_controller_port": cfg.kafka_controller_port, "cluster_id": cluster_id,
    }, indent=1) + "\n")
    tmp.replace(path)


def _cluster_id(cfg: InfraConfig) -> str:
    """The cluster's id: remembered, else read from a node already formatted, else new
    (every node of a cluster must be formatted with the same one)."""
    info = _remembered_cluster(cfg) or {}
    if isinstance(info.get("cluster_id"), str):
        return info["cluster_id"]
    for node in nodes(cfg):
        meta = node.files["data"] / "meta.properties"
        with contextlib.suppress(OSError):
            for line in meta.read_text().splitlines():
                if line.startswith("cluster.id="):
                    return line.split("=", 1)[1].strip()
    return kraft_cluster_id()


def bootstrap(cfg: InfraConfig) -> str:
    """`127.0.0.1:port`, comma-separated over a cluster's nodes."""
    return ",".join(f"127.0.0.1:{port}" for port, _ in cfg.kafka_node_ports())


def tls_bootstrap(cfg: InfraConfig) -> str:
    """The secure broker's mutual-TLS listener."""
    return f"127.0.0.1:{cfg.kafka_tls_port}"


def admin_password(cfg: InfraConfig) -> str:
    """The secure broker's `admin` password, generated once and kept beside its data."""
    path = _paths(cfg, secure=True)["password"]
    try:
        password = path.read_text().strip()
    except OSError:
        password = ""
    if not password:
        path.parent.mkdir(parents=True, exist_ok=True)
        password = secrets.token_urlsafe(18)  # no `,` `]` `=`: safe in --add-scram
        tmp = path.with_suffix(".tmp")
        tmp.write_text(password + "\n")
        tmp.chmod(0o600)
        tmp.replace(path)
    return password


def client_env(cfg: InfraConfig, mtls: bool = False) -> dict[str, str]:
    """SLUICE_* settings of a client of this broker: plaintext, SASL_SSL as `admin`
    (SCRAM-SHA-512), or (`mtls`) mutual TLS as `sluice-client`."""
    if not cfg.secure:
        return {"SLUICE_KAFKA_BOOTSTRAP": bootstrap(cfg)}
    tls = TlsFiles(cfg.state_dir / "tls")
    if mtls:
        return {"SLUICE_KAFKA_BOOTSTRAP": tls_bootstrap(cfg),
                "SLUICE_KAFKA__SECURITY_PROTOCOL": "SSL",
                "SLUICE_KAFKA__SSL_CAFILE": str(tls.ca_cert),
                "SLUICE_KAFKA__SSL_CERTFILE": str(tls.client_cert),
                "SLUICE_KAFKA__SSL_KEYFILE": str(tls.client_key)}
    return {"SLUICE_KAFKA_BOOTSTRAP": bootstrap(cfg),
            "SLUICE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
            "SLUICE_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
            "SLUICE_KAFKA__SASL_USERNAME": ADMIN_USER,
            "SLUICE_KAFKA__SASL_PASSWORD_FILE": str(_paths(cfg, secure=True)["password"]),
            "SLUICE_KAFKA__SSL_CAFILE": str(tls.ca_cert)}


def _aiokafka_options(cfg: InfraConfig) -> dict[str, Any]:
    """What aiokafka needs to ask this broker for metadata (as `admin`)."""
    if not cfg.secure:
        return {"bootstrap_servers": bootstrap(cfg)}
    from aiokafka.helpers import create_ssl_context

    return {"bootstrap_servers": bootstrap(cfg), "security_protocol": "SASL_SSL",
            "ssl_context": create_ssl_context(cafile=str(TlsFiles(cfg.state_dir / "tls").ca_cert)),
            "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": ADMIN_USER,
            "sasl_plain_password": admin_password(cfg)}


def _listener_lines(cfg: InfraConfig, node: Node) -> list[str]:
    port, ctrl, paths = node.port, node.controller_port, node.files
    if not cfg.secure:
        return [
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{ctrl}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{ctrl}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        ]
    tls = ensure_tls(cfg.state_dir)
    # The broker's key and certificate chain in one PEM file: its key store.
    keystore = tls.server_key.read_bytes() + tls.server_cert.read_bytes()
    paths["keystore"].write_bytes(keystore)
    paths["keystore"].chmod(0o600)
    listeners = (f"SASL_SSL://127.0.0.1:{port},SSL://127.0.0.1:{cfg.kafka_tls_port},"
                 f"CONTROLLER://127.0.0.1:{ctrl}")
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
    plain = ("org.apache.kafka.common.security.plain.PlainLoginModule required "
             f'user_{ADMIN_USER}="{admin_password(cfg)}";')
    return [
        f"listeners={listeners}",
        f"advertised.listeners={listeners}",
        "controller.listener.names=CONTROLLER",
        # Between its own listeners the broker is a mutual-TLS client with its certificate.
        "inter.broker.listener.name=SSL",
        "listener.security.protocol.map=SASL_SSL:SASL_SSL,SSL:SSL,CONTROLLER:SSL",
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={paths['keystore']}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={tls.ca_cert}",
        "listener.name.ssl.ssl.client.auth=required",
        "listener.name.controller.ssl.client.auth=required",
        "ssl.principal.mapping.rules=RULE:^CN=([^,]+)$/$1/,DEFAULT",
        "sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512,PLAIN",
        f"listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config={scram}",
        f"listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config={scram}",
        f"listener.name.sasl_ssl.plain.sasl.jaas.config={plain}",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        f"super.users=User:{ADMIN_USER};User:{BROKER_CN};User:{CLIENT_CN}",
    ]


def _write_configs(cfg: InfraConfig, node: Node) -> None:
    paths = node.files
    # Replicated as a production cluster is once there are three nodes; one node
    # must hold every internal topic alone.
    replicas = min(3, cfg.brokers)
    min_isr = 2 if replicas >= 3 else 1
    if cfg.brokers == 1:
        quorum = [f"controller.quorum.bootstrap.servers=127.0.0.1:{node.controller_port}"]
        defaults: list[str] = []
    else:  # a static quorum of every node: formatted alike, no --standalone
        voters = ",".join(f"{k + 1}@127.0.0.1:{ctrl}"
                          for k, (_, ctrl) in enumerate(cfg.kafka_node_ports()))
        quorum = [f"controller.quorum.voters={voters}"]
        defaults = [f"default.replication.factor={replicas}", f"min.insync.replicas={min_isr}"]
    tuning = [] if cfg.brokers == 1 else [
        # A killed node is fenced, and its partitions led elsewhere, within ~6 s
        # instead of the default 9 s.
        "broker.heartbeat.interval.ms=1000",
        "broker.session.timeout.ms=6000",
        # The cleaner's buffer (128 MB by default) must fit the nodes' small heaps.
        "log.cleaner.dedupe.buffer.size=33554432",
    ]
    paths["props"].write_text(
        "\n".join(
            [
                "process.roles=broker,controller",
                f"node.id={node.node_id}",
                *quorum,
                *_listener_lines(cfg, node),
                f"log.dirs={paths['data']}",
                "num.partitions=1",
                # sluice creates every topic itself; a typo must not create one.
                "auto.create.topics.enable=false",
                *defaults,
                f"offsets.topic.replication.factor={replicas}",
                "offsets.topic.num.partitions=8",
                f"transaction.state.log.replication.factor={replicas}",
                f"transaction.state.log.min.isr={min_isr}",
                "transaction.state.log.num.partitions=4",
                f"share.coordinator.state.topic.replication.factor={replicas}",
                f"share.coordinator.state.topic.min.isr={min_isr}",
                "group.initial.rebalance.delay.ms=0",
                "log.retention.hours=24",
                *tuning,
                "",
            ]
        )
    )
    paths["log4j"].write_text(
        "\n".join(
            [
                "status = warn",
                "appender.file.type = File",
                "appender.file.name = FILE",
                f"appender.file.fileName = {paths['log']}",
                "appender.file.layout.type = PatternLayout",
                "appender.file.layout.pattern = [%d] %p %m (%c)%n",
                "rootLogger.level = INFO",
                "rootLogger.appenderRef.file.ref = FILE",
                "logger.kafka.name = org.apache.kafka",
                "logger.kafka.level = WARN",
                "",
            ]
        )
    )


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


def _node_pid(files: dict[str, Path]) -> int | None:
    """The PID of the node whose files these are, if it runs. The command line must name
    this node's own config, so that a recycled PID is never taken for it."""
    pid = read_pid(files["pid"])
    if pid is not None and pid_alive(pid):
        cmdline = pid_cmdline(pid)
        if MAIN_CLASS in cmdline and str(files["props"]) in cmdline:
            return pid
    return None


def _running_pids(cfg: InfraConfig) -> dict[int, int]:
    """Node id -> PID of `cfg`'s nodes that run."""
    pids = {node.node_id: _node_pid(node.files) for node in nodes(cfg)}
    return {node_id: pid for node_id, pid in pids.items() if pid is not None}


def running_pid(cfg: InfraConfig, secure: bool | None = None) -> int | None:
    """The PID of a running node of `cfg`'s mode (the lowest node id), else None."""
    if secure is not None:
        cfg = dataclasses.replace(cfg, secure=secure)
    pids = _running_pids(cfg)
    return pids[min(pids)] if pids else None


def _mode(cfg: InfraConfig) -> str:
    if cfg.brokers > 1:
        return f"a {cfg.brokers}-broker cluster"
    return "secure" if cfg.secure else "plaintext"


def running_config(cfg: InfraConfig) -> InfraConfig:
    """`cfg` in the mode Kafka runs in from this state directory — plaintext, secure,
    or a cluster with its own node count and ports — if it runs; else `cfg`."""
    singles = [dataclasses.replace(cfg, secure=secure, brokers=1)
               for secure in (cfg.secure, not cfg.secure)]
    cluster = _cluster_config(cfg)
    clusters = [cluster] if cluster is not None and cluster.brokers > 1 else []
    candidates = [*clusters, *singles] if cfg.brokers > 1 else [*singles, *clusters]
    for candidate in candidates:
        if _running_pids(candidate):
            return candidate
    return cfg


async def _metadata_brokers(options: dict[str, Any], timeout_s: float) -> set[int] | None:
    """The node ids of the live brokers a metadata request names; None if none answers."""
    from aiokafka.client import AIOKafkaClient

    client = AIOKafkaClient(**options, request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return {broker.nodeId for broker in client.cluster.brokers()}
    except Exception:
        return None
    finally:
        await client.close()


def live_brokers(cfg: InfraConfig, timeout_s: float = 3.0) -> set[int]:
    """The node ids the cluster reports as live brokers (empty if no node answers);
    callable from async code too."""
    work = functools.partial(asyncio.run, _metadata_brokers(_aiokafka_options(cfg), timeout_s))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return work() or set()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result() or set()


def answers_metadata(cfg: InfraConfig, timeout_s: float = 3.0) -> bool:
    """True if the broker answers a metadata request (callable from async code too)."""
    return bool(live_brokers(cfg, timeout_s))


def _ready(cfg: InfraConfig, timeout_s: float = 3.0) -> bool:
    """Every node runs as a registered, unfenced broker."""
    return live_brokers(cfg, timeout_s) >= {node.node_id for node in nodes(cfg)}


def _check_mode(cfg: InfraConfig) -> InfraConfig:
    """Refuse to start `cfg` over Kafka that runs differently from this state directory;
    returns the configuration that runs (or `cfg`)."""
    if cfg.secure and cfg.brokers > 1:
        raise InfraError("--secure runs a single broker: use --brokers 1 with --secure, "
                         "or start the cluster without --secure")
    current = running_config(cfg)
    if not _running_pids(current):
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
    before = _cluster_config(cfg)
    if before is not None and before.brokers != cfg.brokers and any(
            (node.files["data"] / "meta.properties").exists() for node in nodes(before)):
        raise InfraError(
            f"the local Kafka cluster in {cfg.state_dir} has {before.brokers} brokers; "
            f"delete it with `sluice infra down --purge` to start one of {cfg.brokers}")


def _java_command(cfg: InfraConfig, node: Node, classpath: str) -> list[str]:
    heap = cfg.kafka_heap or (SINGLE_HEAP if cfg.brokers == 1 else CLUSTER_NODE_HEAP)
    return [
        "java", *heap.split(), "-XX:+UseG1GC", "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={node.files['log4j']}",
        "-cp", classpath, MAIN_CLASS, str(node.files["props"]),
    ]


def up(cfg: InfraConfig, wait_s: float = 90.0) -> dict[str, object]:
    """Start the broker, or the cluster's nodes that do not run; a no-op when all run."""
    cfg = _check_mode(cfg)
    _check_node_count(cfg)
    running = _running_pids(cfg)
    all_nodes = nodes(cfg)
    if len(running) == len(all_nodes) and _ready(cfg):
        return status(cfg)
    to_start = [node for node in all_nodes if node.node_id not in running]
    for node in to_start:
        ports = [node.port, node.controller_port]
        if cfg.secure:
            ports.append(cfg.kafka_tls_port)
        for port in ports:
            if port_in_use(port):
                raise InfraError(
                    f"port {port} on 127.0.0.1 is taken by another process, so the local "
                    "Kafka broker cannot listen there. Stop that process or pick other ports "
                    "with --kafka-port/--kafka-controller-port/--kafka-tls-port (or "
                    "SLUICE_INFRA_KAFKA_PORT, ...)."
                )
    libs = ensure_jars(cfg)
    classpath = f"{libs}/*"
    cluster_id = None
    if cfg.brokers > 1:
        cluster_id = _cluster_id(cfg)
        _remember_cluster(cfg, cluster_id)
    for node in to_start:
        node.files["root"].mkdir(parents=True, exist_ok=True)
        _write_configs(cfg, node)
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
    _stop_pids([proc.pid for proc in started.values() if proc.poll() is None], 10)
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
        if all(port_answers(node.port) for node in nodes(cfg)) and _ready(cfg):
            return None
        time.sleep(0.5)
    return 0


def _stop_pids(pids: list[int], timeout: float) -> list[bool]:
    """SIGTERM each (side by side: a cluster's nodes shut down together), SIGKILL
    after `timeout`; True for each that exited."""
    if not pids:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(pids)) as pool:
        return list(pool.map(lambda pid: stop_pid(pid, signal.SIGTERM, timeout), pids))


def _all_node_files(cfg: InfraConfig) -> list[dict[str, Path]]:
    """The files of every node this state directory may have run: the plain and the
    secure broker, and a cluster's nodes."""
    cluster_nodes = sorted((cfg.state_dir / CLUSTER_DIR).glob("node-*"))
    return [_paths(cfg, False), _paths(cfg, True), *(_files(root) for root in cluster_nodes)]


def down(cfg: InfraConfig) -> bool:
    """Stop the Kafka this state directory started — plain, secure, or every node of a
    cluster. True if any was stopped."""
    found = [(files, _node_pid(files)) for files in _all_node_files(cfg)]
    running = [(files, pid) for files, pid in found if pid is not None]
    for files, pid in found:
        if pid is None:
            files["pid"].unlink(missing_ok=True)
    stopped = _stop_pids([pid for _, pid in running], 30)
    for (files, _), exited in zip(running, stopped, strict=True):
        if exited:
            files["pid"].unlink(missing_ok=True)
    return any(stopped)


def purge(cfg: InfraConfig) -> bool:
    """Stop Kafka and delete its data, configs and logs (every mode's); True if there
    were any."""
    down(cfg)
    existed = False
    for root in (_paths(cfg, False)["root"], _paths(cfg, True)["root"],
                 cfg.state_dir / CLUSTER_DIR):
        existed = existed or root.exists()
        shutil.rmtree(root, ignore_errors=True)
    return existed


def status(cfg: InfraConfig) -> dict[str, object]:
    """The running Kafka's status (plain, secure or cluster), else that of `cfg`'s mode.
    A cluster's report adds `brokers` and, per node, `nodes`; it is `up` while any
    node answers."""
    cfg = running_config(cfg)
    pids = _running_pids(cfg)
    live = live_brokers(cfg, 2.0) if pids else set()
    all_nodes = nodes(cfg)
    report: dict[str, object] = {
        "up": bool(live),
        "bootstrap": bootstrap(cfg),
        "port": cfg.kafka_port,
        "controller_port": cfg.kafka_controller_port,
        "version": kafka_version(),
        "pid": pids[min(pids)] if pids else None,
        "log": str(all_nodes[0].files["log"]),
        "secure": cfg.secure,
    }
    if cfg.secure:
        report["security_protocol"] = "SASL_SSL"
        report["tls_bootstrap"] = tls_bootstrap(cfg)
    if cfg.brokers > 1:
        report["brokers"] = cfg.brokers
        report["nodes"] = [
            {"node_id": node.node_id, "up": node.node_id in live and node.node_id in pids,
             "bootstrap": f"127.0.0.1:{node.port}", "port": node.port,
             "controller_port": node.controller_port, "pid": pids.get(node.node_id),
             "log": str(node.files["log"])}
            for node in all_nodes
        ]
    return report
