"""A local Apache Kafka broker (KRaft, one combined broker+controller node).

The broker is Apache Kafka itself: its jars come from Maven Central through
Maven (`infra/kafka/pom.xml`) into a cache that outlives the state directory,
and Java runs `kafka.Kafka`. Storage is formatted on first start.

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
import dataclasses
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


def _paths(cfg: InfraConfig, secure: bool | None = None) -> dict[str, Path]:
    secure = cfg.secure if secure is None else secure
    root = cfg.state_dir / ("kafka-secure" if secure else "kafka")
    return {
        "root": root,
        "data": root / "data",
        "props": root / "server.properties",
        "log4j": root / "log4j2.properties",
        "log": root / "kafka.log",
        "stdout": root / "stdout.log",
        "pid": root / "kafka.pid",
        "password": root / "admin.password",
        "keystore": root / "server-keystore.pem",
    }


def bootstrap(cfg: InfraConfig) -> str:
    return f"127.0.0.1:{cfg.kafka_port}"


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


def _listener_lines(cfg: InfraConfig, paths: dict[str, Path]) -> list[str]:
    port, ctrl = cfg.kafka_port, cfg.kafka_controller_port
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


def _write_configs(cfg: InfraConfig, paths: dict[str, Path]) -> None:
    ctrl = cfg.kafka_controller_port
    paths["props"].write_text(
        "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.bootstrap.servers=127.0.0.1:{ctrl}",
                *_listener_lines(cfg, paths),
                f"log.dirs={paths['data']}",
                "num.partitions=1",
                # sluice creates every topic itself; a typo must not create one.
                "auto.create.topics.enable=false",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=8",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "transaction.state.log.num.partitions=4",
                "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1",
                "group.initial.rebalance.delay.ms=0",
                "log.retention.hours=24",
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


def _format_storage(cfg: InfraConfig, paths: dict[str, Path], classpath: str) -> None:
    if (paths["data"] / "meta.properties").exists():
        return
    cluster_id = kraft_cluster_id()
    cmd = [
        "java", "-cp", classpath, "kafka.tools.StorageTool", "format",
        f"--cluster-id={cluster_id}", "-c", str(paths["props"]), "--standalone", "-g",
    ]
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


def running_pid(cfg: InfraConfig, secure: bool | None = None) -> int | None:
    pid = read_pid(_paths(cfg, secure)["pid"])
    if pid is not None and pid_alive(pid) and MAIN_CLASS in pid_cmdline(pid):
        return pid
    return None


def _other_mode_running(cfg: InfraConfig) -> bool:
    return running_pid(cfg, secure=not cfg.secure) is not None


async def _metadata_ok(options: dict[str, Any], timeout_s: float) -> bool:
    from aiokafka.client import AIOKafkaClient

    client = AIOKafkaClient(**options, request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return bool(client.cluster.brokers())
    except Exception:
        return False
    finally:
        await client.close()


def answers_metadata(cfg: InfraConfig, timeout_s: float = 3.0) -> bool:
    """True if the broker answers a metadata request (callable from async code too)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_metadata_ok(_aiokafka_options(cfg), timeout_s))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, _metadata_ok(_aiokafka_options(cfg), timeout_s)).result()


def up(cfg: InfraConfig, wait_s: float = 90.0) -> dict[str, object]:
    paths = _paths(cfg)
    if running_pid(cfg) is not None and answers_metadata(cfg):
        return status(cfg)
    if _other_mode_running(cfg):
        this, other = ("secure", "plaintext") if cfg.secure else ("plaintext", "secure")
        raise InfraError(
            f"the local Kafka broker runs {other} on these ports; stop it with "
            f"`sluice infra down` before starting it {this}"
            + ("" if cfg.secure else " (or add --secure / SLUICE_INFRA_SECURE=1)"))
    ports = [cfg.kafka_port, cfg.kafka_controller_port]
    if cfg.secure:
        ports.append(cfg.kafka_tls_port)
    for port in ports:
        if port_in_use(port):
            raise InfraError(
                f"port {port} on 127.0.0.1 is taken by another process, so the local Kafka "
                "broker cannot listen there. Stop that process or pick other ports with "
                "--kafka-port/--kafka-controller-port/--kafka-tls-port (or "
                "SLUICE_INFRA_KAFKA_PORT, ...)."
            )
    libs = ensure_jars(cfg)
    paths["root"].mkdir(parents=True, exist_ok=True)
    _write_configs(cfg, paths)
    classpath = f"{libs}/*"
    _format_storage(cfg, paths, classpath)
    cmd = [
        "java", *cfg.kafka_heap.split(), "-XX:+UseG1GC", "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={paths['log4j']}",
        "-cp", classpath, MAIN_CLASS, str(paths["props"]),
    ]
    with paths["stdout"].open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=paths["root"],
        )
    paths["pid"].write_text(f"{proc.pid}\n")
    try:
        if _wait_until_ready(cfg, proc, wait_s):
            return status(cfg)
    except BaseException:
        stop_pid(proc.pid, signal.SIGTERM, 10)
        paths["pid"].unlink(missing_ok=True)
        raise
    exited = proc.poll() is not None
    if not exited:
        stop_pid(proc.pid, signal.SIGTERM, 10)
    paths["pid"].unlink(missing_ok=True)
    why = "exited" if exited else f"did not answer a metadata request within {wait_s:.0f} s"
    raise InfraError(
        f"the Kafka broker {why}. Last lines of {paths['log']}:\n{tail(paths['log'])}\n"
        f"--- {paths['stdout']}:\n{tail(paths['stdout'], 10)}"
    )


def _wait_until_ready(cfg: InfraConfig, proc: subprocess.Popen[bytes], wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if port_answers(cfg.kafka_port) and answers_metadata(cfg):
            return True
        time.sleep(0.5)
    return False


def down(cfg: InfraConfig) -> bool:
    """Stop the broker this state directory started, plain or secure. True if one was
    stopped."""
    stopped_any = False
    for secure in (False, True):
        paths = _paths(cfg, secure)
        pid = running_pid(cfg, secure)
        if pid is None:
            paths["pid"].unlink(missing_ok=True)
            continue
        if stop_pid(pid, signal.SIGTERM, 30):
            paths["pid"].unlink(missing_ok=True)
            stopped_any = True
    return stopped_any


def purge(cfg: InfraConfig) -> bool:
    """Stop the broker and delete its data, configs and logs (both modes'); True if
    there were any."""
    down(cfg)
    existed = False
    for secure in (False, True):
        root = _paths(cfg, secure)["root"]
        existed = existed or root.exists()
        shutil.rmtree(root, ignore_errors=True)
    return existed


def status(cfg: InfraConfig) -> dict[str, object]:
    """The running broker's status (plain or secure), else that of `cfg`'s mode."""
    if running_pid(cfg) is None and _other_mode_running(cfg):
        cfg = dataclasses.replace(cfg, secure=not cfg.secure)
    pid = running_pid(cfg)
    up_now = pid is not None and answers_metadata(cfg, 2.0)
    report: dict[str, object] = {
        "up": up_now,
        "bootstrap": bootstrap(cfg),
        "port": cfg.kafka_port,
        "controller_port": cfg.kafka_controller_port,
        "version": kafka_version(),
        "pid": pid,
        "log": str(_paths(cfg)["log"]),
        "secure": cfg.secure,
    }
    if cfg.secure:
        report["security_protocol"] = "SASL_SSL"
        report["tls_bootstrap"] = tls_bootstrap(cfg)
    return report
