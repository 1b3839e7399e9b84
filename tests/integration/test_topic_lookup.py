"""Looking a topic up goes on past a broker that is away.

`partitions_of` asked one broker, chosen at random, and failed when that one was
down: a client's send during a broker's SIGKILL failed with NodeNotReadyError before
the record was written (`sluice bench chaos --networked`, 2 of 3,000). Real broker;
the broker that is away is a node id the client is told of at a loopback port nothing
listens on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError
from aiokafka.structs import BrokerMetadata

from common.kafka_connect import until_available
from common.topics import partitions_of

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def _producer_knowing(settings, topic: str, partitions: int
                            ) -> AsyncIterator[AIOKafkaProducer]:
    """A started producer, once a new `topic` of `partitions` is in every broker's
    metadata."""
    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(**settings.kafka_options())
    await producer.start()
    try:
        for _ in range(100):
            if await partitions_of(producer, topic) == set(range(partitions)):
                break
            await asyncio.sleep(0.1)
        yield producer
    finally:
        await producer.stop()


async def test_a_broker_that_is_away_is_skipped(settings, caplog) -> None:
    topic = settings.topic("lookup")
    async with _producer_knowing(settings, topic, 3) as producer:
        cluster = producer.client.cluster
        away = BrokerMetadata(4242, "127.0.0.1", 1, None)  # a port nothing listens on
        for _ in range(12):  # random order: the one away comes first about half the time
            cluster._brokers[4242] = away  # (a metadata refresh would drop it)
            assert await partitions_of(producer, topic) == {0, 1, 2}
        assert "node with id 4242" in caplog.text  # it was asked, and passed over
        # Only the broker that is away: its error, not an empty answer.
        cluster._brokers = {4242: away}
        with pytest.raises(KafkaError):
            await partitions_of(producer, topic)


async def test_a_lookup_while_no_broker_answers_waits_for_one(settings, caplog) -> None:
    """The SDK's lookup (`partitions_of` under `until_available`) asks again while every
    broker it knows fails for a reason that passes, and gives the last error once its
    time is up."""
    topic = settings.topic("lookup-wait")
    what = "looking up"
    async with _producer_knowing(settings, topic, 2) as producer:
        cluster = producer.client.cluster
        real = dict(cluster._brokers)
        away = BrokerMetadata(4243, "127.0.0.1", 1, None)  # a port nothing listens on

        async def back_after(seconds: float) -> None:
            await asyncio.sleep(seconds)
            cluster._brokers = dict(real)

        cluster._brokers = {4243: away}
        with pytest.raises(KafkaError):  # the plain lookup gives up at once
            await partitions_of(producer, topic)
        cluster._brokers = {4243: away}
        returning = asyncio.create_task(back_after(0.6))
        assert await until_available(lambda: partitions_of(producer, topic), settings,
                                     what) == {0, 1}
        await returning
        assert "trying again" in caplog.text

        cluster._brokers = {4243: away}  # away for good: its error, within the bound
        brief = settings.model_copy(update={
            "client": settings.client.model_copy(update={"timeout_secs": 1.0})})
        started = asyncio.get_running_loop().time()
        with pytest.raises(KafkaError):
            await until_available(lambda: partitions_of(producer, topic), brief, what)
        assert asyncio.get_running_loop().time() - started < 3.0
        cluster._brokers = dict(real)
