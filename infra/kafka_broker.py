"""A local Apache Kafka broker (KRaft, one combined broker+controller node).

The broker is Apache Kafka itself: its jars come from Maven Central through
Maven (`infra/kafka/pom.xml`) into a cache that outlives the state directory,
and Java runs `kafka.Kafka`. Storage is formatted on first start.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

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

POM_PATH = Path(__file__).parent / "kafka" / "pom.xml"
MAIN_CLASS = "kafka.Kafka"


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


def _paths(cfg: InfraConfig) -> dict[str, Path]:
    root = cfg.state_dir / "kafka"
    return {
        "root": root,
        "data": root / "data",
        "props": root / "server.properties",
        "log4j": root / "log4j2.properties",
        "log": root / "kafka.log",
        "stdout": root / "stdout.log",
        "pid": root / "kafka.pid",
    }


def bootstrap(cfg: InfraConfig) -> str:
    return f"127.0.0.1:{cfg.kafka_port}"


def _write_configs(cfg: InfraConfig, paths: dict[str, Path]) -> None:
    port, ctrl = cfg.kafka_port, cfg.kafka_controller_port
    paths["props"].write_text(
        "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.bootstrap.servers=127.0.0.1:{ctrl}",
                f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{ctrl}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{ctrl}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
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


def running_pid(cfg: InfraConfig) -> int | None:
    pid = read_pid(_paths(cfg)["pid"])
    if pid is not None and pid_alive(pid) and MAIN_CLASS in pid_cmdline(pid):
        return pid
    return None


async def _metadata_ok(servers: str, timeout_s: float) -> bool:
    from aiokafka.client import AIOKafkaClient

    client = AIOKafkaClient(bootstrap_servers=servers, request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return bool(client.cluster.brokers())
    except Exception:
        return False
    finally:
        await client.close()


def answers_metadata(servers: str, timeout_s: float = 3.0) -> bool:
    """True if the broker answers a metadata request (callable from async code too)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_metadata_ok(servers, timeout_s))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, _metadata_ok(servers, timeout_s)).result()


def up(cfg: InfraConfig, wait_s: float = 90.0) -> dict[str, object]:
    paths = _paths(cfg)
    if running_pid(cfg) is not None and answers_metadata(bootstrap(cfg)):
        return status(cfg)
    for port in (cfg.kafka_port, cfg.kafka_controller_port):
        if port_in_use(port):
            raise InfraError(
                f"port {port} on 127.0.0.1 is taken by another process, so the local Kafka "
                "broker cannot listen there. Stop that process or pick other ports with "
                "--kafka-port/--kafka-controller-port (or SLUICE_INFRA_KAFKA_PORT)."
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
        if port_answers(cfg.kafka_port) and answers_metadata(bootstrap(cfg)):
            return True
        time.sleep(0.5)
    return False


def down(cfg: InfraConfig) -> bool:
    """Stop the broker this state directory started. True if one was stopped."""
    paths = _paths(cfg)
    pid = running_pid(cfg)
    if pid is None:
        paths["pid"].unlink(missing_ok=True)
        return False
    stopped = stop_pid(pid, signal.SIGTERM, 30)
    if stopped:
        paths["pid"].unlink(missing_ok=True)
    return stopped


def purge(cfg: InfraConfig) -> bool:
    """Stop the broker and delete its data, configs and logs; True if there were any."""
    down(cfg)
    root = _paths(cfg)["root"]
    existed = root.exists()
    shutil.rmtree(root, ignore_errors=True)
    return existed


def status(cfg: InfraConfig) -> dict[str, object]:
    pid = running_pid(cfg)
    up_now = pid is not None and answers_metadata(bootstrap(cfg), 2.0)
    return {
        "up": up_now,
        "bootstrap": bootstrap(cfg),
        "port": cfg.kafka_port,
        "controller_port": cfg.kafka_controller_port,
        "version": kafka_version(),
        "pid": pid,
        "log": str(_paths(cfg)["log"]),
    }
