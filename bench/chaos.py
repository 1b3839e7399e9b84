"""`sluice bench chaos`: a seeded, randomized fault run on a cluster of its own, then an
invariant check of everything the reply topic holds.

A three-node Kafka cluster and a PostgreSQL of its own (private state, free
ports), `workers` worker processes of one model, and a load of requests over
many sessions at a steady rate — some streamed, some followed by a cancel. A
warm-up load comes first (`warmup_s`, and on until its answers settle; answered
before the clock starts; checked, not timed), and the measured load's first
seconds are calm (`calm_s`). Then faults strike at seeded random times, one at a
time; after each heals, the run waits until capacity is back — every worker in
the group, every request partition assigned and led (`CapacityProbe`) — and
times it:

- `worker_kill`: SIGKILL a worker, restart it (same --replica) a moment later;
- `worker_pause`: SIGSTOP a worker past its session timeout, then SIGCONT (the
  zombie: its partitions went to others while it slept);
- `broker_kill`: SIGKILL the broker leading a request partition, restart it later;
- `postgres_restart`: stop PostgreSQL, start it again.

Networked (`ChaosConfig.networked`, `--networked`), every broker, PostgreSQL and each
worker runs on a host of its own — a network namespace the run makes and removes
(`infra.netns`) — and the network's faults join those (`chaos_network`):
`worker_cut_from_brokers`, `worker_cut_from_database`, `leader_isolated_from_brokers`,
`lossy_links`. It needs root, `ip` and `nft`.

Then every record of the reply topic is read (`read_committed`, and
`read_uncommitted` for what aborted transactions left) and checked:

- exactly_once: every request sent has exactly one committed terminal event;
  at_least_once: at least one, and repeats only under different attempts;
- no answer for a request id never sent;
- per attempt with a `done`, the token events' texts (by seq) add up to its text
  (streamed requests, cancelled ones included);
- the committed offsets of the model's consumer group, sampled all along, never
  go backwards (a new coordinator's brief stale answer after its broker took over
  is counted apart: `OffsetWatch`).

`run_chaos` returns the report (histogram of terminal events per request, the
violations, latencies in calm and fault windows, the faults with their times);
`tests/integration/test_chaos.py` runs a short seed in the suite.

Its parts: `chaos_cluster` (the cluster and the workers), `chaos_nemesis` (the faults),
`chaos_network` (the network's faults), `chaos_checks` (the offset watch and the reply
topic's invariants), `chaos_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import time
from pathlib import Path

from bench.chaos_checks import CapacityProbe, check_replies, sample_offsets
from bench.chaos_cluster import Cluster, Workers, cluster_config, host_names, worker_host
from bench.chaos_nemesis import fault_schedule, strike_faults
from bench.chaos_report import (
    MODEL,
    SESSION_TIMEOUT_S,
    TERMINAL,
    ChaosConfig,
    ChaosReport,
    Say,
    Sent,
)
from bench.harness import percentile
from common.settings import Settings
from infra import local
from infra.netns import Network
from sluice.client import Client

WARMUP_ROUND_S = 10.0  # the warm-up past `warmup_s`, a round at a time

async def run_chaos(cfg: ChaosConfig, workdir: Path, model_dir: Path,
                    say: Say = lambda _line: None) -> ChaosReport:
    began = time.monotonic()
    report = ChaosReport(cfg)
    net: Network | None = None
    if cfg.networked:
        net = await asyncio.to_thread(Network.create, host_names(cfg.workers))
        say(f"a network {net.plan.subnet} ({net.plan.prefix}): this namespace at "
            f"{net.gateway}, " + ", ".join(f"{h.name} {h.address}" for h in net.plan.hosts))
    try:
        await _on_cluster(cfg, workdir, model_dir, net, report, say)
    finally:
        if net is not None:
            await asyncio.to_thread(net.teardown)
    report.wall_s = time.monotonic() - began
    return report


async def _on_cluster(cfg: ChaosConfig, workdir: Path, model_dir: Path, net: Network | None,
                      report: ChaosReport, say: Say) -> None:
    infra = cluster_config(workdir / "infra", net)
    workers: Workers | None = None
    try:
        say("starting a three-node Kafka cluster and a PostgreSQL ...")
        started = await asyncio.to_thread(local.up, infra)
        settings = Settings(kafka_bootstrap=str(started["kafka"]["bootstrap"]),
                            database_url=str(started["postgres"]["url"]), db_schema="chaos",
                            topic_prefix="chaos", request_partitions=cfg.partitions)
        env = {**os.environ, "SLUICE_KAFKA_BOOTSTRAP": str(settings.kafka_bootstrap),
               "SLUICE_DATABASE_URL": str(settings.database_url), "SLUICE_DB_SCHEMA": "chaos",
               "SLUICE_TOPIC_PREFIX": "chaos", "SLUICE_METRICS_PORT": "0",
               "SLUICE_COMPILE": "0",
               # Three workers and three brokers share the machine: each worker's
               # kernels on one thread. With torch's default (a thread a core), their
               # OpenMP threads spin-wait on cores the others need: measured on 2 cores
               # at 10 requests/s, workers 1.1-1.4 cores and p50 2-5 s, against 0.05
               # cores and p50 ~40 ms with one thread each.
               "OMP_NUM_THREADS": "1"}
        client = Client(settings)
        try:
            key = await asyncio.to_thread(_register, client, model_dir, cfg.delivery)
            logs = workdir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            prefixes = [] if net is None else [net.host(worker_host(r)).launch_prefix
                                               for r in range(cfg.workers)]
            workers = Workers(env, cfg.workers, logs, prefixes)
            for replica in range(cfg.workers):
                await workers.wait_serving(replica)
            say(f"{cfg.workers} workers serve; {cfg.requests} requests at "
                f"{cfg.rate_per_s:g}/s with {cfg.faults} faults (seed {cfg.seed})")
            # asyncpg logs every failed reconnect with a traceback: expected here, where
            # the database is restarted on purpose (the faults are listed in the report)
            pool_log = logging.getLogger("asyncpg.pool")
            level = pool_log.level
            pool_log.setLevel(logging.ERROR)
            try:
                cluster = Cluster(cfg, random.Random(cfg.seed), settings, workers, infra, net)
                await _load_with_faults(cluster, client, key, report, say)
            finally:
                pool_log.setLevel(level)
        finally:
            await client.aclose()
        await asyncio.to_thread(workers.stop_all)
        report.worker_exits, report.worker_stops = workers.exits, workers.stop_lines()
        workers = None
        await check_replies(settings, report)
    finally:
        if workers is not None:
            workers.stop_all()
        await asyncio.to_thread(local.purge, infra)


def _register(client: Client, model_dir: Path, delivery: str) -> str:
    client.models.register(model=MODEL, path=str(model_dir),
                           compute_config={"kv_cache_len": 16384, "delivery": delivery})
    key = client.keys.create(tenant="chaos")
    client.keys.grant(key, model=MODEL)
    return key


async def _load_with_faults(cluster: Cluster, client: Client, key: str, report: ChaosReport,
                            say: Say) -> None:
    cfg, rng = cluster.cfg, cluster.rng
    duration = cfg.requests / cfg.rate_per_s
    schedule = fault_schedule(cfg, rng, duration)
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(sample_offsets(cluster.settings, report, stop_sampling))
    warmup = round(cfg.warmup_s * cfg.rate_per_s)
    if warmup:
        say(f"  warming up: {warmup} requests over {cfg.warmup_s:g} s, not timed")
        began = time.monotonic()
        last = await _send_load(cfg, rng, client, key, report, warmup, "w",
                                say=lambda _line: None)
        round_ = 1
        while (not _settled(last, cfg.warm_p90_s)
               and time.monotonic() - began + WARMUP_ROUND_S <= cfg.warmup_max_s):
            round_ += 1
            tag = f"w{round_}-"
            say(f"  warming up {WARMUP_ROUND_S:g} s more (answers not settled yet)")
            # A random stream of its own: the measured load is the seed's whatever the
            # warm-up took.
            last = await _send_load(cfg, random.Random(f"{cfg.seed}-{tag}"), client, key,
                                    report, round(WARMUP_ROUND_S * cfg.rate_per_s), tag,
                                    say=lambda _line: None)
        report.warmup_s = time.monotonic() - began
    probe = CapacityProbe(cluster.settings, cfg.workers)
    try:
        t0 = time.monotonic()
        faults = asyncio.create_task(strike_faults(cluster, schedule, t0, report, say, probe))
        await _send_load(cfg, rng, client, key, report, cfg.requests, "", say, t0=t0,
                         faults=faults)
    finally:
        await probe.close()
    stop_sampling.set()
    await sampler
    windows = [(f.at_s, (f.ended_s or f.at_s) + SESSION_TIMEOUT_S) for f in report.faults]
    for sent in report.sent.values():
        if sent.latency_s is None or sent.outcome != "done" or sent.warmup:
            continue
        # During a fault: in flight at any moment of a fault's window (sent before it
        # struck but not yet answered counts too).
        answered = sent.at_s + sent.latency_s
        during = any(a <= answered and sent.at_s <= b for a, b in windows)
        (report.fault_latency_s if during else report.calm_latency_s).append(sent.latency_s)


def _settled(round_: list[Sent], p90_s: float) -> bool:
    """Whether a warm-up round was answered within `p90_s`, nine in ten of its
    requests — `done` answers as the calm figures count them; one never answered (a
    timeout, a send refused) counts as slow; an error answer (a cancel's) not at all."""
    latencies = []
    for sent in round_:
        if sent.outcome == "done" and sent.latency_s is not None:
            latencies.append(sent.latency_s)
        elif sent.outcome != "error":
            latencies.append(math.inf)
    return bool(latencies) and percentile(latencies, 0.9) <= p90_s


async def _send_load(cfg: ChaosConfig, rng: random.Random, client: Client, key: str,
                     report: ChaosReport, count: int, tag: str, say: Say,
                     t0: float | None = None,
                     faults: asyncio.Task[None] | None = None) -> list[Sent]:
    """`count` requests at the run's rate (ids `chaos-<seed>-<tag><i>`; a tag marks
    warm-up requests), then until each ended (and `faults` with them): their `Sent`."""
    t0 = time.monotonic() if t0 is None else t0
    sents: list[Sent] = []
    tasks: list[asyncio.Task[None]] = []
    cancels: list[asyncio.Task[None]] = []
    for i in range(count):
        delay = t0 + i / cfg.rate_per_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = Sent(f"chaos-{cfg.seed}-{tag}{i}", time.monotonic() - t0,
                    streamed=rng.random() < cfg.stream_share,
                    cancelled=rng.random() < cfg.cancel_share, warmup=bool(tag))
        report.sent[sent.request_id] = sent
        sents.append(sent)
        session = f"session-{rng.randrange(cfg.sessions)}"
        tasks.append(asyncio.create_task(_one(
            client, key, sent, session,
            [rng.randrange(3, 200) for _ in range(rng.randrange(3, 12))],
            rng.randint(*cfg.max_tokens), cfg.request_timeout_s)))
        if sent.cancelled:
            cancels.append(asyncio.create_task(_cancel_later(
                client, key, sent.request_id, session, rng.uniform(0.05, 1.0))))
        if (i + 1) % max(1, count // 10) == 0:
            say(f"  {i + 1} sent, {sum(t.done() for t in tasks)} ended")
    if faults is not None:
        await faults
    await asyncio.gather(*tasks, *cancels)
    return sents


async def _cancel_later(client: Client, key: str, request_id: str, session: str,
                        delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    with contextlib.suppress(Exception):
        await client.cancel(model=MODEL, request_id=request_id, session_id=session, api_key=key)


async def _one(client: Client, key: str, sent: Sent, session: str, prompt: list[int],
               max_tokens: int, timeout_s: float) -> None:
    from sluice.errors import RequestError, RequestTimeoutError

    started = time.monotonic()
    try:
        events = client.stream(model=MODEL, api_key=key, request_id=sent.request_id,
                               session_id=session, prompt_token_ids=prompt,
                               max_tokens=max_tokens, temperature=0.0, stream=sent.streamed,
                               timeout=timeout_s)
        async for event in events:
            if event.type in TERMINAL:
                sent.outcome = event.type
                sent.latency_s = time.monotonic() - started
    except RequestTimeoutError:
        sent.outcome = "client_timeout"
    except RequestError:
        sent.outcome = "error"
    except Exception as exc:  # a send that failed (the broker away past the timeout)
        sent.outcome = f"send_failed: {type(exc).__name__}"


def p99_during_faults(report: ChaosReport) -> float | None:
    return percentile(report.fault_latency_s, 0.99)
