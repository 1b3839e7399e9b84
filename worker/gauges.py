"""The worker's gauges, once a second: queue, KV cache, adapters and consumer lag;
retired adapters dropped; and now and then whether Kafka still lets this worker see its
request topic (an ACL revoked while it runs would otherwise leave it reading
nothing, silently)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError

from common.timeouts import within
from ingest.consumer import RequestIngest
from ingest.offsets import OffsetTracker
from worker.loaded_model import LoadedModel
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# How often a worker checks that Kafka still lets it see its request topic.
ACCESS_CHECK_EVERY_S = 30.0


async def publish_gauges(loaded: LoadedModel, ingest_of: Callable[[], RequestIngest | None],
                         metrics: WorkerMetrics, tracker: OffsetTracker, topic: str) -> None:
    checked = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        engine, runtime, ingest = loaded.engine, loaded.runtime, ingest_of()
        if engine is None or runtime is None or ingest is None:
            continue
        if time.monotonic() - checked > ACCESS_CHECK_EVERY_S:
            checked = time.monotonic()
            await _check_access(ingest, topic)
        if loaded.adapters.has_retired:
            await loaded.adapters.drop_retired(runtime, engine)
        metrics.set_queue(engine.scheduler.num_waiting, engine.scheduler.num_running)
        bm = runtime.block_manager
        metrics.set_kv(bm.num_blocks - bm.num_free_blocks, bm.num_free_blocks)
        slots = runtime.adapters
        metrics.set_adapters(len(loaded.adapters.names), len(slots.resident_adapters()),
                             slots.num_slots)
        consumer = ingest.consumer
        paused = consumer.paused()
        ends = await _end_offsets(consumer, [tp for tp in consumer.assignment()
                                             if tp in paused])
        # The assignment after the wait: a partition revoked meanwhile is not reported.
        for tp, lag in partition_lags(consumer.assignment(), consumer.highwater, ends,
                                      tracker.commit_point).items():
            metrics.set_lag(tp.partition, lag)


def partition_lags(assigned: Iterable[TopicPartition],
                   highwater: Callable[[TopicPartition], int | None],
                   ends: Mapping[TopicPartition, int],
                   commit_point: Callable[[TopicPartition], tuple[int, str] | None],
                   ) -> dict[TopicPartition, int]:
    """Records not yet finished, per partition whose end is known: the broker's end
    offset where it was asked (`ends`), else the consumer's last fetched highwater."""
    lags = {}
    for tp in assigned:
        high = ends.get(tp, highwater(tp))
        if high is not None:
            point = commit_point(tp)
            lags[tp] = max(0, high - (point[0] if point else high))
    return lags


async def _end_offsets(consumer: AIOKafkaConsumer, tps: list[TopicPartition]
                       ) -> dict[TopicPartition, int]:
    """The broker's end offsets of paused partitions: a paused partition is not fetched,
    so its highwater stands still while records keep arriving (under backpressure, just
    when lag grows). A broker that does not answer now leaves the highwater in use."""
    if not tps:
        return {}
    try:
        return await within(5, consumer.end_offsets(tps))
    except (KafkaError, OSError, TimeoutError):
        return {}


async def _check_access(ingest: RequestIngest, topic: str) -> None:
    """A denied request topic stops the worker (TopicAuthorizationFailedError); a
    broker that does not answer now (away, electing leaders) is only logged: it is
    asked again at the next check."""
    try:
        await within(10, ingest.check_access())
    except TopicAuthorizationFailedError:
        raise
    except (KafkaError, OSError, TimeoutError) as exc:
        log.warning("could not check access to %s now (%s: %s); checking again in "
                    "%g s", topic, type(exc).__name__, exc, ACCESS_CHECK_EVERY_S)
