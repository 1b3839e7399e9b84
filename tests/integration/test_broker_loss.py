"""Losing a broker under load: a three-node KRaft cluster (`sluice infra up --brokers 3`),
the leader of the request topic's partition 0 SIGKILLed mid-load. Every request still
gets its one terminal event, none twice, and the system carries on with two brokers.

The cluster is the test's own (private state dir, free ports), started through the
same code as `sluice infra up --brokers 3` and purged at the end; PostgreSQL is the
session's.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

import sluice
from common.settings import Settings
from common.topics import partitions_of
from infra import kafka_broker
from infra.common import InfraConfig, port_in_use
from ingest.partitioning import murmur2_partition
from tests.conftest import free_port
from tests.integration.pipeline_helpers import drop_schema
from worker.options import WorkerOptions
from worker.worker import Worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny"
PARTITIONS = 6
REQUESTS = 40
AFTER = 5  # requests sent once the broker is gone
TERMINAL = {"done", "error", "timeout"}
T = TypeVar("T")


def _cluster_config(tmp_path: Path) -> InfraConfig:
    """Three nodes on free ports (node k listens 100*k above node 1's ports)."""
    for _ in range(50):
        cfg = InfraConfig.from_env(state_dir=tmp_path / "infra", kafka_port=free_port(),
                                   kafka_controller_port=free_port(), postgres_port=free_port(),
                                   secure=False, brokers=3)
        ports = [port for pair in cfg.kafka_node_ports() for port in pair]
        if len(set(ports)) == len(ports) and not any(port_in_use(p) for p in ports):
            return cfg
    raise RuntimeError("no six free ports for a three-node cluster")


def _sessions() -> list[str]:
    """Session ids that between them land on every partition (murmur2, as producers
    partition), two per partition."""
    found: dict[int, list[str]] = collections.defaultdict(list)
    i = 0
    while any(len(found[p]) < 2 for p in range(PARTITIONS)):
        session = f"session-{i}"
        partition = murmur2_partition(session.encode(), PARTITIONS)
        if len(found[partition]) < 2:
            found[partition].append(session)
        i += 1
    return [s for p in range(PARTITIONS) for s in found[p]]


async def _describe(settings: Settings, topic: str) -> tuple[list[dict], dict[str, str]]:
    """`topic`'s partitions (leader, replicas) and configuration, asked of the cluster
    now by an admin client of its own (one made before a broker died keeps sending to
    it)."""
    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        partitions = (await admin.describe_topics([topic]))[0]["partitions"]
        response = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic)])
        entries = response[0].resources[0][4]
        return partitions, {entry[0]: entry[1] for entry in entries}
    finally:
        await admin.close()


async def _leader(settings: Settings, topic: str, partition: int) -> int:
    partitions, _ = await _describe(settings, topic)
    return int(next(p["leader"] for p in partitions if p["partition"] == partition))


async def _terminal_events(settings: Settings, topic: str) -> list[tuple[str, str]]:
    """(request id, type) of every committed terminal event on `topic`, read from the
    beginning up to its current end by a consumer of its own."""
    consumer = AIOKafkaConsumer(**settings.kafka_options(), enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        partitions = await partitions_of(consumer, topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)  # read_committed: the last stable offset
        out: list[tuple[str, str]] = []
        async with asyncio.timeout(60):
            while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
                batch = await consumer.getmany(*tps, timeout_ms=500)
                for records in batch.values():
                    for record in records:
                        event = orjson.loads(record.value)
                        if event.get("type") in TERMINAL:
                            out.append((event["request_id"], event["type"]))
        return out
    finally:
        await consumer.stop()


async def _while_serving(worker: Worker, task: asyncio.Task[None], work: Awaitable[T],
                         timeout_s: float) -> T:
    """`work`'s result; fails at once, naming why, if the worker stops first."""
    job = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({job, task}, timeout=timeout_s,
                                 return_when=asyncio.FIRST_COMPLETED)
    if job in done:
        return job.result()
    job.cancel()
    if task in done:
        why = worker.fatal or (None if task.cancelled() else task.exception())
        raise AssertionError(f"the worker stopped: {why!r}")
    raise TimeoutError(f"no answer within {timeout_s:.0f} s")


async def test_losing_a_partition_leader_under_load_loses_and_repeats_nothing(
    endpoints, unique_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    began = time.monotonic()
    cfg = _cluster_config(tmp_path)
    settings: Settings | None = None
    client: sluice.Client | None = None
    worker: Worker | None = None
    task: asyncio.Task[None] | None = None
    try:
        report = await asyncio.to_thread(kafka_broker.up, cfg)
        nodes = report["nodes"]
        assert isinstance(nodes, list) and [n["up"] for n in nodes] == [True] * 3, report
        assert report["bootstrap"] == ",".join(n["bootstrap"] for n in nodes)
        pids = {n["node_id"]: n["pid"] for n in nodes}

        settings = Settings(kafka_bootstrap=str(report["bootstrap"]),
                            database_url=endpoints.database_url, db_schema=unique_name,
                            topic_prefix=unique_name, request_partitions=PARTITIONS)
        client = sluice.Client(settings)
        client.models.register(model=MODEL, path=str(tiny_model), compute_config={
            "kv_cache_len": 4096, "delivery": "exactly_once"})
        key = client.keys.create(tenant="acme")
        client.keys.grant(key, model=MODEL)
        topic = settings.requests_topic(MODEL)
        described, configs = await _describe(settings, topic)
        assert len(described) == PARTITIONS
        assert all(len(p["replicas"]) == 3 for p in described), described
        assert configs["min.insync.replicas"] == "2"

        worker = Worker(settings, WorkerOptions(model=MODEL, instance_id="broker-loss-0"))
        task = asyncio.create_task(worker.run())
        sessions = _sessions()
        done_ids: list[str] = []

        async def one(i: int, delay: float = 0.0) -> str:
            await asyncio.sleep(delay)
            done = await client.complete(
                model=MODEL, api_key=key, session_id=sessions[i % len(sessions)],
                request_id=f"bl-{i}", prompt=f"item {i} of the load", max_tokens=24,
                timeout=150)
            done_ids.append(done.request_id)
            return done.request_id

        await _while_serving(worker, task, one(-1), 120)  # it serves: the load starts now
        # Sent over ~2 s, so some are answered, some in flight and some not yet sent
        # when the broker dies.
        load = [asyncio.create_task(one(i, i * 0.05)) for i in range(REQUESTS)]

        async def answered_so_far(n: int) -> None:
            while len(done_ids) < n:
                await asyncio.sleep(0.02)

        await _while_serving(worker, task, answered_so_far(6), 60)
        victim = await _leader(settings, topic, 0)
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = len(done_ids) - 1  # the warm-up is not part of the load
        assert killed_at < REQUESTS, "the load was over before the broker died"

        answered = await _while_serving(worker, task, asyncio.gather(*load), 150)
        assert sorted(answered) == sorted(f"bl-{i}" for i in range(REQUESTS))
        assert not task.done() and worker.fatal is None, worker.fatal

        # One broker down for good: the two left carry on.
        after = await _while_serving(worker, task, asyncio.gather(
            *(one(REQUESTS + i) for i in range(AFTER))), 90)
        assert len(after) == AFTER
        assert not task.done() and worker.fatal is None, worker.fatal
        assert await _leader(settings, topic, 0) != victim

        # A worker started while the broker is still down starts and serves beside the
        # first (one exited at start, asking the dead node for offsets).
        second = Worker(settings, WorkerOptions(model=MODEL, instance_id="broker-loss-1"))
        second_task = asyncio.create_task(second.run())
        try:
            async with asyncio.timeout(120):
                while not second.metrics.ready:
                    assert not second_task.done(), second.fatal or second_task.exception()
                    await asyncio.sleep(0.1)
            assert len(await _while_serving(worker, task, asyncio.gather(
                *(one(REQUESTS + AFTER + i) for i in range(AFTER))), 90)) == AFTER
            assert not second_task.done() and second.fatal is None, second.fatal
        finally:
            second.stop()
            await asyncio.wait({second_task}, timeout=60)
        left = await asyncio.to_thread(kafka_broker.status, cfg)
        assert [n["up"] for n in left["nodes"]] == [n != victim for n in (1, 2, 3)], left

        # The cluster's own defaults hold for Kafka's internal topics too.
        offsets, offsets_config = await _describe(settings, "__consumer_offsets")
        assert all(len(p["replicas"]) == 3 for p in offsets), offsets
        assert offsets_config["min.insync.replicas"] == "2"

        expected = {f"bl-{i}" for i in range(-1, REQUESTS + 2 * AFTER)}
        terminal = await _terminal_events(settings, settings.topic("results"))
        counts = collections.Counter(request_id for request_id, _ in terminal)
        assert set(counts) == expected, sorted(expected ^ set(counts))
        twice = {request_id: n for request_id, n in counts.items() if n > 1}
        assert not twice, f"terminal events written more than once: {twice}"
        assert all(kind == "done" for _, kind in terminal), terminal
        print(f"broker {victim} killed after {killed_at} of {REQUESTS} answers; "
              f"test took {time.monotonic() - began:.1f} s")
    finally:
        if worker is not None:
            worker.stop()
        if task is not None:
            await asyncio.wait({task}, timeout=60)
            if task.done() and not task.cancelled():
                task.exception()  # reported above, through worker.fatal, if it mattered
        if client is not None:
            await client.aclose()
        await asyncio.to_thread(kafka_broker.purge, cfg)
        if settings is not None:
            await drop_schema(settings)
