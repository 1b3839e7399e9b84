"""Reading a reply topic for the SDK: one consumer per topic, events routed by request id.

The reader is assigned every partition of the reply topic and starts at the
end offsets it resolved *before* any request is sent, so no event of a
request sent afterwards can be missed. It reads `read_committed`, so events a
transactional writer aborted are never seen. Attempts are hidden here: token
events of a superseded attempt are dropped, and a retried attempt's tokens and
text are passed on only past what the earlier attempt already delivered (for
greedy or seeded requests the retried tokens are identical, so the stream
reads as one). The one terminal event passed on is the request's outcome by
`schemas.Outcome`'s rule, applied to every event read so far: since the reader
started before the request was sent, nothing earlier of it can be missing.

If the reader's consumer fails for good (the topic may not be read, say),
every waiting request gets the error instead of waiting forever.

A fetch the broker answers "offset out of range" never moves the reader to the
partition's end (the consumer's `latest` reset skipped every reply written in
between: `sluice bench chaos`, a leader cut off from the other brokers, 20 answers
never seen by their clients though on the topic). The reader goes on from where it
was; only records the log no longer holds (retention) are passed over, and a
position still beyond the log's end after OUT_OF_RANGE_PATIENCE_S (a leader that
lost records) reads on from the lowest end seen meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError, OffsetOutOfRangeError

from common.broker_loss import let_go_of_fenced_brokers
from common.safe_fetch import SafeFetcher
from common.settings import Settings
from common.topics import partitions_of
from schemas import REPLY_EVENT_ADAPTER, TERMINAL_TYPES, Outcome, ReplyEvent, TokenEvent
from sluice.errors import NotFoundError, SluiceError

log = logging.getLogger(__name__)

# How long a position beyond a partition's end is taken for a stale or replaced
# leader's answer, asked again every OUT_OF_RANGE_RETRY_S, before the reader accepts
# that the log lost those offsets and reads on from its end.
OUT_OF_RANGE_PATIENCE_S = 30.0
OUT_OF_RANGE_RETRY_S = 0.5
OUT_OF_RANGE_LOOKUP_S = 5.0  # the offsets' lookup, at most


class ReplyReaderError(SluiceError):
    """The reply topic could not be read; no reply can arrive."""


@dataclass(slots=True)
class _Subscription:
    queue: asyncio.Queue[ReplyEvent | BaseException] = field(default_factory=asyncio.Queue)


class ReplyReader:
    def __init__(self, settings: Settings, topic: str):
        self.topic = topic
        self._consumer = AIOKafkaConsumer(
            **settings.kafka_options(), enable_auto_commit=False,
            isolation_level="read_committed", auto_offset_reset="none",
        )
        let_go_of_fenced_brokers(self._consumer._client, f"the reader of {topic}")
        self._fetcher = SafeFetcher(self._consumer)
        self._subs: dict[str, _Subscription] = {}
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None
        # Partitions whose position was answered out of range: (since, last seen, the
        # lowest end offset seen), monotonic seconds.
        self._out_of_range: dict[TopicPartition, tuple[float, float, int]] = {}

    async def start(self) -> None:
        await self._consumer.start()
        partitions = await partitions_of(self._consumer, self.topic)
        if not partitions:
            await self._consumer.stop()
            raise NotFoundError(
                f"reply topic {self.topic!r} does not exist, or this client's principal may "
                "not DESCRIBE it (Kafka ACLs); create it first, or leave reply_topic out to use "
                "the shared results topic")
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_end(*tps)
        for tp in tps:  # resolve positions now, before any request is sent
            self._fetcher.assigned(tp, await self._consumer.position(tp))
        self._task = asyncio.create_task(self._pump())
        self._task.add_done_callback(self._pump_ended)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()

    def subscribe(self, request_id: str) -> _Subscription:
        if self.failure is not None:
            raise self._error()
        sub = _Subscription()
        self._subs[request_id] = sub
        return sub

    def unsubscribe(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    async def _pump(self) -> None:
        while True:
            try:
                records, unreadable = await self._fetcher.getmany(timeout_ms=500,
                                                                  max_records=1024)
            except OffsetOutOfRangeError as exc:
                await self._back_in_range(exc)
                continue
            for bad in unreadable:
                log.warning("a reply was skipped: %s", bad.reason)
            for record in records:
                self._route(record.value)

    async def _back_in_range(self, exc: OffsetOutOfRangeError) -> None:
        """Go on where the reader was: the records from there on are the replies it has
        not seen (a leader cut off or just replaced answers "out of range" for offsets
        the partition's real leader holds)."""
        found = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
        tps = list(found) or sorted(self._consumer.assignment())
        self._consumer._client.force_metadata_update()  # the leader may have moved
        await asyncio.sleep(OUT_OF_RANGE_RETRY_S)
        try:  # bounded: every partition's replies wait while this one is looked up
            async with asyncio.timeout(OUT_OF_RANGE_LOOKUP_S):
                first, last = await asyncio.gather(self._consumer.beginning_offsets(tps),
                                                   self._consumer.end_offsets(tps))
        except (KafkaError, TimeoutError) as lookup:  # brokers away: the next fetch asks
            log.info("reply partitions %s: their offsets could not be looked up (%r)",
                     sorted(tp.partition for tp in tps), lookup)
            return
        now = time.monotonic()
        for tp in tps:
            want = self._fetcher.resume_offset(tp)
            if want is None:
                want = found.get(tp, first[tp])
            # (since, last seen, the lowest end seen) of this partition's episode; one
            # not seen for a while is over, and this is a new one.
            since, seen, lowest = self._out_of_range.get(tp, (now, now, last[tp]))
            if now - seen > OUT_OF_RANGE_PATIENCE_S:
                since, lowest = now, last[tp]
            lowest = min(lowest, last[tp])
            self._out_of_range[tp] = (since, now, lowest)
            if want < first[tp]:
                log.warning("reply partition %d: offsets %d-%d are no longer in the log "
                            "(retention); reading on from %d", tp.partition, want,
                            first[tp] - 1, first[tp])
                want = first[tp]
            elif want > last[tp] and now - since > OUT_OF_RANGE_PATIENCE_S:
                # From the lowest end seen: replies written since are read, not skipped.
                log.warning("reply partition %d: offset %d is still past the log's end "
                            "after %.0f s (its leader lost records); reading on from %d",
                            tp.partition, want, now - since, lowest)
                want = lowest
                del self._out_of_range[tp]
            else:
                log.info("reply partition %d: offset %d was answered out of range "
                         "(the log holds %d-%d now); reading on from it", tp.partition,
                         want, first[tp], last[tp])
            self._consumer.seek(tp, want)

    def _pump_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        self.failure = task.exception() or RuntimeError("the reply reader stopped")
        log.error("reading reply topic %s failed: %s", self.topic, self.failure)
        error = self._error()
        for sub in self._subs.values():
            sub.queue.put_nowait(error)

    def _error(self) -> ReplyReaderError:
        return ReplyReaderError(f"reading reply topic {self.topic!r} failed: "
                                f"{type(self.failure).__name__}: {self.failure}")

    def _route(self, value: bytes | None) -> None:
        if value is None:
            return
        try:
            event = REPLY_EVENT_ADAPTER.validate_json(value, strict=True)
        except ValueError:
            return  # not ours to judge: other producers may share a reply topic
        sub = self._subs.get(event.request_id)
        if sub is not None:
            sub.queue.put_nowait(event)


async def hide_attempts(sub: _Subscription, outcome: Outcome) -> AsyncIterator[ReplyEvent]:
    """Events of one request as if it had run once; ends after its terminal event.

    Every event goes into `outcome`, which the caller may read at any moment (its
    deadline, say). The stream ends at a terminal event of the highest attempt seen,
    passing on the outcome: that event, unless it is a timeout and an earlier attempt
    answered (then that answer). A terminal event of a superseded attempt does not end
    it: the newer attempt is still running and ends with its own.

    Counts tokens and characters delivered over all attempts, so a retried
    attempt continues where the stream stood; a token-less event (the last of
    a stream's text) passes when it carries new text."""
    delivered_tokens = delivered_chars = 0  # passed on so far, over all attempts
    in_tokens = in_chars = 0  # seen in the current attempt
    next_seq = 0
    while True:
        item = await sub.queue.get()
        if isinstance(item, BaseException):
            raise item
        event = item
        newer = event.attempt > outcome.attempt
        if not outcome.add(event):
            continue  # a superseded attempt's: its tokens are dropped, its end remembered
        if newer:
            in_tokens, in_chars, next_seq = 0, 0, 0
        if isinstance(event, TokenEvent):
            if event.seq < next_seq:
                continue  # a duplicate (producer retry)
            next_seq = event.seq + 1
            start_tokens, start_chars = in_tokens, in_chars
            in_tokens += len(event.token_ids)
            in_chars += len(event.text)
            if in_tokens <= delivered_tokens and in_chars <= delivered_chars:
                continue
            skip_tokens = max(0, delivered_tokens - start_tokens)
            skip_chars = max(0, delivered_chars - start_chars)
            if skip_tokens or skip_chars:
                event = event.model_copy(update={"token_ids": event.token_ids[skip_tokens:],
                                                 "text": event.text[skip_chars:]})
            delivered_tokens = max(delivered_tokens, in_tokens)
            delivered_chars = max(delivered_chars, in_chars)
            yield event
        elif event.type in TERMINAL_TYPES:
            assert outcome.event is not None  # it holds this event, or an answer beating it
            yield outcome.event
            return
