"""What a local Kafka node is made of: its jars, its files under the state directory,
its ports, the cluster a state directory remembers, the secure broker's `admin`
credentials, what a client needs to reach it, and the `server.properties` and log4j
files each node starts from.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from infra.common import InfraConfig, InfraError, NodeHost, require_tool
from infra.tls import BROKER_CN, CLIENT_CN, TlsFiles, ensure_tls

POM_PATH = Path(__file__).parent / "kafka" / "pom.xml"
ADMIN_USER = "admin"
CLUSTER_DIR = "kafka-cluster"


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


def node_files(root: Path) -> dict[str, Path]:
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


def single_broker_files(cfg: InfraConfig, secure: bool | None = None) -> dict[str, Path]:
    """The single broker's files (plain or secure)."""
    secure = cfg.secure if secure is None else secure
    root = cfg.state_dir / ("kafka-secure" if secure else "kafka")
    return {
        **node_files(root),
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
    host: NodeHost  # its address, and how it is launched there


def nodes(cfg: InfraConfig) -> list[Node]:
    if cfg.brokers == 1:
        return [Node(1, cfg.kafka_port, cfg.kafka_controller_port, single_broker_files(cfg),
                     cfg.kafka_host(0))]
    root = cfg.state_dir / CLUSTER_DIR
    return [Node(k + 1, port, ctrl, node_files(root / f"node-{k + 1}"), cfg.kafka_host(k))
            for k, (port, ctrl) in enumerate(cfg.kafka_node_ports())]


def _cluster_file(cfg: InfraConfig) -> Path:
    return cfg.state_dir / CLUSTER_DIR / "cluster.json"


def remembered_cluster(cfg: InfraConfig) -> dict[str, Any] | None:
    try:
        info = json.loads(_cluster_file(cfg).read_text())
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def cluster_config(cfg: InfraConfig) -> InfraConfig | None:
    """The cluster this state directory last started, with its own count and ports."""
    info = remembered_cluster(cfg)
    try:
        return None if info is None else dataclasses.replace(
            cfg, secure=False, brokers=int(info["brokers"]),
            kafka_port=int(info["kafka_port"]),
            kafka_controller_port=int(info["kafka_controller_port"]))
    except (KeyError, TypeError, ValueError, InfraError):
        return None


def remember_cluster(cfg: InfraConfig, cluster_id: str) -> None:
    path = _cluster_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "brokers": cfg.brokers, "kafka_port": cfg.kafka_port,
        "kafka_controller_port": cfg.kafka_controller_port, "cluster_id": cluster_id,
    }, indent=1) + "\n")
    tmp.replace(path)


def bootstrap(cfg: InfraConfig) -> str:
    """`127.0.0.1:port` (or the node's own address), comma-separated over a cluster's
    nodes."""
    return ",".join(f"{cfg.kafka_host(k).address}:{port}"
                    for k, (port, _) in enumerate(cfg.kafka_node_ports()))


def tls_bootstrap(cfg: InfraConfig) -> str:
    """The secure broker's mutual-TLS listener."""
    return f"127.0.0.1:{cfg.kafka_tls_port}"


def admin_password(cfg: InfraConfig) -> str:
    """The secure broker's `admin` password, generated once and kept beside its data."""
    path = single_broker_files(cfg, secure=True)["password"]
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
    password_file = single_broker_files(cfg, secure=True)["password"]
    return {"SLUICE_KAFKA_BOOTSTRAP": bootstrap(cfg),
            "SLUICE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
            "SLUICE_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
            "SLUICE_KAFKA__SASL_USERNAME": ADMIN_USER,
            "SLUICE_KAFKA__SASL_PASSWORD_FILE": str(password_file),
            "SLUICE_KAFKA__SSL_CAFILE": str(tls.ca_cert)}


def aiokafka_options(cfg: InfraConfig) -> dict[str, Any]:
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
        at = node.host.address
        return [
            f"listeners=PLAINTEXT://{at}:{port},CONTROLLER://{at}:{ctrl}",
            f"advertised.listeners=PLAINTEXT://{at}:{port},CONTROLLER://{at}:{ctrl}",
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


def write_configs(cfg: InfraConfig, node: Node) -> None:
    paths = node.files
    # Replicated as a production cluster is once there are three nodes; one node
    # must hold every internal topic alone.
    replicas = min(3, cfg.brokers)
    min_isr = 2 if replicas >= 3 else 1
    if cfg.brokers == 1:
        quorum = [f"controller.quorum.bootstrap.servers=127.0.0.1:{node.controller_port}"]
        defaults: list[str] = []
    else:  # a static quorum of every node: formatted alike, no --standalone
        voters = ",".join(f"{k + 1}@{cfg.kafka_host(k).address}:{ctrl}"
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
                # A transaction left open by a worker that died or was cut off holds
                # back every reply partition it wrote to (read_committed readers stop
                # at its first record) until the coordinator aborts it: look for such
                # transactions every second, not every 10 s (the default).
                "transaction.abort.timed.out.transaction.cleanup.interval.ms=1000",
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
