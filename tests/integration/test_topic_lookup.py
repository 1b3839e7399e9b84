"""Looking a topic up goes on past a broker that is away.

`partitions_of` asked one broker, chosen at random, and failed when that one was
down: a client's send during a broker's SIGKILL failed with NodeNotReadyError before
the record was written (`sluice bench chaos --networked`, 2 of 3,000). Real broker;
the broker that is away is a node id the client is told of at a loopback port nothing
listens on.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError
from aiokafka.structs import BrokerMetadata

from common.topics import partitions_of

pytestmark = pytest.mark.integration


async def test_a_broker_that_is_away_is_skipped(settings, caplog) -> None:
    topic = settings.topic("lookup")
    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 3, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(**settings.kafka_options())
    await producer.start()
    try:
        for _ in range(100):  # the new topic reaches every broker's metadata
            if await partitions_of(producer, topic) == {0, 1, 2}:
                break
            await asyncio.sleep(0.1)
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
    finally:
        await producer.stop()
