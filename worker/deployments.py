"""A worker's view of `sluice.control`: the newest deployment of its model.

The control topic is compacted and keyed by model, so reading it from the
beginning yields every model's latest deployment. The watcher reads it
without a consumer group (every worker needs every record). `start` reads
up to the end offsets it finds, so `current` is the newest deployment when
the worker loads its model (an older revision not yet compacted away is never
loaded first and then reloaded); `run` then reports each later revision, and
a removal (a tombstone: the key with no value) as None.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError

from common.errors import NotFoundError
from common.kafka_connect import until_available
from common.safe_fetch import SafeFetcher
from common.settings import Settings
from common.topics import partitions_of
from schemas import ModelDeployment, SchemaError, decode

log = logging.getLogger(__name__)

READ_RETRY_S = 1.0
# None: the model was removed from the registry.
OnChange = Callable[[ModelDeployment | None], Awaitable[None]]


class DeploymentWatcher:
    def __init__(self, settings: Settings, model: str):
        self.settings = settings
        self.model = model
        self.current: ModelDeployment | None = None
        self._consumer = AIOKafkaConsumer(**settings.kafka_options(), enable_auto_commit=False,
                                          isolation_level="read_committed")
        self._fetcher = SafeFetcher(self._consumer)
        self._changed = asyncio.Event()
        self._on_change: OnChange | None = None

    async def start(self, on_change: OnChange | None = None,
                    on_wait: Callable[[str], None] = lambda _why: None) -> None:
        """Read the control topic up to its current end (no callbacks for that part),
        waiting out a broker that is away (its partitions' offsets asked of a leader
        not yet replaced)."""
        await self._consumer.start()
        await until_available(self._read_to_end, self.settings,
                              f"reading {self.settings.topic('control')}", on_wait)
        self._on_change = on_change

    async def _read_to_end(self) -> None:
        topic = self.settings.topic("control")
        partitions = await self._control_partitions(topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        for tp in tps:
            self._fetcher.assigned(tp, None)
        end = await self._consumer.end_offsets(tps)
        while not await self._caught_up(end):
            await self._read_once()

    async def _caught_up(self, end: dict[TopicPartition, int]) -> bool:
        for tp, offset in end.items():
            if await self._consumer.position(tp) < offset:
                return False
        return True

    async def stop(self) -> None:
        await self._consumer.stop()

    async def _control_partitions(self, topic: str, poll_s: float = 1.0) -> set[int]:
        """The control topic's partitions, once it exists: the first control-plane
        operation creates it, and a worker may start before that."""
        partitions = await partitions_of(self._consumer, topic)
        if not partitions:
            log.warning("waiting for the control topic %s: the first control-plane operation "
                        "(`sluice models register`) creates it", topic)
        while not partitions:
            await asyncio.sleep(poll_s)
            partitions = await partitions_of(self._consumer, topic)
        return partitions

    async def run(self) -> None:
        """Follow the control topic for as long as the worker runs; a routine Kafka error
        (a broker away, a leader moving) is waited out, a denied topic is not."""
        while True:
            try:
                await self._read_once()
            except TopicAuthorizationFailedError:
                raise
            except KafkaError as exc:
                log.warning("reading %s failed (%s: %s); reading on in %g s",
                            self.settings.topic("control"), type(exc).__name__, exc,
                            READ_RETRY_S)
                await asyncio.sleep(READ_RETRY_S)

    async def wait_for_deployment(self, timeout_s: float) -> ModelDeployment:
        if self.current is None:
            log.info("waiting up to %g s for model %s to be registered", timeout_s, self.model)
        try:
            async with asyncio.timeout(timeout_s):
                while self.current is None:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise NotFoundError(
                f"model {self.model!r} was not registered within {timeout_s:g} s; register it "
                f"with `sluice models register --model {self.model} --path DIR`") from None
        return self.current

    async def _read_once(self) -> None:
        records, unreadable = await self._fetcher.getmany(timeout_ms=500, max_records=1024)
        for bad in unreadable:
            log.error("a control record was skipped: %s", bad.reason)
        for record in records:
            await self._apply(record.key, record.value)

    async def _apply(self, key: bytes | None, value: bytes | None) -> None:
        if key != self.model.encode():
            return
        if value is None:
            if self.current is not None:
                log.warning("model %s was removed from the registry", self.model)
                self.current = None  # a later registration starts again at revision 1
                if self._on_change is not None:
                    await self._on_change(None)
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
