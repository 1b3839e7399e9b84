"""The asyncio engine loop over the fake runtime (real clock, worker thread)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from batcher.config import BatcherConfig
from batcher.engine import Engine
from batcher.errors import EngineClosedError
from batcher.types import (
    Cancelled,
    Expired,
    Failed,
    Finished,
    Tokens,
)
from gpu_runtime.sequence import StepOutput, StepPlan
from tests.unit.batcher.fake_runtime import FakeRuntime, run_alone
from tests.unit.batcher.sim import collect, make_request


class SlowRuntime(FakeRuntime):
    """Sleeps in `execute` like a model would, and records the thread it ran on."""

    def __init__(self, step_s: float = 0.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.step_s = step_s
        self.threads: set[str] = set()
        self.num_executes = 0

    def execute(self, plan: StepPlan) -> StepOutput:
        self.threads.add(threading.current_thread().name)
        self.num_executes += 1
        time.sleep(self.step_s)
        return super().execute(plan)


def prompt(i: int, n: int) -> list[int]:
    return [(i * 11 + j) % 100 for j in range(n)]


async def test_requests_in_events_out_in_a_worker_thread() -> None:
    rt = SlowRuntime(num_blocks=64, block_size=4)
    async with Engine(rt, BatcherConfig(max_num_batched_tokens=32)) as engine:
        for i in range(20):
            engine.submit(
                make_request(f"r{i}", prompt(i, 3 + i), arrival=time.time(), max_tokens=5)
            )
        events = await collect(engine, {f"r{i}" for i in range(20)})
        await engine.drain()
        with pytest.raises(EngineClosedError):
            engine.submit(make_request("late", [1], arrival=time.time()))
    for i in range(20):
        evs = events[f"r{i}"]
        assert isinstance(evs[-1], Finished)
        tokens = [t for e in evs if isinstance(e, Tokens) for t in e.token_ids]
        assert tokens == run_alone(prompt(i, 3 + i), 5, 100, None) == list(evs[-1].token_ids)
        assert [e.seq for e in evs if isinstance(e, Tokens)] == list(range(5))
    assert rt.threads and all(name.startswith("sluice-step") for name in rt.threads)
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks


async def test_loop_stays_responsive_and_idles_without_spinning() -> None:
    rt = SlowRuntime(step_s=0.05, num_blocks=64, block_size=4)
    async with Engine(rt) as engine:
        engine.submit(make_request("r", prompt(1, 4), arrival=time.time(), max_tokens=6))
        ticks = 0
        start = time.monotonic()
        while time.monotonic() - start < 0.3:
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks >= 15  # the event loop ran while steps computed in the thread
        await collect(engine, {"r"})
        executes = rt.num_executes
        await asyncio.sleep(0.3)
        assert rt.num_executes == executes  # idle: no steps, no spinning


async def test_cancel_timeout_and_backpressure() -> None:
    rt = SlowRuntime(step_s=0.01, num_blocks=64, block_size=4)
    config = BatcherConfig(max_num_waiting=2, max_num_seqs=1)
    async with Engine(rt, config) as engine:
        engine.submit(make_request("long", prompt(1, 4), arrival=time.time(), max_tokens=1000))
        engine.submit(make_request("old", prompt(2, 4), arrival=time.time() - 5.0, max_ttft=1.0))
        engine.submit(make_request("w1", prompt(3, 4), arrival=time.time(), max_ttft=60.0))
        engine.submit(make_request("w2", prompt(4, 4), arrival=time.time(), max_ttft=60.0))
        await asyncio.sleep(0.05)
        assert engine.is_full()
        assert engine.cancel("long") and engine.cancel("w2")
        events = await collect(engine, {"long", "old", "w1", "w2"})
        assert not engine.is_full()
    assert isinstance(events["long"][-1], Cancelled)
    assert isinstance(events["w2"][-1], Cancelled)
    timeout = events["old"][-1]
    assert isinstance(timeout, Expired) and timeout.waited_ms >= 5000.0
    assert isinstance(events["w1"][-1], Finished)
    assert not rt.sequences


async def test_step_failures_fail_whom_they_concern_and_the_loop_goes_on() -> None:
    rt = SlowRuntime(num_blocks=64, block_size=4)
    async with Engine(rt) as engine:
        rt.fail_seq = "bad"
        for rid in ("bad", "good"):
            engine.submit(make_request(rid, prompt(len(rid), 4), arrival=time.time()))
        events = await collect(engine, {"bad", "good"})
        assert isinstance(events["bad"][-1], Failed) and events["bad"][-1].code == "internal"
        assert isinstance(events["good"][-1], Finished)
        rt.fail_step = True
        engine.submit(make_request("x", prompt(5, 4), arrival=time.time()))
        events = await collect(engine, {"x"})
        assert isinstance(events["x"][-1], Failed)
        engine.submit(make_request("after", prompt(6, 4), arrival=time.time()))
        events = await collect(engine, {"after"})
        assert isinstance(events["after"][-1], Finished)


async def test_stop_returns_unfinished_requests() -> None:
    rt = SlowRuntime(step_s=0.01, num_blocks=64, block_size=4)
    engine = Engine(rt)
    await engine.start()
    engine.submit(make_request("r", prompt(1, 4), arrival=time.time(), max_tokens=10_000))
    await asyncio.sleep(0.05)
    dropped = await engine.stop()
    assert [r.key for r in dropped] == ["r"]
    assert not rt.sequences
