"""The local Kafka as it runs: which node processes run from a state directory and in
which mode, which brokers answer, the status report, and stopping (or purging) them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import shutil
import signal
from pathlib import Path
from typing import Any

from infra.common import InfraConfig, NodeHost, pid_alive, pid_cmdline, read_pid, stop_pid
from infra.kafka_config import (
    CLUSTER_DIR,
    aiokafka_options,
    bootstrap,
    cluster_config,
    kafka_version,
    node_files,
    nodes,
    single_broker_files,
    tls_bootstrap,
)

MAIN_CLASS = "kafka.Kafka"


def node_pid(files: dict[str, Path]) -> int | None:
    """The PID of the node whose files these are, if it runs. The command line must name
    this node's own config, so that a recycled PID is never taken for it."""
    pid = read_pid(files["pid"])
    if pid is not None and pid_alive(pid):
        cmdline = pid_cmdline(pid)
        if MAIN_CLASS in cmdline and str(files["props"]) in cmdline:
            return pid
    return None


def running_pids(cfg: InfraConfig) -> dict[int, int]:
    """Node id -> PID of `cfg`'s nodes that run."""
    pids = {node.node_id: node_pid(node.files) for node in nodes(cfg)}
    return {node_id: pid for node_id, pid in pids.items() if pid is not None}


def running_pid(cfg: InfraConfig, secure: bool | None = None) -> int | None:
    """The PID of a running node of `cfg`'s mode (the lowest node id), else None."""
    if secure is not None:
        cfg = dataclasses.replace(cfg, secure=secure)
    pids = running_pids(cfg)
    return pids[min(pids)] if pids else None


def running_config(cfg: InfraConfig) -> InfraConfig:
    """`cfg` in the mode Kafka runs in from this state directory — plaintext, secure,
    or a cluster with its own node count and ports — if it runs; else `cfg`."""
    # A single broker runs on 127.0.0.1: a networked cluster's hosts are not its.
    singles = [dataclasses.replace(cfg, secure=secure, brokers=1, kafka_hosts=(),
                                   postgres_host=NodeHost())
               for secure in (cfg.secure, not cfg.secure)]
    cluster = cluster_config(cfg)
    clusters = [cluster] if cluster is not None and cluster.brokers > 1 else []
    candidates = [*clusters, *singles] if cfg.brokers > 1 else [*singles, *clusters]
    for candidate in candidates:
        if running_pids(candidate):
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
    work = functools.partial(asyncio.run, _metadata_brokers(aiokafka_options(cfg), timeout_s))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return work() or set()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result() or set()


def every_node_live(cfg: InfraConfig, timeout_s: float = 3.0) -> bool:
    """Every node runs as a registered, unfenced broker."""
    return live_brokers(cfg, timeout_s) >= {node.node_id for node in nodes(cfg)}


def stop_pids(pids: list[int], timeout: float) -> list[bool]:
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
    return [single_broker_files(cfg, False), single_broker_files(cfg, True),
            *(node_files(root) for root in cluster_nodes)]


def down(cfg: InfraConfig) -> bool:
    """Stop the Kafka this state directory started — plain, secure, or every node of a
    cluster. True if any was stopped."""
    found = [(files, node_pid(files)) for files in _all_node_files(cfg)]
    running = [(files, pid) for files, pid in found if pid is not None]
    for files, pid in found:
        if pid is None:
            files["pid"].unlink(missing_ok=True)
    stopped = stop_pids([pid for _, pid in running], 30)
    for (files, _), exited in zip(running, stopped, strict=True):
        if exited:
            files["pid"].unlink(missing_ok=True)
    return any(stopped)


def purge(cfg: InfraConfig) -> bool:
    """Stop Kafka and delete its data, configs and logs (every mode's); True if there
    were any."""
    down(cfg)
    existed = False
    for root in (single_broker_files(cfg, False)["root"], single_broker_files(cfg, True)["root"],
                 cfg.state_dir / CLUSTER_DIR):
        existed = existed or root.exists()
        shutil.rmtree(root, ignore_errors=True)
    return existed


def status(cfg: InfraConfig) -> dict[str, object]:
    """The running Kafka's status (plain, secure or cluster), else that of `cfg`'s mode.
    A cluster's report adds `brokers` and, per node, `nodes`; it is `up` while any
    node answers."""
    cfg = running_config(cfg)
    pids = running_pids(cfg)
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
             "bootstrap": f"{node.host.address}:{node.port}", "port": node.port,
             "controller_port": node.controller_port, "pid": pids.get(node.node_id),
             "log": str(node.files["log"])}
            for node in all_nodes
        ]
    return report
