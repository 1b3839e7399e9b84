"""Reading a consumer's records without ever getting stuck behind one bad record.

aiokafka decodes a fetched record batch lazily, inside `getmany`. A batch it
cannot decode (a codec library missing, a corrupt batch) raises out of
`getmany` with no word of which partition or offset, and worse: records of
the same call that were already unpacked, on that partition and others, are
dropped while their positions have moved on. Left alone, the next call skips
them silently, or raises again on the same batch forever.

`SafeFetcher.getmany` keeps, per partition, the offset one past the last
record it handed over. When the library raises a record error it seeks every
partition back there (nothing dropped is lost) and reads one record per
partition per call until the failing partition raises again; the offset it
stands at is then reported as `Unreadable` and skipped, and reading goes back
to whole batches. Partitions keep flowing: a bad batch costs one pass of
single-record reads and one `Unreadable` per offset it holds.

Errors of the broker or the client (authorization, a stopped consumer) are
not record errors: they propagate for the caller to report.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CorruptRecordException, KafkaError, UnsupportedCodecError
from aiokafka.structs import ConsumerRecord

from common.timeouts import within

log = logging.getLogger(__name__)

# How long a single-record read waits for a partition's data to be fetched.
CAREFUL_WAIT_MS = 500
# Records read one at a time without a failure before whole batches are read again
# (a partition that never runs dry would otherwise keep the slow path forever).
CAREFUL_BUDGET = 2048


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An offset whose record the client library could not hand over."""

    tp: TopicPartition
    offset: int
    reason: str


def is_record_error(exc: BaseException) -> bool:
    """A failure to decode fetched records, as opposed to one of the broker or client."""
    if isinstance(exc, UnsupportedCodecError | CorruptRecordException):
        return True
    if isinstance(exc, KafkaError | AssertionError | RuntimeError):
        return False
    # Raised while unpacking: a decompressor's error, struct.error, ValueError, ...
    return isinstance(exc, Exception)


def describe(exc: BaseException) -> str:
    name, text = type(exc).__name__, str(exc)
    if not text or text.startswith(name):  # aiokafka's errors name themselves
        return text or name
    return f"{name}: {text}"


@dataclass(slots=True)
class SafeFetcher:
    consumer: AIOKafkaConsumer
    # One past the last offset handed over, per partition.
    _next: dict[TopicPartition, int] = field(default_factory=dict)
    # Where a partition started when nothing was handed over yet (None: the beginning).
    _start: dict[TopicPartition, int | None] = field(default_factory=dict)
    _careful: bool = False
    _careful_left: int = 0
    num_record_errors: int = 0

    def assigned(self, tp: TopicPartition, start_offset: int | None) -> None:
        """`tp` was assigned and will be read from `start_offset` (None: from where the
        consumer's reset policy puts it, which is what a rewind then uses too)."""
        self._next.pop(tp, None)
        self._start[tp] = start_offset

    def resume_offset(self, tp: TopicPartition) -> int | None:
        """Where reading `tp` goes on: one past the last record handed over, else where
        it was started (None: from the beginning, or not known)."""
        return self._next.get(tp, self._start.get(tp))

    def revoked(self, tp: TopicPartition) -> None:
        self._next.pop(tp, None)
        self._start.pop(tp, None)

    async def getmany(self, timeout_ms: int,
                      max_records: int) -> tuple[list[ConsumerRecord], list[Unreadable]]:
        """Records in partition order, and offsets that could not be read (each to be
        answered for, e.g. dead-lettered, by the caller)."""
        if self._careful:
            return await self._careful_read(max_records, timeout_ms)
        try:
            batch = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        except Exception as exc:
            if not is_record_error(exc):
                raise
            self.num_record_errors += 1
            log.warning("the Kafka client could not decode fetched records (%s); rereading "
                        "one record at a time to find the bad one", describe(exc))
            await self._rewind()
            self._careful, self._careful_left = True, CAREFUL_BUDGET
            return [], []
        records = [r for tp in sorted(batch, key=lambda t: (t.topic, t.partition))
                   for r in batch[tp]]
        self._handed_over(records)
        return records, []

    def _handed_over(self, records: list[ConsumerRecord]) -> None:
        for record in records:
            self._next[TopicPartition(record.topic, record.partition)] = record.offset + 1

    async def _rewind(self) -> None:
        """Seek every partition back to one past what was handed over: records the
        failed call had unpacked (and dropped) are read again."""
        for tp in self.consumer.assignment():
            if tp in self._next:
                self.consumer.seek(tp, self._next[tp])
            elif self._start.get(tp) is not None:
                self.consumer.seek(tp, self._start[tp])  # type: ignore[arg-type]
            else:
                await self.consumer.seek_to_beginning(tp)

    async def _careful_read(self, max_records: int, timeout_ms: int
                            ) -> tuple[list[ConsumerRecord], list[Unreadable]]:
        records: list[ConsumerRecord] = []
        paused = self.consumer.paused()
        pending = sorted((tp for tp in self.consumer.assignment() if tp not in paused),
                         key=lambda t: (t.topic, t.partition))
        if not pending:  # all paused: the bad batch is still ahead
            await asyncio.sleep(timeout_ms / 1000)
            return [], []
        while pending and len(records) < max_records:
            for tp in list(pending):
                try:
                    got = await self.consumer.getmany(tp, timeout_ms=self._wait_ms(tp),
                                                      max_records=1)
                except Exception as exc:
                    if not is_record_error(exc):
                        if records:  # handed over already: the error comes again next call
                            return records, []
                        raise
                    return records, [await self._skip(tp, exc)]
                if not got:
                    pending.remove(tp)  # caught up (or nothing fetched in time)
                    continue
                self._handed_over(got[tp])
                records += got[tp]
        self._careful_left -= len(records)
        if not pending or self._careful_left <= 0:
            # Read past what was buffered without failing: the error was not (or no
            # longer) there, so go back to whole batches.
            self._careful = False
        return records, []

    def _wait_ms(self, tp: TopicPartition) -> int:
        """No wait for a partition known to be caught up with its high watermark."""
        high = self.consumer.highwater(tp)
        if high is not None and self._next.get(tp, -1) >= high:
            return 0
        return CAREFUL_WAIT_MS

    async def _skip(self, tp: TopicPartition, exc: Exception) -> Unreadable:
        offset = await within(30, self.consumer.position(tp))
        self.consumer.seek(tp, offset + 1)
        self._next[tp] = offset + 1
        self._careful = False
        reason = (f"the Kafka client could not read the record at offset {offset} of "
                  f"{tp.topic}/{tp.partition}: {describe(exc)}")
        log.error("%s; skipping it", reason)
        return Unreadable(tp, offset, reason)
