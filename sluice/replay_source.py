"""Reading a topic's logged records back for `sluice replay`: the `--from` / `--to`
positions, the offset ranges they name (times looked up per partition), a plain
reader of those ranges that never joins a consumer group, the requests decoded from
the request topic, and the original answers from a reply topic."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from common.kafka_connect import connect
from common.safe_fetch import SafeFetcher, Unreadable, is_record_error
from common.settings import Settings
from common.timeouts import dependency_call
from common.topics import partitions_of
from schemas import (
    MAX_MESSAGE_BYTES,
    REPLY_EVENT_ADAPTER,
    TERMINAL_TYPES,
    DoneEvent,
    InferenceRequest,
    Outcome,
    SchemaError,
    is_cancel,
    validate,
)
from schemas.codec import loads_object
from sluice.errors import NotFoundError, SluiceError

# A partition whose position does not move for this long, short of its stop offset,
# is reported instead of waited on forever.
STALL_S = 60.0
_RELATIVE = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_OFFSETS = re.compile(r"^\d+:\d+(?:,\d+:\d+)*$")


class ReplayInputError(ValueError):
    """A `--from` / `--to` that cannot be understood."""


@dataclass(frozen=True, slots=True)
class Position:
    """Where a range starts or stops: a time (epoch ms), the log's beginning, or an
    offset per named partition."""

    time_ms: int | None = None
    offsets: dict[int, int] | None = None
    earliest: bool = False


def parse_position(text: str, *, now_ms: int | None = None) -> Position:
    """`2024-05-24T10:00:00Z` (no zone: local time), `1716544800000` (epoch ms),
    `-24h` / `-30m` / `-2d` / `-90s` (before now), `earliest`, or `0:120,3:7`."""
    raw = text.strip()
    if raw.lower() in ("earliest", "beginning"):
        return Position(earliest=True)
    if _OFFSETS.match(raw):
        offsets: dict[int, int] = {}
        for pair in raw.split(","):
            partition, offset = (int(x) for x in pair.split(":"))
            if partition in offsets:
                raise ReplayInputError(f"partition {partition} is named twice in {text!r}")
            offsets[partition] = offset
        return Position(offsets=offsets)
    if raw.isdigit():
        return Position(time_ms=int(raw))
    relative = _RELATIVE.match(raw)
    if relative:
        now = now_ms if now_ms is not None else int(time.time() * 1000)
        return Position(time_ms=now - int(float(relative[1]) * _UNIT_MS[relative[2]]))
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise ReplayInputError(
            f"{text!r} is not a time or offsets: use an ISO-8601 date-time "
            "(2024-05-24T10:00:00Z; without a zone, local time), epoch milliseconds, "
            "a time before now (-24h, -30m, -2d), `earliest`, or offsets P:O,P:O") from None
    return Position(time_ms=int(when.timestamp() * 1000))  # naive: local time, as Kafka's tools


def format_offsets(offsets: dict[int, int]) -> str:
    return ",".join(f"{p}:{o}" for p, o in sorted(offsets.items()))


Ranges = dict[TopicPartition, tuple[int, int]]


class RangeReader:
    """Reads [start, stop) of partitions of one topic: assigned, no consumer group (no
    offsets committed anywhere), read_committed, past records the client cannot decode."""

    def __init__(self, settings: Settings, topic: str):
        self.settings = settings
        self.topic = topic
        self.consumer = AIOKafkaConsumer(**settings.kafka_options(), group_id=None,
                                         enable_auto_commit=False,
                                         isolation_level="read_committed")
        self.fetcher = SafeFetcher(self.consumer)
        self.partitions: list[TopicPartition] = []

    async def start(self) -> bool:
        """Connect; False when the topic does not exist."""
        await connect(self.consumer.start(), self.settings, f"reading {self.topic}")
        found = await self._call("looking up the topic's partitions",
                                 partitions_of(self.consumer, self.topic))
        self.partitions = [TopicPartition(self.topic, p) for p in sorted(found)]
        return bool(self.partitions)

    async def stop(self) -> None:
        await self.consumer.stop()

    async def _call(self, what: str, call: Any) -> Any:
        return await dependency_call(f"{what} of {self.topic}", call,
                                     self.settings.client.timeout_secs)

    async def end_offsets(self) -> dict[TopicPartition, int]:
        # read_committed: the last stable offsets (no open transaction below them).
        return await self._call("reading the end offsets",
                                self.consumer.end_offsets(self.partitions))

    async def ranges(self, start: Position, stop: Position | None) -> Ranges:
        tps = self.partitions
        known = {tp.partition for tp in tps}
        for position in (start, stop):
            unknown = set((position.offsets if position else None) or {}) - known
            if unknown:
                raise ReplayInputError(
                    f"{self.topic} has no partition {', '.join(map(str, sorted(unknown)))} "
                    f"(it has {len(tps)}: 0-{len(tps) - 1})")
        ends = await self.end_offsets()
        begins = await self._call("reading the first offsets",
                                  self.consumer.beginning_offsets(tps))
        starts = await self._offsets(start, begins, ends)
        stops = ends if stop is None else await self._offsets(stop, begins, ends)
        # Clamped into the log as it is: retention may have deleted the start, and the
        # end at this moment caps every range.
        return {tp: (min(max(starts[tp], begins[tp]), ends[tp]), min(stops[tp], ends[tp]))
                for tp in tps}

    async def _offsets(self, position: Position, begins: dict[TopicPartition, int],
                       ends: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        if position.earliest:
            return dict(begins)
        if position.offsets is not None:  # partitions not named: nothing (at their end)
            return {tp: position.offsets.get(tp.partition, ends[tp]) for tp in self.partitions}
        return await self.offsets_at(position.time_ms or 0, ends)

    async def offsets_at(self, time_ms: int,
                         ends: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Per partition, the first offset at or after `time_ms` (its end if none)."""
        found = await self._call("looking up offsets by time", self.consumer.offsets_for_times(
            {tp: max(0, time_ms) for tp in self.partitions}))
        return {tp: (found[tp].offset if found.get(tp) is not None else ends[tp])
                for tp in self.partitions}

    async def first_timestamp(self, ranges: Ranges) -> int | None:
        """The earliest broker timestamp of the first record of each range."""
        active = [tp for tp, (start, stop) in ranges.items() if start < stop]
        self.consumer.assign(active)
        first: list[int] = []
        for tp in active:
            self.consumer.seek(tp, ranges[tp][0])
            try:
                got = await self.consumer.getmany(tp, timeout_ms=5000, max_records=1)
            except Exception as exc:
                if not is_record_error(exc):
                    raise
                continue  # a batch the client cannot decode: the next partition decides
            first += [r.timestamp for r in got.get(tp, []) if r.offset < ranges[tp][1]]
        return min(first) if first else None

    async def read(self, ranges: Ranges, on_gap: Callable[[int], None] | None = None
                   ) -> AsyncIterator[ConsumerRecord | Unreadable]:
        """The records of each range in offset order per partition, and offsets the client
        could not read. `on_gap(n)`: offsets of a finished range that were no records
        (transaction markers, aborted records), so progress can count offsets."""
        stops = {tp: stop for tp, (start, stop) in ranges.items() if start < stop}
        seen = dict.fromkeys(stops, 0)
        self.consumer.assign(list(stops))
        for tp in stops:
            self.consumer.seek(tp, ranges[tp][0])
            self.fetcher.assigned(tp, ranges[tp][0])
        moved_at, last = time.monotonic(), -1
        while stops:
            records, unreadable = await self.fetcher.getmany(timeout_ms=500, max_records=500)
            for item in [*records, *unreadable]:
                tp = item.tp if isinstance(item, Unreadable) else \
                    TopicPartition(item.topic, item.partition)
                if tp in stops and item.offset < stops[tp]:
                    seen[tp] += 1
                    yield item
            positions = 0
            for tp in list(stops):
                position = await self._call("reading a position", self.consumer.position(tp))
                positions += position
                if position >= stops[tp]:
                    self.consumer.pause(tp)
                    if on_gap is not None:
                        on_gap(ranges[tp][1] - ranges[tp][0] - seen[tp])
                    del stops[tp]
            if positions != last:
                moved_at, last = time.monotonic(), positions
            elif stops and time.monotonic() - moved_at > STALL_S:
                where = ", ".join(f"{tp.partition} before offset {stop}"
                                  for tp, stop in stops.items())
                raise SluiceError(f"reading {self.topic} stopped advancing for {STALL_S:.0f} s "
                                  f"(partition {where}); nothing more could be fetched")


def parse_request(value: bytes | None) -> InferenceRequest | str:
    """The record's request, or why it is skipped: "cancel" or "invalid"."""
    if value is None:
        return "invalid"
    try:
        obj = loads_object(value, MAX_MESSAGE_BYTES)  # larger ones were never served
        if is_cancel(obj):
            return "cancel"
        return validate(InferenceRequest, obj)
    except SchemaError:
        return "invalid"


async def read_originals(settings: Settings, topic: str, model: str,
                         since_ms: int) -> dict[str, DoneEvent]:
    """request_id -> the original answer of each request of model `model` on reply topic
    `topic`, of replies written from `since_ms` up to the end at this moment: the
    request's outcome by `schemas.Outcome`, where that is a `done` event."""
    reader = RangeReader(settings, topic)
    try:
        if not await reader.start():
            raise NotFoundError(f"original reply topic {topic!r} does not exist, or this "
                                "client's principal may not DESCRIBE it (Kafka ACLs)")
        ends = await reader.end_offsets()
        starts = await reader.offsets_at(since_ms, ends)
        outcomes: dict[str, Outcome] = {}
        async for record in reader.read({tp: (starts[tp], ends[tp]) for tp in ends}):
            if isinstance(record, Unreadable) or record.value is None:
                continue
            try:
                event = REPLY_EVENT_ADAPTER.validate_json(record.value, strict=True)
            except ValueError:
                continue  # not a reply event: other producers may share a reply topic
            if event.type in TERMINAL_TYPES:  # token events change no outcome
                outcomes.setdefault(event.request_id, Outcome()).add(event)
        return {request_id: outcome.event for request_id, outcome in outcomes.items()
                if isinstance(outcome.event, DoneEvent) and outcome.event.model == model}
    finally:
        await reader.stop()
