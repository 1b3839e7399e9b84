"""Changing a model's compute config and placement while it serves."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from common.settings import Settings
from gpu_runtime.tiny import make_tiny_model
from sluice.errors import InvalidConfigError
from tests.integration.pipeline_helpers import register_tiny, worker_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]



async def _terminal_counts(settings: Settings, expected: int) -> dict[str, int]:
    import orjson
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(settings.topic("results"), auto_offset_reset="earliest",
                                **settings.kafka_options())
    await consumer.start()
    counts: dict[str, int] = {}
    try:
        idle = 0
        while idle < 4:
            batch = await consumer.getmany(timeout_ms=500)
            idle = 0 if batch else idle + 1
            for records in batch.values():
                for record in records:
                    event = orjson.loads(record.value)
                    if event["type"] in ("done", "error", "timeout"):
                        counts[event["request_id"]] = counts.get(event["request_id"], 0) + 1
    finally:
        await consumer.stop()
    return counts


async def test_config_changes_under_load_end_every_request_once(settings, tmp_path) -> None:
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"),
                                compute_config={"kv_cache_len": 4096})

    async def one(i: int) -> str:
        async for event in client.stream(model="tiny", api_key=key, prompt=f"load {i}",
                                         max_tokens=40, request_id=f"r-{i}"):
            if event.type in ("done", "error", "timeout"):
                return event.type
        return "none"

    try:
        with worker_process(settings, "tiny", tmp_path,
                            extra=["--memory-budget-gib", "0.05"]) as worker:
            await asyncio.to_thread(worker.wait_for_log, "assigned partition")
            load = [asyncio.create_task(one(i)) for i in range(60)]
            await asyncio.sleep(0.5)
            dep = await asyncio.to_thread(client.models.update_compute_config, model="tiny",
                                          compute_config={"kv_cache_len": 8192})
            assert dep.compute_config.kv_cache_len == 8192
            await asyncio.to_thread(client.models.update, model="tiny",
                                    placement={"max_ttft_ms": 30000})
            # A config the worker's memory cannot hold is refused before any reload.
            with pytest.raises(InvalidConfigError) as info:
                await asyncio.to_thread(client.models.update_compute_config, model="tiny",
                                        compute_config={"kv_cache_len": 10_000_000})
            assert "insufficient memory" in str(info.value)
            assert "kv_cache_len" in str(info.value)
            more = [asyncio.create_task(one(100 + i)) for i in range(20)]
            ends = await asyncio.wait_for(asyncio.gather(*load, *more), 180)
            assert ends == ["done"] * 80, worker.log()
            await asyncio.to_thread(worker.wait_for_log, "compute config changed")
            assert client.models.show(model="tiny").compute_config.kv_cache_len == 8192
        # On the wire, too: exactly one terminal event per request (no attempt was lost
        # and none served twice to completion).
        terminals = await _terminal_counts(settings, expected=80)
        assert sorted(terminals) == sorted(f"r-{i}" for i in [*range(60), *range(100, 120)])
        assert set(terminals.values()) == {1}
    finally:
        await client.aclose()
        conn = await asyncpg.connect(settings.database_url)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.db_schema}" CASCADE')
        await conn.close()
