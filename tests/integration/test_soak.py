"""Soak: steady load for SLUICE_SOAK_SECONDS (default 600) through the real broker.

Not part of the default run (`-m soak` selects it; `make test-soak`). Checks that
memory stays flat, no KV block leaks (the allocator's invariant check with no
live sequences), and queues do not grow.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time

import asyncpg
import pytest

from gpu_runtime.tiny import make_tiny_model
from tests.integration.pipeline_helpers import register_tiny
from worker.worker import Worker, WorkerOptions

SOAK_SECONDS = float(os.environ.get("SLUICE_SOAK_SECONDS", "600"))
# The suite-wide per-test timeout is 600 s; a soak needs its length plus set-up.
pytestmark = [pytest.mark.integration, pytest.mark.soak,
              pytest.mark.timeout(int(SOAK_SECONDS) + 300)]


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture
def request_partitions() -> int:
    """The soak's request topic has four partitions, not the suite's two."""
    return 4


async def test_steady_load_stays_flat(settings, tmp_path) -> None:
    seconds = SOAK_SECONDS
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"), tenant="soak",
                                compute_config={"kv_cache_len": 8192})
    worker = Worker(settings, WorkerOptions(model="tiny", instance_id="soak-0"))
    task = asyncio.create_task(worker.run())
    samples: list[tuple[float, float, int]] = []
    counts = {"done": 0, "other": 0}
    stop_at = time.monotonic() + seconds

    async def user(u: int) -> None:
        turn = 0
        while time.monotonic() < stop_at:
            last = None
            async for event in client.stream(
                model="tiny", api_key=key, session_id=f"soak-{u}-{turn // 4}",
                prompt=f"user {u} says {turn}", max_tokens=16,
            ):
                last = event
            counts["done" if last is not None and last.type == "done" else "other"] += 1
            turn += 1

    async def sample() -> None:
        while time.monotonic() < stop_at:
            waiting = worker.engine.num_unfinished if worker.engine else 0
            samples.append((time.monotonic(), _rss_mib(), waiting))
            await asyncio.sleep(max(1.0, seconds / 40))

    try:
        await asyncio.gather(*(user(u) for u in range(16)), sample())
        assert worker.engine is not None and worker.runtime is not None
        await asyncio.sleep(1)
        assert worker.engine.num_unfinished == 0
        assert not worker.runtime.sequences
        worker.runtime.block_manager.check_invariants(live_tables=[])
        bm = worker.runtime.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # nothing referenced: every block free
    finally:
        worker.stop()
        await task
        await client.aclose()
        conn = await asyncpg.connect(settings.database_url)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.db_schema}" CASCADE')
        await conn.close()
    warm = [rss for t, rss, _ in samples[len(samples) // 4:]]
    print(f"soak: {seconds:.0f} s, {counts['done']} done, {counts['other']} other, "
          f"rss {min(warm):.0f}..{max(warm):.0f} MiB, max unfinished "
          f"{max(w for _, _, w in samples)}")
    assert counts["other"] == 0
    assert max(warm) - min(warm) < 64, "RSS kept growing after warm-up"
    assert max(w for _, _, w in samples) <= 16  # one request per user: no queue build-up
