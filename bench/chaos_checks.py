"""The chaos run's checks: the consumer group's commit points watched while the load
runs, and the reply topic read back at the end and held to the invariants."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, defaultdict
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.chaos_report import MODEL, TERMINAL, ChaosReport
from common.settings import Settings
from common.topics import committed_and_coordinator, partitions_of

# How long a coordinator that just took over may answer from behind (see
# OffsetWatch) before a lower commit point counts as a rewind.
STALE_READ_GRACE_S = 5.0
# One look at the cluster's capacity (after a fault heals) waits this long at most.
PROBE_S = 3.0
# Reading the reply topic back: at most this many reads, this far apart, while a
# request seems unanswered (`check_replies`).
REPLY_READS = 4
REREAD_AFTER_S = 10.0


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


async def sample_offsets(settings: Settings, report: ChaosReport, stop: asyncio.Event) -> None:
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


def _unanswered(committed: list[dict[str, Any]], report: ChaosReport) -> list[str]:
    """Requests sent (not refused at the send) with no terminal event in `committed`."""
    ended = {e.get("request_id") for e in committed if e.get("type") in TERMINAL}
    return [request_id for request_id, sent in report.sent.items()
            if request_id not in ended and not sent.outcome.startswith("send_failed")]


async def check_replies(settings: Settings, report: ChaosReport) -> None:
    """Read the reply topic back and hold it to the invariants.

    Read again (REPLY_READS at most, REREAD_AFTER_S apart) while a request has no
    terminal event: a read that starts as the last fault heals can, it seems, take its
    end offsets from a leader that was cut off and has not yet learned it was replaced
    (a run counted 34 answers its client had read as missing). An answer never written
    stays missing in every read; the report says how many reads there were."""
    for read in range(1, REPLY_READS + 1):
        committed = await _read_all(settings, settings.topic("results"), "read_committed")
        report.reply_reads = read
        if read == REPLY_READS or not _unanswered(committed, report):
            break
        await asyncio.sleep(REREAD_AFTER_S)
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


class CapacityProbe:
    """Whether the cluster serves at full capacity: every request partition has a
    leader, and the model's consumer group is stable with all `workers` members and
    every request partition assigned (what a fault takes away and a heal gives back)."""

    def __init__(self, settings: Settings, workers: int) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        self._group, self._topic = settings.topic(MODEL), settings.requests_topic(MODEL)
        self._workers = workers
        self._options = settings.kafka_options()
        self._admin = AIOKafkaAdminClient(**self._options)
        self._started = False
        self.why = ""  # why the last `serving` said no

    async def serving(self) -> bool:
        from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

        try:
            if not self._started:
                await self._admin.start()
                self._started = True
            described = (await self._admin.describe_topics([self._topic]))[0]
            partitions = {p["partition"] for p in described["partitions"]}
            leaderless = sorted(p["partition"] for p in described["partitions"]
                                if p["leader"] < 0)
            if not partitions or leaderless:
                self.why = f"partitions without a leader: {leaderless or 'all'}"
                return False
            response = (await self._admin.describe_consumer_groups([self._group]))[0]
            group = response.to_object()["groups"][0]
            if group["error_code"] or group["state"] != "Stable":
                self.why = f"group {group['state']} (error {group['error_code']})"
                return False
            members = group["members"]
            assigned: set[int] = set()
            for member in members:
                decoded = ConsumerProtocolMemberAssignment.decode(member["member_assignment"])
                assigned |= {tp.partition for tp in decoded.partitions()
                             if tp.topic == self._topic}
            if len(members) != self._workers or assigned != partitions:
                self.why = (f"{len(members)} members, partitions "
                            f"{sorted(partitions - assigned)} unassigned")
                return False
            return True
        except Exception as exc:  # a broker or the coordinator away: not serving fully yet
            self.why = f"{type(exc).__name__}: {exc}"
            await self._reconnect()
            return False

    async def _reconnect(self) -> None:
        """A fresh admin client: one whose broker was killed may keep failing."""
        from aiokafka.admin import AIOKafkaAdminClient

        if self._started:
            with contextlib.suppress(Exception):
                await self._admin.close()
        self._admin = AIOKafkaAdminClient(**self._options)
        self._started = False

    async def wait_back(self, timeout_s: float) -> float | None:
        """Seconds until `serving` holds (polled every 0.25 s); None past `timeout_s`."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            try:
                async with asyncio.timeout(PROBE_S):
                    if await self.serving():
                        return round(time.monotonic() - began, 2)
            except TimeoutError:  # asked a broker that is gone: ask another
                self.why = f"no answer within {PROBE_S:g} s"
                await self._reconnect()
            await asyncio.sleep(0.25)
        return None

    async def close(self) -> None:
        if self._started:
            with contextlib.suppress(Exception):
                await self._admin.close()
