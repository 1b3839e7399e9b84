"""Hostile input: 10,000+ malformed records. Each ends in the dead-letter topic or an
`error` event with a clear reason; the worker never exits; its memory stays flat."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from common.settings import Settings
from gpu_runtime.tiny import make_tiny_model
from tests.integration.pipeline_helpers import register_tiny, worker_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_RECORDS = 10_000


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def hostile_records(rnd: random.Random, key: str, n: int):
    """(value, headers, answerable) triples; answerable records carry a request id and
    a usable reply topic, so they must be answered with an `error` event."""
    base = {"v": 1, "model": "tiny", "prompt": "hi", "max_tokens": 4}
    auth = [("authorization", f"Bearer {key}".encode())]

    def req(i: int, **changes: object) -> dict:
        return {**base, "request_id": f"fz-{i}", **changes}

    makers = [
        lambda i: (rnd.randbytes(rnd.randint(0, 300)), auth, False),
        lambda i: (b"\xff\xfe\xfd" + rnd.randbytes(20), auth, False),
        lambda i: (b'{"request_id": "fz-%d", "prompt": "\xed\xa0\x80"}' % i, auth, False),
        lambda i: (b"[" * 5000 + b"]" * 5000, auth, False),
        lambda i: (orjson.dumps([req(i)]), auth, False),
        lambda i: (orjson.dumps(req(i, max_tokens=10**12)), auth, True),
        lambda i: (orjson.dumps(req(i, max_tokens=-5)), auth, True),
        lambda i: (orjson.dumps(req(i, temperature="hot")), auth, True),
        lambda i: (orjson.dumps(req(i, top_p=7.5)), auth, True),
        lambda i: (orjson.dumps(req(i, prompt=None)), auth, True),
        lambda i: (orjson.dumps(req(i, messages=[{"role": "x"}], prompt=None)), auth, True),
        lambda i: (orjson.dumps(req(i, metadata={"a": {"b": {"c": [[[[[[1]]]]]]}}},
                                    stop=["x"] * 100)), auth, True),
        lambda i: (orjson.dumps(req(i, prompt_token_ids=[-1, 2], prompt=None)), auth, True),
        lambda i: (orjson.dumps(req(i, v=7)), auth, True),
        lambda i: (orjson.dumps(req(i, surprise=True)), auth, True),
        lambda i: (orjson.dumps(req(i, reply_topic="sluice-does-not-exist-" + str(i))), auth,
                   False),
        lambda i: (orjson.dumps(req(i)), [("authorization", rnd.randbytes(40))], True),
        lambda i: (orjson.dumps(req(i)), [("authorization", b"Bearer a"),
                                          ("authorization", b"Bearer b")], True),
        lambda i: (orjson.dumps(req(i)), [], True),
        lambda i: (orjson.dumps(req(i, model="other")), auth, True),
        lambda i: (orjson.dumps(req(i, adapter="ghost")), auth, True),
        lambda i: (orjson.dumps(req(i, prompt_token_ids=[10**9], prompt=None)), auth, True),
    ]
    for i in range(n):
        yield makers[i % len(makers)](i)


async def test_ten_thousand_hostile_records(settings, tmp_path) -> None:
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"))
    rnd = random.Random(1234)
    records = list(hostile_records(rnd, key, NUM_RECORDS))
    # Two 10 MB prompts: over the worker's limit, so answered with a clear error.
    huge = orjson.dumps({"v": 1, "request_id": "fz-huge", "model": "tiny", "max_tokens": 1,
                         "prompt": "x" * 10_000_000})
    records += [(huge, [("authorization", f"Bearer {key}".encode())], False)] * 2
    try:
        with worker_process(settings, "tiny", tmp_path) as worker:
            await asyncio.to_thread(worker.wait_for_log, "assigned partition")
            warm = await client.complete(model="tiny", api_key=key, prompt="warm", max_tokens=2)
            assert warm.usage.completion_tokens >= 1
            rss_before = _rss_bytes(worker.proc.pid)
            producer = AIOKafkaProducer(**settings.kafka_options(),
                                        max_request_size=16 * 1024 * 1024, linger_ms=5)
            await producer.start()
            try:
                for value, headers, _ in records:
                    await producer.send(settings.requests_topic("tiny"), value, headers=headers,
                                        key=str(rnd.random()).encode())
                await producer.flush()
            finally:
                await producer.stop()
            dead, errors = await _collect(settings, len(records))
            ok = await client.complete(model="tiny", api_key=key, prompt="after", max_tokens=2)
            assert ok.usage.completion_tokens >= 1
            assert worker.proc.poll() is None, worker.log()
            rss_after = _rss_bytes(worker.proc.pid)
    finally:
        await client.aclose()
        conn = await asyncpg.connect(settings.database_url)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.db_schema}" CASCADE')
        await conn.close()
    answerable = sum(1 for _, _, a in records if a)
    assert len(dead) + len(errors) == len(records)
    assert len(errors) == answerable
    assert all(e["message"] and e["code"] in {
        "invalid_request", "unauthorized", "unknown_model", "unknown_adapter",
        "context_too_long"} for e in errors)
    assert all(d["reason"] for d in dead)
    growth = rss_after - rss_before
    print(f"fuzz: sent={len(records)} deadlettered={len(dead)} errors={len(errors)} "
          f"rss_before={rss_before >> 20} MiB rss_after={rss_after >> 20} MiB")
    assert growth < 150 * 2**20, f"RSS grew by {growth >> 20} MiB"


async def _collect(settings: Settings, expected: int) -> tuple[list[dict], list[dict]]:
    consumer = AIOKafkaConsumer(settings.topic("deadletter"), settings.topic("results"),
                                **settings.kafka_options(),
                                auto_offset_reset="earliest", fetch_max_bytes=32 * 2**20)
    await consumer.start()
    dead: list[dict] = []
    errors: list[dict] = []
    try:
        async with asyncio.timeout(240):
            while len(dead) + len(errors) < expected:
                batch = await consumer.getmany(timeout_ms=500)
                for tp, rs in batch.items():
                    for record in rs:
                        body = orjson.loads(record.value)
                        if tp.topic.endswith(".deadletter"):
                            dead.append(body)
                        elif body.get("type") == "error" and body["request_id"].startswith(
                                "fz-"):
                            errors.append(body)
    finally:
        await consumer.stop()
    return dead, errors
