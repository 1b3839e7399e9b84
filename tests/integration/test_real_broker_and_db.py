"""The foundation talks to the real broker (aiokafka) and the real database (asyncpg)."""

from __future__ import annotations

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas import InferenceRequest, decode, encode

pytestmark = pytest.mark.integration


async def _create_topics(bootstrap: str, *names: str, partitions: int = 2) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, partitions, 1) for n in names])
    finally:
        await admin.close()


async def test_produce_and_consume_requests(endpoints, unique_name) -> None:
    topic = f"{unique_name}.requests"
    await _create_topics(endpoints.kafka_bootstrap, topic)
    producer = AIOKafkaProducer(bootstrap_servers=endpoints.kafka_bootstrap,
                                enable_idempotence=True, acks="all")
    await producer.start()
    sent = [
        InferenceRequest(request_id=f"r-{i}", session_id=f"s-{i % 3}", model="tiny",
                         prompt=f"hello {i}")
        for i in range(20)
    ]
    try:
        for req in sent:
            await producer.send_and_wait(topic, encode(req), key=req.partition_key.encode(),
                                         headers=[("authorization", b"Bearer k")])
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=endpoints.kafka_bootstrap,
                                group_id=unique_name, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    got: dict[str, tuple[int, InferenceRequest]] = {}
    try:
        while len(got) < len(sent):
            batch = await consumer.getmany(timeout_ms=5000)
            assert batch, "no records within 5 s"
            for tp, records in batch.items():
                for record in records:
                    assert dict(record.headers)["authorization"] == b"Bearer k"
                    req = decode(InferenceRequest, record.value)
                    got[req.request_id] = (tp.partition, req)
        await consumer.commit()
    finally:
        await consumer.stop()
    assert {r.request_id for r in sent} == set(got)
    # One session, one partition: the KV-affinity rule rests on this.
    by_session: dict[str, set[int]] = {}
    for partition, req in got.values():
        by_session.setdefault(req.session_id or "", set()).add(partition)
    assert all(len(parts) == 1 for parts in by_session.values())


async def test_transactional_consume_process_produce(endpoints, unique_name) -> None:
    """The gate for exactly-once later: aiokafka transactions work on this broker."""
    src, dst = f"{unique_name}.in", f"{unique_name}.out"
    await _create_topics(endpoints.kafka_bootstrap, src, dst)
    producer = AIOKafkaProducer(bootstrap_servers=endpoints.kafka_bootstrap)
    await producer.start()
    for i in range(10):
        await producer.send_and_wait(src, f"m{i}".encode(), key=f"k{i}".encode())
    await producer.stop()

    consumer = AIOKafkaConsumer(src, bootstrap_servers=endpoints.kafka_bootstrap,
                                group_id=unique_name, enable_auto_commit=False,
                                auto_offset_reset="earliest", isolation_level="read_committed")
    txn = AIOKafkaProducer(bootstrap_servers=endpoints.kafka_bootstrap,
                           transactional_id=f"{unique_name}-txn")
    await consumer.start()
    await txn.start()
    try:
        done = 0
        while done < 10:
            batch = await consumer.getmany(timeout_ms=5000)
            assert batch
            async with txn.transaction():
                offsets = {}
                for tp, records in batch.items():
                    for record in records:
                        await txn.send(dst, record.value + b"!")
                        done += 1
                    offsets[tp] = records[-1].offset + 1
                await txn.send_offsets_to_transaction(offsets, unique_name)
        # An aborted transaction's records must stay invisible.
        await txn.begin_transaction()
        await txn.send(dst, b"aborted")
        await txn.abort_transaction()
    finally:
        await txn.stop()
        await consumer.stop()

    reader = AIOKafkaConsumer(dst, bootstrap_servers=endpoints.kafka_bootstrap,
                              auto_offset_reset="earliest", isolation_level="read_committed")
    await reader.start()
    values: list[bytes] = []
    try:
        while True:
            batch = await reader.getmany(timeout_ms=2000)
            if not batch:
                break
            values += [r.value for records in batch.values() for r in records]
    finally:
        await reader.stop()
    assert sorted(values) == sorted(f"m{i}!".encode() for i in range(10))
    check = AIOKafkaConsumer(bootstrap_servers=endpoints.kafka_bootstrap, group_id=unique_name)
    await check.start()
    try:
        committed = [await check.committed(TopicPartition(src, p)) for p in (0, 1)]
    finally:
        await check.stop()
    assert sum(c or 0 for c in committed) == 10


async def test_database_read_write(endpoints, pg_schema) -> None:
    conn = await asyncpg.connect(endpoints.database_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute("CREATE TABLE notes (id serial PRIMARY KEY, body text NOT NULL)")
        await conn.executemany("INSERT INTO notes (body) VALUES ($1)", [("a",), ("b",)])
        rows = await conn.fetch("SELECT body FROM notes ORDER BY id")
        version = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    assert [r["body"] for r in rows] == ["a", "b"]
    assert version


async def test_sluice_creates_topics_at_the_replication_factor_the_cluster_allows(
    endpoints, unique_name
) -> None:
    from common.settings import Settings
    from common.topics import TopicAdmin, request_topic, shared_topics
    from sluice.errors import InvalidConfigError

    settings = Settings(kafka_bootstrap=endpoints.kafka_bootstrap,
                        database_url=endpoints.database_url, topic_prefix=unique_name)
    async with TopicAdmin(settings) as admin:
        assert await admin.replication_factor() == 1  # min(3, one broker)
        specs = [*shared_topics(settings), request_topic(settings, "m", 3)]
        assert sorted(await admin.ensure(specs)) == sorted(s.name for s in specs)
        assert await admin.ensure(specs) == []  # all there: nothing to do
    described = await _describe(endpoints.kafka_bootstrap, settings.requests_topic("m"))
    assert len(described["partitions"]) == 3
    assert all(len(p["replicas"]) == 1 for p in described["partitions"])

    # A factor the cluster cannot meet is refused, saying so and what to set.
    three = Settings(kafka_bootstrap=endpoints.kafka_bootstrap,
                     database_url=endpoints.database_url, topic_prefix=unique_name,
                     topic_replication_factor=3)
    async with TopicAdmin(three) as admin:
        with pytest.raises(InvalidConfigError, match=r"replication factor 3\).*"
                           r"SLUICE_TOPIC_REPLICATION_FACTOR"):
            await admin.ensure([request_topic(three, "other")])
        assert three.requests_topic("other") not in await admin.list_topics()


async def _describe(bootstrap: str, topic: str) -> dict:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
        return described
    finally:
        await admin.close()
