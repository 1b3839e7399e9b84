"""What a client knows of each model's placement (its max_ttft_ms) and of who started what.

A request waits for its first token at most its model's `max_ttft_ms`, queue
time included: a worker that reads it later answers with a `timeout` event. But
while no worker serves the model (none started, all still loading) nobody
answers, and a client would wait its whole own timeout. So the SDK and the
gateway bound the wait for a request's first event by the model's
`max_ttft_ms` plus `GRACE_S` (the worker's own timeout event, when one comes,
arrives well within that), and past it ask whether a worker has started the
request at all: a worker records, in its consumer group's committed metadata
(`h=`, see `ingest.offsets`), the highest offset it started, within
milliseconds of reading it. Started means the answer is being made (a request
that is not streamed sends no event until it is done): wait on. Not started
means no worker took it in time: a `RequestTimeoutError` that says so.

`Placements` follows the compacted control topic (one record per model, the
registry's own) with a consumer of its own. A principal that may not read the
control topic, or describe the model's consumer group, waits its own timeout
instead (said once in the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from common.safe_fetch import SafeFetcher
from common.settings import Settings
from common.timeouts import within
from common.topics import committed_of, partitions_of
from ingest.offsets import highest_started
from schemas import ModelDeployment, SchemaError, decode

log = logging.getLogger(__name__)

GRACE_S = 2.0  # past max_ttft_ms before a client asks whether its request was started
READ_TIMEOUT_S = 10.0


class Placements:
    def __init__(self, settings: Settings):
        self._settings = settings
        self._max_ttft_ms: dict[str, int] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._said_cannot_ask = False
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Lock()
        self._caught_up = False
        self.unavailable: str | None = None  # why placements cannot be read (then None)

    async def max_ttft_ms(self, model: str) -> int | None:
        """The model's max_ttft_ms, or None when it cannot be known."""
        async with self._started:
            if not self._caught_up and self.unavailable is None:
                await self._start()
        return self._max_ttft_ms.get(model)

    async def started(self, client: object, model: str, partition: int,
                      offset: int) -> bool | None:
        """Whether a worker of `model` has started the record at (partition, offset) of
        its request topic, asked through `client` (a connected aiokafka producer); None
        when that cannot be asked (ACLs, no broker)."""
        try:
            committed = await within(READ_TIMEOUT_S, committed_of(
                client, self._settings.topic(model), self._settings.requests_topic(model),
                partition))
        except (KafkaError, OSError, TimeoutError) as exc:
            if not self._said_cannot_ask:
                self._said_cannot_ask = True
                log.warning("cannot ask whether a worker started a request of %s (%s: %s); "
                            "such requests wait for their answer until the client's own "
                            "timeout", model, type(exc).__name__, exc)
            return None
        if committed is None:
            return False
        committed_offset, metadata = committed
        upto = highest_started(metadata)
        return committed_offset > offset or (upto is not None and upto >= offset)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
        self._consumer = None

    async def _start(self) -> None:
        consumer = AIOKafkaConsumer(**self._settings.kafka_options(), enable_auto_commit=False,
                                    isolation_level="read_committed")
        topic = self._settings.topic("control")
        try:
            await within(READ_TIMEOUT_S, consumer.start())
            self._consumer = consumer
            partitions = await within(READ_TIMEOUT_S, partitions_of(consumer, topic))
            tps = [TopicPartition(topic, p) for p in sorted(partitions)]
            fetcher = SafeFetcher(consumer)
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            for tp in tps:
                fetcher.assigned(tp, None)
            end = await within(READ_TIMEOUT_S, consumer.end_offsets(tps))
            async with asyncio.timeout(READ_TIMEOUT_S):
                while any([await consumer.position(tp) < end[tp] for tp in tps]):
                    await self._read(fetcher)
        except (KafkaError, OSError, TimeoutError) as exc:
            self.unavailable = f"{type(exc).__name__}: {exc}"
            log.warning("cannot read the control topic %s (%s): requests wait for their "
                        "first event until the client's own timeout, not the model's "
                        "max_ttft_ms", topic, self.unavailable)
            with contextlib.suppress(Exception):
                await consumer.stop()
            self._consumer = None
            return
        self._caught_up = True
        self._task = asyncio.create_task(self._follow(fetcher), name="sluice-placements")

    async def _follow(self, fetcher: SafeFetcher) -> None:
        try:
            while True:
                await self._read(fetcher)
        except (KafkaError, OSError) as exc:  # keep the last known placements
            log.warning("stopped following the control topic: %s", exc)

    async def _read(self, fetcher: SafeFetcher) -> None:
        records, _unreadable = await fetcher.getmany(timeout_ms=500, max_records=1024)
        for record in records:
            model = record.key.decode(errors="replace") if record.key else None
            if model is None:
                continue
            if record.value is None:
                self._max_ttft_ms.pop(model, None)
                continue
            with contextlib.suppress(SchemaError):
                self._max_ttft_ms[model] = decode(ModelDeployment,
                                                  record.value).placement.max_ttft_ms
