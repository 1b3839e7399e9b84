"""Requests from another Kafka client library (librdkafka, via confluent-kafka):
every codec, transactions, partitioning, and records the worker's client cannot read."""

from __future__ import annotations

import asyncio
import base64
import time
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest

import sluice
from common.settings import Settings
from ingest.partitioning import murmur2_partition
from schemas import DeadLetterRecord, decode
from tests.integration.pipeline_helpers import drop_schema, scrape_metrics, worker_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CODECS = ("gzip", "snappy", "lz4", "zstd")


@pytest.fixture
def request_partitions() -> int:
    return 4


def _setup(settings: Settings, model_dir: Path) -> str:
    with sluice.Client(settings) as client:
        client.models.register(model="tiny", path=str(model_dir),
                               compute_config={"kv_cache_len": 4096})
        key = client.keys.create(tenant="acme")
        client.keys.grant(key, model="tiny")
    return key


def _request(settings: Settings, request_id: str, tokens: list[int]) -> bytes:
    # librdkafka sends a batch uncompressed when compressing would not make it
    # smaller: the padding makes sure every codec really is used.
    return orjson.dumps({"v": 1, "request_id": request_id, "model": "tiny",
                         "prompt_token_ids": tokens, "max_tokens": 4, "stream": False,
                         "reply_topic": settings.topic("results"),
                         "metadata": {"padding": "compress me " * 200}})


def _produce(settings: Settings, records: list[tuple[str, str]], key: str,
             **config: Any) -> list[int]:
    """Produce (request_id, session key) requests with a librdkafka producer; returns
    the partition each landed on."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap, "linger.ms": 0,
                         **config})
    partitions: list[int] = []

    def delivered(err: Any, msg: Any) -> None:
        assert err is None, err
        partitions.append(msg.partition())

    for i, (request_id, session) in enumerate(records):
        producer.produce(settings.requests_topic("tiny"),
                         value=_request(settings, request_id, [5, 6, 7 + i]),
                         key=session.encode(), headers=[("authorization", f"Bearer {key}")],
                         on_delivery=delivered)
        producer.flush(30)  # one batch per record: each keeps its own codec and order
    assert len(partitions) == len(records)
    return partitions


def _read_replies(settings: Settings, wanted: set[str], timeout_s: float = 120
                  ) -> dict[str, dict[str, Any]]:
    """Terminal events by request id, read with a librdkafka consumer (read_committed),
    until every id in `wanted` has one."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap,
                         "group.id": f"{settings.topic_prefix}-reader-{time.monotonic_ns()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "isolation.level": "read_committed"})
    consumer.subscribe([settings.topic("results")])
    found: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not wanted <= found.keys() and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            event = orjson.loads(msg.value())
            if event["type"] in ("done", "error", "timeout"):
                found[event["request_id"]] = event
    finally:
        consumer.close()
    return found


def _transactions(settings: Settings, key: str) -> None:
    """An aborted request, then a committed one, on the same partition."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap,
                         "transactional.id": f"{settings.topic_prefix}-tx",
                         "partitioner": "murmur2_random"})
    producer.init_transactions(30)
    topic = settings.requests_topic("tiny")
    headers = [("authorization", f"Bearer {key}")]
    for request_id, commit in (("tx-aborted", False), ("tx-committed", True)):
        producer.begin_transaction()
        producer.produce(topic, value=_request(settings, request_id, [9, 9]), key=b"s-tx",
                         headers=headers)
        producer.flush(30)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)


async def test_a_librdkafka_producer_is_served(settings, tiny_model, tmp_path) -> None:
    key = _setup(settings, tiny_model)
    sessions = [f"s-{codec}" for codec in CODECS]
    # A key that librdkafka's default partitioner (CRC32) puts elsewhere than murmur2.
    stray = next(f"stray-{i}" for i in range(100) if zlib.crc32(f"stray-{i}".encode()) % 4
                 != murmur2_partition(f"stray-{i}".encode(), 4))
    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            for codec, session in zip(CODECS, sessions, strict=True):
                landed = await asyncio.to_thread(
                    _produce, settings, [(f"codec-{codec}", session)], key,
                    **{"compression.type": codec, "partitioner": "murmur2_random"})
                # murmur2_random places keys as the contract (and aiokafka) does.
                assert landed == [murmur2_partition(session.encode(), 4)]
            landed = await asyncio.to_thread(_produce, settings, [("misrouted-1", stray)], key)
            assert landed != [murmur2_partition(stray.encode(), 4)]
            await asyncio.to_thread(_transactions, settings, key)

            wanted = {f"codec-{c}" for c in CODECS} | {"misrouted-1", "tx-committed"}
            found = await asyncio.to_thread(_read_replies, settings, wanted)
            assert wanted <= found.keys(), (found, worker.log())
            assert all(found[r]["type"] == "done" for r in wanted), found
            # The aborted request was before the committed one on their partition, so
            # it would have been answered first: it never is.
            assert "tx-aborted" not in found
            metrics = await asyncio.to_thread(scrape_metrics, worker)
            assert 'sluice_misrouted_requests_total{model="tiny",pool="default"} 1.0' in metrics
            assert "partitioner=murmur2_random" in worker.log_path.read_text()
    finally:
        await drop_schema(settings)


async def _committed_past(settings: Settings, partition: int, offset: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        async with asyncio.timeout(60):
            while True:
                offsets = await admin.list_consumer_group_offsets(settings.topic("tiny"))
                committed = {tp.partition: o.offset for tp, o in offsets.items()}
                if committed.get(partition, -1) > offset:
                    return
                await asyncio.sleep(0.5)
    finally:
        await admin.close()


def _dead_letters(settings: Settings, timeout_s: float = 60) -> list[DeadLetterRecord]:
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap,
                         "group.id": f"{settings.topic_prefix}-dlq-{time.monotonic_ns()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([settings.topic("deadletter")])
    out: list[DeadLetterRecord] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not out and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                out.append(decode(DeadLetterRecord, msg.value()))
    finally:
        consumer.close()
    return out


async def test_a_record_the_worker_cannot_read_is_dead_lettered_and_the_partition_flows(
    settings, tiny_model, tmp_path
) -> None:
    """A worker whose environment lacks the lz4 library (aiokafka's codecs come from
    cramjam; here it cannot be imported) meets an lz4 batch between two readable
    ones: it dead-letters that offset, naming where it is and why, serves both
    neighbours, commits past it, and stays ready."""
    key = _setup(settings, tiny_model)
    shim = tmp_path / "no-codecs"
    shim.mkdir()
    (shim / "cramjam.py").write_text('raise ImportError("cramjam left out of this worker")\n')
    try:
        with worker_process(settings, "tiny", tmp_path, env={"PYTHONPATH": str(shim)}) as worker:
            worker.wait_for_log("metrics on port")
            first = await asyncio.to_thread(_produce, settings, [("plain-1", "s-1")], key,
                                            partitioner="murmur2_random")
            poison = await asyncio.to_thread(
                _produce, settings, [("poison-1", "s-1")], key,
                **{"compression.type": "lz4", "partitioner": "murmur2_random"})
            last = await asyncio.to_thread(_produce, settings, [("plain-2", "s-1")], key,
                                           partitioner="murmur2_random")
            assert first == poison == last  # one partition, in this order
            found = await asyncio.to_thread(_read_replies, settings, {"plain-1", "plain-2"})
            assert {"plain-1", "plain-2"} <= found.keys(), worker.log()
            assert "poison-1" not in found
            (dead,) = await asyncio.to_thread(_dead_letters, settings)
            assert dead.topic == settings.requests_topic("tiny")
            assert dead.partition == poison[0]
            assert f"offset {dead.offset} of {dead.topic}/{dead.partition}" in dead.reason
            assert "UnsupportedCodecError" in dead.reason, dead.reason
            await _committed_past(settings, dead.partition, dead.offset)
            assert worker.proc.poll() is None
            metrics = await asyncio.to_thread(scrape_metrics, worker)
            assert 'sluice_dead_lettered_records_total{model="tiny",pool="default"} 1.0' \
                in metrics
    finally:
        await drop_schema(settings)
    assert base64.b64decode(dead.value_b64) == b""  # the bytes could not be read
