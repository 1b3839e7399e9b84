"""`sluice bench chaos`: a seeded, randomized fault run on a cluster of its own, then an
invariant check of everything the reply topic holds.

A three-node Kafka cluster and a PostgreSQL of its own (private state, free
ports), `workers` worker processes of one model, and a load of requests over
many sessions at a steady rate — some streamed, some followed by a cancel. While
the load runs, faults strike at seeded random times, one at a time:

- `worker_kill`: SIGKILL a worker, restart it (same --replica) a moment later;
- `worker_pause`: SIGSTOP a worker past its session timeout, then SIGCONT (the
  zombie: its partitions went to others while it slept);
- `broker_kill`: SIGKILL the broker leading a request partition, restart it later;
- `postgres_restart`: stop PostgreSQL, start it again.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from common.settings import Settings
from common.topics import committed_and_coordinator, partitions_of
from infra import kafka_broker, local, postgres
from infra.common import InfraConfig, free_port, port_in_use
from sluice.bench.harness import latency_figures, percentile
from sluice.client import Client

MODEL = "chaos"
TERMINAL = {"done", "error", "timeout"}
SESSION_TIMEOUT_S = 10.0  # the workers' consumer session (ingest.consumer)
# How long a coordinator that just took over may answer from behind (see
# OffsetWatch) before a lower commit point counts as a rewind.
STALE_READ_GRACE_S = 5.0
Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int = 1
    requests: int = 3000
    rate_per_s: float = 10.0
    sessions: int = 200
    workers: int = 3
    partitions: int = 6
    faults: int = 12
    delivery: str = "exactly_once"
    kinds: tuple[str, ...] = ("worker_kill", "worker_pause", "broker_kill", "postgres_restart")
    stream_share: float = 0.3
    cancel_share: float = 0.03
    max_tokens: tuple[int, int] = (8, 40)
    pause_s: tuple[float, float] = (SESSION_TIMEOUT_S + 4, SESSION_TIMEOUT_S + 10)
    broker_down_s: tuple[float, float] = (8.0, 15.0)
    postgres_down_s: tuple[float, float] = (2.0, 6.0)
    restart_after_s: tuple[float, float] = (1.0, 3.0)
    request_timeout_s: float = 300.0


@dataclass(slots=True)
class Fault:
    kind: str
    at_s: float  # since the load began
    target: str
    ended_s: float | None = None


@dataclass(slots=True)
class Sent:
    request_id: str
    at_s: float
    streamed: bool
    cancelled: bool = False
    outcome: str = "pending"  # done, error, timeout, send_failed, client_timeout
    latency_s: float | None = None


@dataclass(slots=True)
class ChaosReport:
    config: ChaosConfig
    faults: list[Fault] = field(default_factory=list)
    sent: dict[str, Sent] = field(default_factory=dict)
    terminal_histogram: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    offset_samples: int = 0
    stale_offset_reads: list[str] = field(default_factory=list)
    num_records: int = 0
    calm_latency_s: list[float] = field(default_factory=list)
    fault_latency_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        outcomes = Counter(s.outcome for s in self.sent.values())
        def ms(values: list[float]) -> dict[str, Any]:
            return latency_figures([v * 1000 for v in values])
        return {
            "seed": self.config.seed, "delivery": self.config.delivery,
            "requests": len(self.sent), "outcomes": dict(outcomes),
            "terminal_events_per_request": {str(k): v for k, v in
                                            sorted(self.terminal_histogram.items())},
            "violations": len(self.violations), "first_violations": self.violations[:20],
            "faults": [dataclasses.asdict(f) for f in self.faults],
            "offset_samples": self.offset_samples,
            "stale_offset_reads": self.stale_offset_reads,
            "reply_records": self.num_records,
            "end_to_end_calm": ms(self.calm_latency_s),
            "end_to_end_during_faults": ms(self.fault_latency_s),
            "wall_s": round(self.wall_s, 1),
        }


class _Workers:
    """The worker processes, each under its own --replica, with a log file."""

    def __init__(self, settings_env: dict[str, str], count: int, logs: Path):
        self._env = settings_env
        self._logs = logs
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._log_paths: dict[int, Path] = {}
        for replica in range(count):
            self.start(replica)

    def start(self, replica: int) -> None:
        path = self._logs / f"worker-{replica}-{len(self._log_paths)}-{time.time():.0f}.log"
        self._log_paths[replica] = path
        with path.open("wb") as log:
            self.procs[replica] = subprocess.Popen(
                [sys.executable, "-m", "sluice", "worker", "--model", MODEL, "--replica",
                 str(replica)], env=self._env, stdout=log, stderr=subprocess.STDOUT)

    def log(self, replica: int) -> str:
        return self._log_paths[replica].read_text(errors="replace")

    async def wait_serving(self, replica: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "serving chaos as" not in self.log(replica):
            if time.monotonic() > deadline or self.procs[replica].poll() is not None:
                raise RuntimeError(f"worker {replica} did not serve:\n{self.log(replica)[-3000:]}")
            await asyncio.sleep(0.2)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def cluster_config(state_dir: Path) -> InfraConfig:
    """Three Kafka nodes and a PostgreSQL on free ports (node k 100*k above node 1)."""
    for _ in range(50):
        cfg = InfraConfig.from_env(state_dir=state_dir, kafka_port=free_port(),
                                   kafka_controller_port=free_port(),
                                   postgres_port=free_port(), secure=False, brokers=3)
        ports = [port for pair in cfg.kafka_node_ports() for port in pair] + [cfg.postgres_port]
        if len(set(ports)) == len(ports) and not any(port_in_use(p) for p in ports):
            return cfg
    raise RuntimeError("no free ports for a three-node cluster")


async def run_chaos(cfg: ChaosConfig, workdir: Path, model_dir: Path,
                    say: Say = lambda _line: None) -> ChaosReport:
    began = time.monotonic()
    report = ChaosReport(cfg)
    infra = cluster_config(workdir / "infra")
    workers: _Workers | None = None
    try:
        say("starting a three-node Kafka cluster and a PostgreSQL ...")
        started = await asyncio.to_thread(local.up, infra)
        settings = Settings(kafka_bootstrap=str(started["kafka"]["bootstrap"]),
                            database_url=str(started["postgres"]["url"]), db_schema="chaos",
                            topic_prefix="chaos", request_partitions=cfg.partitions)
        env = {**os.environ, "SLUICE_KAFKA_BOOTSTRAP": str(settings.kafka_bootstrap),
               "SLUICE_DATABASE_URL": str(settings.database_url), "SLUICE_DB_SCHEMA": "chaos",
               "SLUICE_TOPIC_PREFIX": "chaos", "SLUICE_METRICS_PORT": "0",
               "SLUICE_COMPILE": "0"}
        client = Client(settings)
        try:
            key = await asyncio.to_thread(_register, client, model_dir, cfg.delivery)
            logs = workdir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            workers = _Workers(env, cfg.workers, logs)
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
                await _load_with_faults(cfg, settings, client, key, workers, infra, report,
                                        say)
            finally:
                pool_log.setLevel(level)
        finally:
            await client.aclose()
        workers.stop_all()
        workers = None
        await _check(settings, report)
    finally:
        if workers is not None:
            workers.stop_all()
        await asyncio.to_thread(local.purge, infra)
    report.wall_s = time.monotonic() - began
    return report


def _register(client: Client, model_dir: Path, delivery: str) -> str:
    client.models.register(model=MODEL, path=str(model_dir),
                           compute_config={"kv_cache_len": 16384, "delivery": delivery})
    key = client.keys.create(tenant="chaos")
    client.keys.grant(key, model=MODEL)
    return key


async def _load_with_faults(cfg: ChaosConfig, settings: Settings, client: Client, key: str,
                            workers: _Workers, infra: InfraConfig, report: ChaosReport,
                            say: Say) -> None:
    rng = random.Random(cfg.seed)
    duration = cfg.requests / cfg.rate_per_s
    # Fault start times spread over the load, each after the one before has ended.
    starts = sorted(rng.uniform(0.05, 0.85) * duration for _ in range(cfg.faults))
    kinds = [cfg.kinds[i % len(cfg.kinds)] for i in range(cfg.faults)]
    rng.shuffle(kinds)
    t0 = time.monotonic()
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(_sample_offsets(settings, report, stop_sampling))
    faults = asyncio.create_task(_faults(cfg, rng, starts, kinds, t0, settings, workers, infra,
                                         report, say))
    tasks: list[asyncio.Task[None]] = []
    cancels: list[asyncio.Task[None]] = []
    for i in range(cfg.requests):
        delay = t0 + i / cfg.rate_per_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = Sent(f"chaos-{cfg.seed}-{i}", time.monotonic() - t0,
                    streamed=rng.random() < cfg.stream_share,
                    cancelled=rng.random() < cfg.cancel_share)
        report.sent[sent.request_id] = sent
        session = f"session-{rng.randrange(cfg.sessions)}"
        tasks.append(asyncio.create_task(_one(
            client, key, sent, session,
            [rng.randrange(3, 200) for _ in range(rng.randrange(3, 12))],
            rng.randint(*cfg.max_tokens), cfg.request_timeout_s)))
        if sent.cancelled:
            cancels.append(asyncio.create_task(_cancel_later(
                client, key, sent.request_id, session, rng.uniform(0.05, 1.0))))
        if (i + 1) % max(1, cfg.requests // 10) == 0:
            say(f"  {i + 1} sent, {sum(t.done() for t in tasks)} ended")
    await faults
    await asyncio.gather(*tasks, *cancels)
    stop_sampling.set()
    await sampler
    windows = [(f.at_s, (f.ended_s or f.at_s) + SESSION_TIMEOUT_S) for f in report.faults]
    for sent in report.sent.values():
        if sent.latency_s is None or sent.outcome != "done":
            continue
        during = any(a <= sent.at_s <= b for a, b in windows)
        (report.fault_latency_s if during else report.calm_latency_s).append(sent.latency_s)


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


async def _faults(cfg: ChaosConfig, rng: random.Random, starts: list[float],
                  kinds: list[str], t0: float, settings: Settings, workers: _Workers,
                  infra: InfraConfig, report: ChaosReport, say: Say) -> None:
    free_at = 0.0
    for start, kind in zip(starts, kinds, strict=True):
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


class OffsetWatch:
    """Commit points read over time, per partition: a value lower than one seen before
    is a rewind (a stale member's commit).

    One exception, Kafka's and not a rewind: a group coordinator that has just taken
    over a `__consumer_offsets` partition (its leader killed) answers OffsetFetch from
    its state as of its own high watermark, which trails the old leader's until the
    surviving replica fetches from it, so for a moment it may report a commit point the
    old one had moved past (the commit is not lost: it is back once the high watermark
    passes it). A lower value read from another coordinator than the one that reported
    the higher, and back at or above the higher within STALE_READ_GRACE_S, is counted
    as a stale read; one that stays lower, or comes from the same coordinator, is a
    rewind. (What a stale read could do to a worker that reads its offsets in that
    moment, a repeated answer, the terminal-event check sees.)"""

    def __init__(self, began: float) -> None:
        self.began = began
        self.highest: dict[int, tuple[int, str, int]] = {}  # partition: offset, meta, node
        self.lower: dict[int, tuple[float, int, str, int]] = {}  # the first lower read
        self.rewinds: list[str] = []
        self.stale_reads: list[str] = []

    def observe(self, partition: int, offset: int, meta: str, node: int, now: float) -> None:
        high = self.highest.get(partition)
        if high is not None and offset < high[0]:
            if node == high[2]:
                self._rewind(partition, now, offset, meta, node)
            elif partition not in self.lower:
                self.lower[partition] = (now, offset, meta, node)
            elif now - self.lower[partition][0] > STALE_READ_GRACE_S:
                self._rewind(partition, *self.lower.pop(partition))
            return
        if high is not None and partition in self.lower:  # caught up: it was stale
            at, low, _meta, low_node = self.lower.pop(partition)
            self.stale_reads.append(
                f"partition {partition}: {low} instead of {high[0]} from coordinator "
                f"{low_node} for {now - at:.1f} s, {at - self.began:.1f} s into the run")
        self.highest[partition] = (offset, meta, node)

    def close(self) -> None:
        """The end of the run: a lower value never caught up with is a rewind."""
        for partition, read in sorted(self.lower.items()):
            self._rewind(partition, *read)
        self.lower.clear()

    def _rewind(self, partition: int, at: float, offset: int, meta: str, node: int) -> None:
        high = self.highest[partition]
        self.rewinds.append(
            f"the committed offset of partition {partition} went back from {high[0]} to "
            f"{offset} ({meta!r}, coordinator {node}; {high[0]} from coordinator {high[2]}), "
            f"{at - self.began:.1f} s into the run")


async def _sample_offsets(settings: Settings, report: ChaosReport, stop: asyncio.Event) -> None:
    """The model group's committed offsets every 200 ms, watched (`OffsetWatch`)."""
    group, topic = settings.topic(MODEL), settings.requests_topic(MODEL)
    consumer = AIOKafkaConsumer(**settings.kafka_options(), enable_auto_commit=False)
    watch = OffsetWatch(time.monotonic())
    with contextlib.suppress(Exception):
        await consumer.start()
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):
                    await stop.wait()
            try:
                partitions = await partitions_of(consumer, topic)
                for partition in partitions:
                    committed, node = await committed_and_coordinator(consumer, group, topic,
                                                                      partition)
                    if committed is not None:
                        watch.observe(partition, *committed, node, time.monotonic())
                        report.offset_samples += 1
            except Exception:  # the broker away: sample again next time
                continue
    finally:
        watch.close()
        report.violations.extend(watch.rewinds)
        report.stale_offset_reads.extend(watch.stale_reads)
        with contextlib.suppress(Exception):
            await consumer.stop()


async def _read_all(settings: Settings, topic: str, isolation: str) -> list[dict[str, Any]]:
    consumer = AIOKafkaConsumer(**settings.kafka_options(), enable_auto_commit=False,
                                isolation_level=isolation)
    await consumer.start()
    out: list[dict[str, Any]] = []
    try:
        tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(consumer, topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        async with asyncio.timeout(300):
            while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
                batch = await consumer.getmany(*tps, timeout_ms=500)
                for records in batch.values():
                    out.extend(orjson.loads(r.value) for r in records if r.value)
    finally:
        await consumer.stop()
    return out


async def _check(settings: Settings, report: ChaosReport) -> None:
    """Read the reply topic back and hold it to the invariants."""
    committed = await _read_all(settings, settings.topic("results"), "read_committed")
    report.num_records = len(committed)
    exactly_once = report.config.delivery == "exactly_once"
    terminals: dict[str, list[dict[str, Any]]] = defaultdict(list)
    tokens: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)
    for event in committed:
        request_id = event.get("request_id")
        if request_id not in report.sent:
            report.violations.append(f"an answer for {request_id!r}, never sent")
            continue
        if event["type"] in TERMINAL:
            terminals[request_id].append(event)
        elif event["type"] == "token":
            tokens[(request_id, event.get("attempt", 0))][event["seq"]] = event["text"]
    histogram: Counter[int] = Counter()
    for request_id, sent in report.sent.items():
        ends = terminals.get(request_id, [])
        histogram[len(ends)] += 1
        unsure = sent.outcome.startswith("send_failed")  # may or may not be on the topic
        if not ends and not unsure:
            report.violations.append(f"{request_id} ({sent.outcome}) has no terminal event")
        if exactly_once and len(ends) > 1:
            report.violations.append(
                f"{request_id}: {len(ends)} committed terminal events "
                f"(attempts {[e.get('attempt', 0) for e in ends]})")
        attempts = [e.get("attempt", 0) for e in ends]
        if not exactly_once and len(set(attempts)) != len(attempts):
            report.violations.append(f"{request_id}: answered twice under one attempt "
                                     f"({attempts})")
        texts = {e["text"] for e in ends if e["type"] == "done"
                 and e.get("finish_reason") != "cancelled"}
        if len(texts) > 1:
            report.violations.append(f"{request_id}: its answers differ ({len(texts)} texts)")
        for done in (e for e in ends if e["type"] == "done" and sent.streamed):
            pieces = tokens.get((request_id, done.get("attempt", 0)), {})
            streamed = "".join(pieces[s] for s in sorted(pieces))
            if streamed != done["text"]:
                report.violations.append(
                    f"{request_id} attempt {done.get('attempt', 0)}: streamed "
                    f"{streamed[:40]!r} but done.text is {done['text'][:40]!r}")
    report.terminal_histogram = dict(histogram)
    if exactly_once:  # what aborted transactions left is only for read_uncommitted eyes
        everything = await _read_all(settings, settings.topic("results"), "read_uncommitted")
        report.num_records = max(report.num_records, len(everything))


def p99_during_faults(report: ChaosReport) -> float | None:
    return percentile(report.fault_latency_s, 0.99)
