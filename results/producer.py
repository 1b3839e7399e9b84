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
    """An idempotent aiokafka producer (acks=all): retried sends never duplicate."""

    def __init__(self, options: Mapping[str, Any], request_timeout_s: float):
        self._producer = AIOKafkaProducer(
            **options, enable_idempotence=True, acks="all", linger_ms=1,
            request_timeout_ms=produce_timeout_ms(request_timeout_s),
            max_request_size=8 * 1024 * 1024,
        )
        let_go_of_fenced_brokers(self._producer.client, "the result producer")

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def send(self, topic: str, value: bytes, key: bytes | None,
                   headers: Sequence[tuple[str, bytes]] | None = None) -> asyncio.Future[Any]:
        return await self._producer.send(topic, value, key=key, headers=headers)

    def knows(self, topic: str) -> bool:
        return bool(self._producer.client.cluster.partitions_for_topic(topic))

    async def learn(self, topic: str) -> None:
        await self._producer.partitions_for(topic)

    async def exists(self, topic: str) -> bool:
        return bool(await partitions_of(self._producer, topic))
