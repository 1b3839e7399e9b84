"""The producer `results.delivery` writes through: a small port, and Kafka's.

`ProducerPort` is all delivery needs of a producer, so its policy (what
waits, what retries, what is dead-lettered) is tested against a fake one as
well as against the real broker through `KafkaProducerPort`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from common.broker_loss import let_go_of_fenced_brokers
from common.producer_renewal import retire, retired, say_renewed, sequence_refused
from common.settings import produce_timeout_ms
from common.topics import partitions_of


class TransactionsFailed(KafkaError):
    """Exactly-once delivery's transactions failed for good (fenced by a newer replica,
    a record refused): nothing more is written, and the worker stops."""

    retriable = False


class ProducerPort(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def send(self, topic: str, value: bytes, key: bytes | None,
                   headers: Sequence[tuple[str, bytes]] | None = None) -> asyncio.Future[Any]:
        """Queue a record; the future resolves when the broker acknowledged it (or
        fails). Raises KafkaError when the producer will not take it."""

    def knows(self, topic: str) -> bool:
        """Whether the producer already has `topic`'s partitions (no waiting)."""

    async def learn(self, topic: str) -> None:
        """Wait for `topic`'s metadata; raises KafkaError (or is cancelled) if none."""

    async def exists(self, topic: str) -> bool:
        """Ask the broker now whether `topic` exists; KafkaError when none answers."""


class KafkaProducerPort:
    """An idempotent aiokafka producer (acks=all): retried sends never duplicate. One the
    broker refuses for its sequence numbers is replaced, and what it refused is sent
    again through the new one (`common.producer_renewal`); senders see only the answer."""

    def __init__(self, options: Mapping[str, Any], request_timeout_s: float):
        self._options = dict(options)
        self._request_timeout_s = request_timeout_s
        self._producer = self._new_producer()
        self._renewing = asyncio.Lock()
        self._stopping = False
        self._resends: set[asyncio.Task[None]] = set()

    def _new_producer(self) -> AIOKafkaProducer:
        producer = AIOKafkaProducer(
            **self._options, enable_idempotence=True, acks="all", linger_ms=1,
            request_timeout_ms=produce_timeout_ms(self._request_timeout_s),
            max_request_size=8 * 1024 * 1024,
        )
        let_go_of_fenced_brokers(producer.client, "the result producer")
        return producer

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        self._stopping = True
        if self._resends:
            await asyncio.gather(*self._resends, return_exceptions=True)
        await self._producer.stop()
        await retired()  # producers replaced on the way

    async def send(self, topic: str, value: bytes, key: bytes | None,
                   headers: Sequence[tuple[str, bytes]] | None = None) -> asyncio.Future[Any]:
        producer = self._producer
        sent = await producer.send(topic, value, key=key, headers=headers)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def settle(fut: asyncio.Future[Any]) -> None:
            if answer.done():
                return
            if fut.cancelled():
                answer.cancel()
                return
            exc = fut.exception()
            if exc is None:
                answer.set_result(fut.result())
            elif sequence_refused(exc) and not self._stopping:
                task = asyncio.get_running_loop().create_task(
                    self._resend(producer, exc, answer, topic, value, key, headers))
                self._resends.add(task)
                task.add_done_callback(self._resends.discard)
            else:
                answer.set_exception(exc)

        sent.add_done_callback(settle)
        return answer

    async def _resend(self, broken: AIOKafkaProducer, refused: BaseException,
                      answer: asyncio.Future[Any], topic: str, value: bytes,
                      key: bytes | None, headers: Sequence[tuple[str, bytes]] | None) -> None:
        """Once: a second refusal (or a failure to start the new producer) is the
        record's answer."""
        try:
            async with self._renewing:  # the first refused send replaces it; others reuse
                if self._producer is broken:
                    say_renewed("the result producer", refused)
                    fresh = self._new_producer()
                    try:
                        await fresh.start()
                    except BaseException:
                        await fresh.stop()
                        raise
                    self._producer = fresh
                    retire(broken, "the result producer")
            sent = await self._producer.send(topic, value, key=key, headers=headers)
            result = await sent
        except BaseException as exc:
            if not answer.done():  # a sender (and delivery's flush) never waits forever
                if isinstance(exc, asyncio.CancelledError):
                    answer.cancel()
                else:
                    answer.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not answer.done():
            answer.set_result(result)

    def knows(self, topic: str) -> bool:
        return bool(self._producer.client.cluster.partitions_for_topic(topic))

    async def learn(self, topic: str) -> None:
        await self._producer.partitions_for(topic)

    async def exists(self, topic: str) -> bool:
        return bool(await partitions_of(self._producer, topic))
