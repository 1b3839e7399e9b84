"""`sluice worker --tp 2`: a two-rank replica serves through Kafka; losing a rank ends
the replica cleanly and its requests complete on another worker."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

import sluice
from schemas import DoneEvent
from tests.integration.pipeline_helpers import drop_schema, worker_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _rank_helpers(pid: int) -> list[int]:
    """The tensor-parallel helper ranks a worker process spawned."""
    found = []
    # Children are listed under the thread that started them (the model loads
    # off the event loop), so look at every thread.
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                found.append(int(child))
    return found


async def test_tp2_replica_serves_and_dies_cleanly(settings, tiny_model, tmp_path) -> None:
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(tiny_model),
                           compute_config={"kv_cache_len": 4096})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")

    async def one(i: int, max_tokens: int) -> DoneEvent:
        return await client.complete(model="tiny", api_key=key, session_id=f"s{i}",
                                     prompt=f"request {i}", max_tokens=max_tokens,
                                     request_id=f"tp-{i}-{max_tokens}")

    try:
        with worker_process(settings, "tiny", tmp_path, replica=0,
                            extra=["--tp", "2"]) as ranked:
            await asyncio.to_thread(ranked.wait_for_log, "assigned partition", 120)
            served = await asyncio.wait_for(asyncio.gather(*(one(i, 6) for i in range(8))), 120)
            assert all(d.usage.completion_tokens >= 1 for d in served)
            helpers = _rank_helpers(ranked.proc.pid)
            assert len(helpers) == 1, helpers

            with worker_process(settings, "tiny", tmp_path, replica=1) as plain:
                await asyncio.to_thread(plain.wait_for_log, "assigned partition")
                load = asyncio.gather(*(one(i, 200) for i in range(40)))
                await asyncio.sleep(0.5)
                import os

                os.kill(helpers[0], signal.SIGKILL)
                started = time.monotonic()
                code = await asyncio.to_thread(ranked.proc.wait, 60)
                assert code == 3, ranked.log()  # the replica ends, no hang
                assert time.monotonic() - started < 60
                assert "replica down" in ranked.log()
                done = await asyncio.wait_for(load, 180)
                assert len(done) == 40, plain.log()
                assert plain.proc.poll() is None
    finally:
        await client.aclose()
        await drop_schema(settings)
