"""Reading a reply topic for the SDK: one consumer per topic, events routed by request id.

The reader is assigned every partition of the reply topic and starts at the
end offsets it resolved *before* any request is sent, so no event of a
request sent afterwards can be missed. Attempts are hidden here: events of a
superseded attempt are dropped, and a retried attempt's tokens are passed on
only past what the earlier attempt already delivered (for greedy or seeded
requests the retried tokens are identical, so the stream reads as one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas import REPLY_EVENT_ADAPTER, TERMINAL_TYPES, ReplyEvent, TokenEvent
from sluice.topics import partitions_of


@dataclass(slots=True)
class _Subscription:
    queue: asyncio.Queue[ReplyEvent] = field(default_factory=asyncio.Queue)


class ReplyReader:
    def __init__(self, bootstrap: str, topic: str):
        self.topic = topic
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False,
            isolation_level="read_committed",
        )
        self._subs: dict[str, _Subscription] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        partitions = await partitions_of(self._consumer, self.topic)
        if not partitions:
            await self._consumer.stop()
            raise ValueError(f"reply topic {self.topic!r} does not exist")
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_end(*tps)
        for tp in tps:  # resolve positions now, before any request is sent
            await self._consumer.position(tp)
        self._task = asyncio.create_task(self._pump())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()

    def subscribe(self, request_id: str) -> _Subscription:
        sub = _Subscription()
        self._subs[request_id] = sub
        return sub

    def unsubscribe(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    async def _pump(self) -> None:
        while True:
            batch = await self._consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    self._route(record.value)

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


async def hide_attempts(sub: _Subscription) -> AsyncIterator[ReplyEvent]:
    """Events of one request as if it had run once; ends after the terminal event."""
    attempt = -1
    delivered = 0  # tokens passed on so far, over all attempts
    in_attempt = 0  # tokens seen in the current attempt
    next_seq = 0
    while True:
        event = await sub.queue.get()
        if event.attempt < attempt:
            continue
        if event.attempt > attempt:
            attempt, in_attempt, next_seq = event.attempt, 0, 0
        if isinstance(event, TokenEvent):
            if event.seq < next_seq:
                continue  # a duplicate (producer retry)
            next_seq = event.seq + 1
            start = in_attempt
            in_attempt += len(event.token_ids)
            if in_attempt <= delivered:
                continue
            skip = max(0, delivered - start)
            if skip:
                event = event.model_copy(update={"token_ids": event.token_ids[skip:], "text": ""})
            delivered = in_attempt
            yield event
        elif event.type in TERMINAL_TYPES:
            yield event
            return
