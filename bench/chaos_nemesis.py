"""The chaos run's nemesis: when the faults strike (seeded, spread over the load, one at a
time) and what each kind does to the cluster. The processes' faults are here; the
network's (a networked run's) are in `chaos_network`."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable

from bench.chaos_checks import CapacityProbe
from bench.chaos_cluster import Cluster, request_leaders
from bench.chaos_network import NETWORK_STRIKES
from bench.chaos_report import ChaosConfig, ChaosReport, Fault, Say
from infra import kafka_broker, postgres

Strike = Callable[[Cluster, Fault], Awaitable[None]]


# How long a healed fault's capacity is waited for before the next fault strikes.
CAPACITY_WAIT_S = 60.0


def calm_window_s(cfg: ChaosConfig, duration_s: float) -> float:
    """The load's first seconds, free of faults: `calm_s`, at most a fifth of the load."""
    return min(cfg.calm_s, 0.2 * duration_s)


def fault_schedule(cfg: ChaosConfig, rng: random.Random,
                   duration_s: float) -> list[tuple[float, str]]:
    """(start, kind) of each fault, the starts spread over the load after its calm
    window; `strike_faults` moves each to after the one before has healed."""
    calm = calm_window_s(cfg, duration_s) / duration_s
    starts = sorted(rng.uniform(max(0.05, calm), 0.85) * duration_s
                    for _ in range(cfg.faults))
    kinds = [cfg.kinds[i % len(cfg.kinds)] for i in range(cfg.faults)]
    rng.shuffle(kinds)
    return list(zip(starts, kinds, strict=True))


async def strike_faults(cluster: Cluster, schedule: list[tuple[float, str]], t0: float,
                        report: ChaosReport, say: Say, probe: CapacityProbe) -> None:
    """Each fault in turn; after each heals, the time until capacity is back (`probe`),
    then `settle_s` before the next."""
    free_at = 0.0
    for start, kind in schedule:
        at = max(start, free_at)
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        fault = Fault(kind, round(time.monotonic() - t0, 1), "")
        report.faults.append(fault)
        await STRIKES[kind](cluster, fault)
        fault.ended_s = round(time.monotonic() - t0, 1)
        fault.capacity_back_s = await probe.wait_back(CAPACITY_WAIT_S)
        back = (f"not back within {CAPACITY_WAIT_S:g} s ({probe.why})"
                if fault.capacity_back_s is None
                else f"capacity back {fault.capacity_back_s:.1f} s later")
        say(f"  fault {len(report.faults)}: {kind} of {fault.target} at {fault.at_s:.0f} s, "
            f"over at {fault.ended_s:.0f} s, {back}")
        free_at = time.monotonic() - t0 + cluster.cfg.settle_s


async def _worker_kill(c: Cluster, fault: Fault) -> None:
    """SIGKILL a worker, restart it (same --replica) a moment later."""
    replica = c.rng.randrange(c.cfg.workers)
    fault.target = f"worker {replica}"
    await asyncio.to_thread(c.workers.kill, replica)
    await asyncio.sleep(c.rng.uniform(*c.cfg.restart_after_s))
    c.workers.start(replica)
    await c.workers.wait_serving(replica)


async def _worker_pause(c: Cluster, fault: Fault) -> None:
    """SIGSTOP a worker past its session timeout, then SIGCONT: the zombie."""
    replica = c.rng.randrange(c.cfg.workers)
    fault.target = f"worker {replica}"
    proc = c.workers.procs[replica]
    proc.send_signal(signal.SIGSTOP)
    await asyncio.sleep(c.rng.uniform(*c.cfg.pause_s))
    proc.send_signal(signal.SIGCONT)


async def _broker_kill(c: Cluster, fault: Fault) -> None:
    """SIGKILL the broker leading a request partition (the lowest id that runs), restart
    it later."""
    leaders = sorted(await request_leaders(c.settings))
    nodes = {n["node_id"]: n["pid"] for n in kafka_broker.status(c.infra)["nodes"]
             if n.get("up")}  # type: ignore[union-attr]
    live = [node for node in leaders if node in nodes]
    if not live:
        raise RuntimeError(f"no live leader among {leaders}")
    fault.target = f"broker {live[0]}"
    os.kill(int(nodes[live[0]]), signal.SIGKILL)
    await asyncio.sleep(c.rng.uniform(*c.cfg.broker_down_s))
    await asyncio.to_thread(kafka_broker.up, c.infra)


async def _postgres_restart(c: Cluster, fault: Fault) -> None:
    fault.target = "postgresql"
    await asyncio.to_thread(postgres.down, c.infra)
    await asyncio.sleep(c.rng.uniform(*c.cfg.postgres_down_s))
    await asyncio.to_thread(postgres.up, c.infra)


STRIKES: dict[str, Strike] = {
    "worker_kill": _worker_kill, "worker_pause": _worker_pause,
    "broker_kill": _broker_kill, "postgres_restart": _postgres_restart,
    **NETWORK_STRIKES,
}
