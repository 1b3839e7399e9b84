"""A producer the broker refuses for its sequence numbers is replaced, its record resent.

In a chaos run (`sluice bench chaos --networked`, a leader isolated from the other
brokers) the SDK's producer met OutOfOrderSequenceNumber and aiokafka then refused every
later send of those partitions, to the end of the run (288 and 841 of 3,000 sends). The
gap is made here by moving the producer's own sequence number for a partition ahead of
the broker's (how it got there in the run: see `common.producer_renewal`); the refusal
is the real broker's. Each test first shows the broken producer refused, then that the
SDK's send and the worker's result port still deliver, each record exactly once.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaTimeoutError, OutOfOrderSequenceNumber

import sluice
from results.producer import KafkaProducerPort

pytestmark = pytest.mark.integration


async def _topic(settings, name: str) -> str:
    topic = settings.topic(name)
    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    return topic


def _break(producer: AIOKafkaProducer, topic: str) -> None:
    """Put the producer's next sequence number of partition 0 past the broker's."""
    txn = producer._txn_manager
    assert txn is not None  # idempotent
    txn.increment_sequence_number(TopicPartition(topic, 0), 5)


async def _values(settings, topic: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(**settings.kafka_options(), enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        values: list[bytes] = []
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(tp, timeout_ms=1000)).values():
                values += [r.value for r in records]
        return values
    finally:
        await consumer.stop()


async def test_the_sdk_replaces_a_refused_producer_and_sends_again(settings, caplog) -> None:
    topic = await _topic(settings, "renew-sdk")
    client = sluice.Client(settings)
    try:
        await client._send(topic, b"first", b"k", [])
        broken = client._producer
        assert broken is not None
        _break(broken, topic)
        with pytest.raises(OutOfOrderSequenceNumber):  # the broker refuses it, for good
            await broken.send_and_wait(topic, b"refused", key=b"k")
        await client._send(topic, b"second", b"k", [])
        assert client._producer is not broken
        await client._send(topic, b"third", b"k", [])
        assert "a new producer takes over" in caplog.text
    finally:
        await client.aclose()
    assert await _values(settings, topic) == [b"first", b"second", b"third"]


async def test_the_result_port_replaces_a_refused_producer_and_sends_again(settings) -> None:
    topic = await _topic(settings, "renew-port")
    port = KafkaProducerPort(settings.producer_options(), request_timeout_s=10.0)
    await port.start()
    try:
        await (await port.send(topic, b"first", b"k"))
        broken = port._producer
        _break(broken, topic)
        # Several at once, as the event pump sends them: one renewal, every one delivered.
        answers = [await port.send(topic, f"r{i}".encode(), b"k") for i in range(5)]
        done = await asyncio.wait_for(asyncio.gather(*answers), 30)
        assert all(meta.topic == topic for meta in done)
        assert port._producer is not broken
        await (await port.send(topic, b"last", b"k"))
    finally:
        await port.stop()
    values = await _values(settings, topic)
    assert values[0] == b"first" and values[-1] == b"last"
    assert sorted(values[1:-1]) == [f"r{i}".encode() for i in range(5)]  # once each


async def test_the_sdk_offers_again_a_record_its_producer_could_not_take_yet(settings) -> None:
    """A record that waits behind a batch that cannot go (its partition's leader away)
    fails aiokafka's send with KafkaTimeoutError after the request timeout, never added:
    a chaos run lost a send that way during a broker's SIGKILL. The SDK offers it
    again until the call's own deadline. The batch is held here by muting its
    partition in the producer's sender, then let go."""
    topic = await _topic(settings, "reoffer")
    # The producer's request timeout: one try is 1 s.
    quick = settings.model_copy(
        update={"client": settings.client.model_copy(update={"timeout_secs": 1.0})})
    client = sluice.Client(quick)
    try:
        await client._send(topic, b"first", b"k", [])
        producer = client._producer
        assert producer is not None
        tp = TopicPartition(topic, 0)
        producer._sender._muted_partitions.add(tp)
        big = b"x" * 12_000  # two do not fit one 16 kB batch
        held = await producer.send(topic, big, key=b"k")
        with pytest.raises(KafkaTimeoutError):  # what a plain send meets
            await producer.send(topic, big, key=b"k")

        async def let_go() -> None:
            await asyncio.sleep(2.5)
            producer._sender._muted_partitions.discard(tp)
            waiter = producer._message_accumulator._waiter_future  # wake the sender
            if not waiter.done():
                waiter.set_result(None)

        releasing = asyncio.create_task(let_go())
        try:
            meta = await client._send(topic, b"second", b"k", [],
                                      until=time.monotonic() + 30)
        finally:
            await releasing  # the held batch goes, so the producer can stop
        assert meta.topic == topic
        await held
    finally:
        await client.aclose()
    assert await _values(settings, topic) == [b"first", big, b"second"]
