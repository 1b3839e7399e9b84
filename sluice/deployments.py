"""A worker's view of `sluice.control`: the newest deployment of its model.

The control topic is compacted and keyed by model, so reading it from the
beginning yields every model's latest deployment. The watcher reads it
without a consumer group (every worker needs every record) and reports each
new revision of the model it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas import ModelDeployment, SchemaError, decode
from sluice.settings import Settings
from sluice.topics import partitions_of

log = logging.getLogger(__name__)

OnChange = Callable[[ModelDeployment], Awaitable[None]]


class DeploymentWatcher:
    def __init__(self, settings: Settings, model: str):
        self.settings = settings
        self.model = model
        self.current: ModelDeployment | None = None
        self._consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap,
                                          enable_auto_commit=False)
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._on_change: OnChange | None = None

    async def start(self, on_change: OnChange | None = None) -> None:
        self._on_change = on_change
        await self._consumer.start()
        topic = self.settings.topic("control")
        partitions = await partitions_of(self._consumer, topic) or {0}
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()

    async def wait_for_deployment(self, timeout_s: float) -> ModelDeployment:
        async with asyncio.timeout(timeout_s):
            while self.current is None:
                self._changed.clear()
                await self._changed.wait()
        return self.current

    async def _run(self) -> None:
        while True:
            batch = await self._consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    await self._apply(record.key, record.value)

    async def _apply(self, key: bytes | None, value: bytes | None) -> None:
        if key != self.model.encode() or value is None:
            return
        try:
            deployment = decode(ModelDeployment, value)
        except SchemaError as exc:
            log.error("ignoring an unreadable control record for %s: %s", self.model, exc)
            return
        if self.current is not None and deployment.revision <= self.current.revision:
            return
        self.current = deployment
        self._changed.set()
        if self._on_change is not None:
            await self._on_change(deployment)
