"""The SDK's reply reader against a real broker: a fetch answered "offset out of range"
(a leader cut off from the other brokers, or just replaced, answers so for offsets the
partition's real leader holds) never moves the reader to the partition's end, which
skipped every reply written in between (`sluice bench chaos`: 20 answers on the topic
never reached their clients)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from common.topics import TopicAdmin, TopicSpec
from schemas import encode
from sluice.replies import ReplyReader
from tests.unit.test_outcome import ID, done

pytestmark = [pytest.mark.integration]


async def test_a_position_answered_out_of_range_is_read_on_not_skipped(settings) -> None:
    topic = f"{settings.topic_prefix}.replies-oor"
    async with TopicAdmin(settings) as admin:
        await admin.ensure([TopicSpec(topic, 1, {})])
    tp = TopicPartition(topic, 0)
    reader = ReplyReader(settings, topic)
    producer = AIOKafkaProducer(**settings.producer_options())
    await producer.start()
    await reader.start()
    try:
        sub = reader.subscribe(ID)
        # Hold the reader, write the answer, and leave the reader's position past the
        # log's end, as a cut-off leader's "out of range" finds it; then let it read.
        assert reader._task is not None
        reader._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader._task
        answer = await (await producer.send(topic, encode(done(0)), key=ID.encode()))
        assert answer.offset == 0
        reader._consumer.seek(tp, 7)
        reader._task = asyncio.create_task(reader._pump())
        async with asyncio.timeout(20):
            event = await sub.queue.get()
        assert event == done(0)  # read from where the reader was, not from the end
        assert await reader._consumer.position(tp) == 1
    finally:
        await producer.stop()
        await reader.stop()
        async with TopicAdmin(settings) as admin:
            await admin.delete([topic])
