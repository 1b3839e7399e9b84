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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from common.broker_loss import let_go_of_fenced_brokers
from common.safe_fetch import SafeFetcher
from common.settings import Settings
from common.topics import partitions_of
from schemas import REPLY_EVENT_ADAPTER, TERMINAL_TYPES, Outcome, ReplyEvent, TokenEvent
from sluice.errors import NotFoundError, SluiceError

log = logging.getLogger(__name__)


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
            isolation_level="read_committed",
        )
        let_go_of_fenced_brokers(self._consumer._client, f"the reader of {topic}")
        self._fetcher = SafeFetcher(self._consumer)
        self._subs: dict[str, _Subscription] = {}
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None

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
            records, unreadable = await self._fetcher.getmany(timeout_ms=500, max_records=1024)
            for bad in unreadable:
                log.warning("a reply was skipped: %s", bad.reason)
            for record in records:
                self._route(record.value)

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
