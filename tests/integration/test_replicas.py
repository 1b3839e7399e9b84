"""Replica identity: two live workers never serve under one group member id.

The same `sluice worker --replica 0` command run twice: the second is refused at
once (exit code 2, a line naming --replica and the holder), the first serves, and
every request gets exactly one terminal event. Without --replica a second worker
takes the next free index and both serve. A killed worker's index is free again at
once, so its restart under the same --replica serves (at least once: a request the
killed one answered but had not committed may be answered again, as a later attempt).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest

import sluice
from tests.integration.pipeline_helpers import (
    drop_schema,
    terminal_attempts,
    terminal_events,
    worker_process,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def request_partitions() -> int:
    return 4


async def _answer_all(client: sluice.Client, key: str, tag: str, count: int) -> set[str]:
    ids = {f"{tag}-{i}" for i in range(count)}
    await asyncio.wait_for(asyncio.gather(*(
        client.complete(model="tiny", api_key=key, request_id=rid, session_id=f"s-{rid}",
                        prompt_token_ids=[1, 2, 3], max_tokens=4) for rid in ids)), 120)
    return ids


async def test_the_same_replica_twice_is_refused_and_nothing_is_answered_twice(
        settings, tiny_model, tmp_path) -> None:
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(tiny_model),
                           compute_config={"kv_cache_len": 4096})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")
    host = socket.gethostname()
    try:
        with worker_process(settings, "tiny", tmp_path, replica=0) as first:
            first.wait_for_log(f"serving tiny as default-{host}-0")
            with worker_process(settings, "tiny", tmp_path, replica=0) as twin:
                assert twin.proc.wait(timeout=60) == 2, twin.log()
                refusal = twin.log()
                assert "--replica" in refusal and f"default-{host}-0" in refusal
                assert "pid" in refusal  # names the live holder
            assert first.proc.poll() is None
            once = await _answer_all(client, key, "one", 20)

            with worker_process(settings, "tiny", tmp_path, replica=None) as second:
                second.wait_for_log(f"serving tiny as default-{host}-1")
                second.wait_for_log("assigned partition")  # the group has both now
                once |= await _answer_all(client, key, "two", 20)
                counts = await terminal_events(settings, settings.topic("results"), once)
                assert set(counts) == once
                assert max(counts.values()) == 1, {r: n for r, n in counts.items() if n > 1}

                first.kill(signal.SIGKILL)
                started = time.monotonic()
                with worker_process(settings, "tiny", tmp_path, replica=0) as again:
                    again.wait_for_log(f"serving tiny as default-{host}-0")
                    assert time.monotonic() - started < 30  # the lock died with its holder
                    later = await _answer_all(client, key, "three", 20)
                    assert second.proc.poll() is None and again.proc.poll() is None
        attempts = await terminal_attempts(settings, settings.topic("results"), once | later)
        assert set(attempts) == once | later
        repeated = {r: a for r, a in attempts.items() if len(set(a)) != len(a)}
        assert not repeated, f"answered twice under one attempt: {repeated}"
    finally:
        await client.aclose()
        await drop_schema(settings)


async def test_a_lock_whose_session_the_server_ended_is_taken_again(settings) -> None:
    """The server ends the lock's session (as a restart does): the holder neither fails
    nor stops — its next check finds the session unusable, whatever error the dead
    connection gives, and takes the lock again on a new one."""
    import asyncpg

    from worker.identity import CHECK_EVERY_S, ReplicaLock

    lock = ReplicaLock(settings.database_dsn(), settings.db_schema, "group-t", 10)
    assert await lock.take("pool-host-0") is None
    holding = asyncio.create_task(lock.hold())
    admin = await asyncpg.connect(settings.database_dsn())
    try:
        ended = await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = $1", lock.session_name)
        assert ended == 1
        async with asyncio.timeout(30):
            while True:
                await asyncio.sleep(CHECK_EVERY_S)
                assert not holding.done(), holding.exception()
                back = await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                    lock.session_name)
                if back == 1:
                    break
        rival = ReplicaLock(settings.database_dsn(), settings.db_schema, "group-t", 10)
        holder = await rival.take("pool-host-0")
        assert holder is not None and lock.session_name.removeprefix(
            "sluice-worker ") in str(holder)
    finally:
        holding.cancel()
        await admin.close()
        await lock.release()


async def test_the_heartbeat_outlives_its_sessions_ending(settings) -> None:
    """The server ends every session of the worker's pool (as a restart does) while the
    heartbeat runs: it logs and beats again once the pool has new ones; its task never
    fails (in the fault run a pool connection left unusable by the restart raised
    InternalClientError through it and stopped the worker)."""
    import asyncpg

    from common.db import create_pool
    from worker.heartbeat import Heartbeat

    await (await create_pool(settings)).close()  # the schema, migrated
    pool = await asyncpg.create_pool(settings.database_dsn(), min_size=1, max_size=2,
                                     server_settings={"search_path": settings.db_schema,
                                                      "application_name": "beat-test"})
    heartbeat = Heartbeat(pool, instance_id="beat-0", model="tiny", pool_name="default",
                          device="cpu", every_s=0.2)
    beating = asyncio.create_task(heartbeat.run())
    admin = await asyncpg.connect(settings.database_dsn())
    try:
        # Sessions ended at every moment of a beat, so some end mid-query (that one
        # left its connection refusing the pool's reset with InternalClientError).
        for i in range(200):
            heartbeat.set_status(f"warming {i % 2}")  # a beat now, not in 0.2 s
            await asyncio.sleep(i % 7 * 0.001)
            await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'beat-test'")
            assert not beating.done(), beating.exception()
        heartbeat.set_status("serving")
        async with asyncio.timeout(30):
            while await admin.fetchval(
                    f'SELECT status FROM "{settings.db_schema}".workers '
                    "WHERE instance_id = 'beat-0'") != "serving":
                await asyncio.sleep(0.2)
    finally:
        beating.cancel()
        await admin.close()
        await pool.close()
        await drop_schema(settings)
