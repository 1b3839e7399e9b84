"""The worker's gauges, once a second: queue, KV cache and consumer lag; retired
adapters dropped; and now and then whether Kafka still lets this worker see its
request topic (an ACL revoked while it runs would otherwise leave it reading
nothing, silently)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

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
        for tp in ingest.consumer.assignment():
            high, point = ingest.consumer.highwater(tp), tracker.commit_point(tp)
            if high is not None:  # lag = records not yet finished
                metrics.set_lag(tp.partition, high - (point[0] if point else high))


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
