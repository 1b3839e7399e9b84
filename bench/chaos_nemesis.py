"""The chaos run's nemesis: when the faults strike (seeded, spread over the load, one at a
time) and what each kind does to the cluster."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

from bench.chaos_cluster import Workers
from bench.chaos_report import MODEL, ChaosConfig, ChaosReport, Fault, Say
from common.settings import Settings
from infra import kafka_broker, postgres
from infra.common import InfraConfig


def fault_schedule(cfg: ChaosConfig, rng: random.Random,
                   duration_s: float) -> list[tuple[float, str]]:
    """(start, kind) of each fault, the starts spread over the load; `strike_faults`
    moves each to after the one before has ended."""
    starts = sorted(rng.uniform(0.05, 0.85) * duration_s for _ in range(cfg.faults))
    kinds = [cfg.kinds[i % len(cfg.kinds)] for i in range(cfg.faults)]
    rng.shuffle(kinds)
    return list(zip(starts, kinds, strict=True))


async def strike_faults(cfg: ChaosConfig, rng: random.Random,
                        schedule: list[tuple[float, str]], t0: float, settings: Settings,
                        workers: Workers, infra: InfraConfig, report: ChaosReport,
                        say: Say) -> None:
    free_at = 0.0
    for start, kind in schedule:
        at = max(start, free_at)
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        fault = Fault(kind, round(time.monotonic() - t0, 1), "")
        report.faults.append(fault)
        if kind == "worker_kill":
            replica = rng.randrange(cfg.workers)
            fault.target = f"worker {replica}"
            workers.procs[replica].send_signal(signal.SIGKILL)
            await asyncio.to_thread(workers.procs[replica].wait)
            await asyncio.sleep(rng.uniform(*cfg.restart_after_s))
            workers.start(replica)
            await workers.wait_serving(replica)
        elif kind == "worker_pause":
            replica = rng.randrange(cfg.workers)
            fault.target = f"worker {replica}"
            proc = workers.procs[replica]
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(rng.uniform(*cfg.pause_s))
            proc.send_signal(signal.SIGCONT)
        elif kind == "broker_kill":
            node, pid = await _a_leader(settings, infra)
            fault.target = f"broker {node}"
            os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(rng.uniform(*cfg.broker_down_s))
            await asyncio.to_thread(kafka_broker.up, infra)
        elif kind == "postgres_restart":
            fault.target = "postgresql"
            await asyncio.to_thread(postgres.down, infra)
            await asyncio.sleep(rng.uniform(*cfg.postgres_down_s))
            await asyncio.to_thread(postgres.up, infra)
        fault.ended_s = round(time.monotonic() - t0, 1)
        say(f"  fault {len(report.faults)}: {kind} of {fault.target} at {fault.at_s:.0f} s, "
            f"over at {fault.ended_s:.0f} s")
        free_at = fault.ended_s + 5.0  # let the system settle before the next


async def _a_leader(settings: Settings, infra: InfraConfig) -> tuple[int, int]:
    """(node id, pid) of the broker leading a request partition (the first it finds)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        described = (await admin.describe_topics([settings.requests_topic(MODEL)]))[0]
    finally:
        await admin.close()
    leaders = sorted({p["leader"] for p in described["partitions"]})
    nodes = {n["node_id"]: n["pid"] for n in kafka_broker.status(infra)["nodes"]
             if n.get("up")}  # type: ignore[union-attr]
    for leader in leaders:
        if leader in nodes:
            return leader, int(nodes[leader])
    raise RuntimeError(f"no live leader among {leaders}")

