"""A producer for `results.delivery` without a broker: what it was given, what it
acknowledged, and faults on demand (a topic it cannot learn, a send it refuses,
an acknowledgement that fails, a topic the broker says is gone)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaTimeoutError


@dataclass
class FakeProducer:
    topics: set[str] = field(default_factory=set)  # exist, metadata known
    unknown: set[str] = field(default_factory=set)  # exist, metadata never learned
    refuse_send: dict[str, list[Exception]] = field(default_factory=dict)  # per try
    fail_ack: dict[str, Exception] = field(default_factory=dict)
    acked: list[tuple[str, bytes | None, bytes]] = field(default_factory=list)
    headers: list[Sequence[tuple[str, bytes]] | None] = field(default_factory=list)  # per ack
    started: bool = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    async def send(self, topic: str, value: bytes, key: bytes | None,
                   headers: Sequence[tuple[str, bytes]] | None = None) -> asyncio.Future[Any]:
        refusals = self.refuse_send.get(topic)
        if refusals:
            raise refusals.pop(0)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if topic in self.fail_ack:
            future.set_exception(self.fail_ack[topic])
        else:
            self.acked.append((topic, key, value))
            self.headers.append(headers)
            future.set_result(None)
        return future

    def knows(self, topic: str) -> bool:
        return topic in self.topics

    async def learn(self, topic: str) -> None:
        if topic not in self.topics:
            await asyncio.sleep(3600)  # as a producer waiting for metadata that never comes
            raise KafkaTimeoutError(topic)

    async def exists(self, topic: str) -> bool:
        return topic in self.topics or topic in self.unknown

    def values(self, topic: str) -> list[bytes]:
        return [value for t, _, value in self.acked if t == topic]
