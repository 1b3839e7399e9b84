"""Where a worker's consumer reads from when its position is out of the log's range.

The consumer once reset such a partition to its earliest offset: a fetch that came back
out of range (a leader killed mid-run) sent it to offset 0, and every finished request
of the partition was served again (`sluice bench chaos --networked`, exactly-once: 359
requests committed two or three times). Now a partition goes on where it was; it starts
at the log's start only when the records it is owed were deleted (retention).

Real broker; the request records are empty values, which ingest dead-letters without
asking the database or the tokenizer, so the routed verdicts name every offset served.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete
from aiokafka.structs import OffsetAndMetadata

from common.settings import Settings
from ingest.consumer import RequestIngest
from ingest.offsets import OffsetTracker
from ingest.verdicts import DeadLettered
from worker.options import ingest_options

pytestmark = pytest.mark.integration

MODEL = "tiny"


async def _produce(settings: Settings, topic: str, count: int) -> None:
    producer = AIOKafkaProducer(**settings.kafka_options(), acks="all")
    await producer.start()
    try:
        for _ in range(count):
            await producer.send_and_wait(topic, b"", partition=0)
    finally:
        await producer.stop()


async def _served_until(ingest: RequestIngest, served: list[int], last: int,
                        timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while last not in served:
        assert time.monotonic() < deadline, f"offset {last} not served; served {served}"
        await ingest.poll(max_records=64)


def test_out_of_range_goes_on_where_it_was_and_deleted_records_are_skipped(settings, caplog):
    topic = settings.requests_topic(MODEL)
    tp = TopicPartition(topic, 0)
    caplog.set_level(logging.ERROR, logger="ingest.offsets")

    async def run() -> tuple[list[int], int]:
        admin = AIOKafkaAdminClient(**settings.kafka_options())
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 1, 1)])
            await _produce(settings, topic, 10)
            # The group's commit point is 3, but records below 8 are gone (retention).
            # No auto-commit: when the commit below was retried (the group still
            # loading), the committer's own position (the log's end) was committed on
            # stop, over the 3, and the test found nothing owed.
            committer = AIOKafkaConsumer(**settings.kafka_options(),
                                         group_id=settings.topic(MODEL),
                                         enable_auto_commit=False)
            await committer.start()
            committer.assign([tp])
            await committer.commit({tp: OffsetAndMetadata(3, "")})
            await committer.stop()
            await admin.delete_records({tp: RecordsToDelete(8)}, timeout_ms=10_000)
        finally:
            await admin.close()

        tracker = OffsetTracker()
        served: list[int] = []

        async def route(verdict) -> None:
            assert isinstance(verdict, DeadLettered)
            served.append(verdict.offset)
            tracker.finish(verdict.tp, verdict.offset)

        async def on_revoked(_tps) -> None:
            return None

        ingest = RequestIngest(ingest_options(settings, MODEL, "positions-1"), tracker=tracker,
                               checker=None, prompts=None,  # type: ignore[arg-type]
                               route=route, on_revoked=on_revoked)
        await ingest.start()
        ingest.subscribe()
        try:
            await _served_until(ingest, served, 9)
            # A position past the log's end, as a fetch from a leader behind sees it.
            ingest.consumer.seek(tp, 1_000)
            await _produce(settings, topic, 2)
            await _served_until(ingest, served, 11)
            for _ in range(20):  # nothing more comes: no replay from the log's start
                await ingest.poll(max_records=64)
            return served, ingest.num_records
        finally:
            await ingest.stop()

    served, num_records = asyncio.run(run())
    assert served == [8, 9, 10, 11]
    assert num_records == 4
    # Not even read again (the tracker would skip such records, and say so).
    assert "was read again" not in caplog.text

