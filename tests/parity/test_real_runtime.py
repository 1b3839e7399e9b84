"""The batcher over the real `gpu_runtime.Runtime` on a tiny random-weight model (CPU)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from batcher.config import BatcherConfig
from batcher.engine import Engine
from batcher.runtime_port import RuntimePort
from batcher.types import Event, Finished, Request, Tokens
from gpu_runtime import Runtime, RuntimeConfig
from gpu_runtime.sequence import SamplingParams, StepPlan
from gpu_runtime.tiny import make_tiny_adapters, make_tiny_model
from tests.unit.batcher.sim import collect

ADAPTERS = [None, "sales", "support", "legal", "ops"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    make_tiny_adapters(path, path / "adapters", len(ADAPTERS) - 1)
    return path


def runtime(model_dir: Path, kv_cache_len: int, slots: int = 4) -> Runtime:
    """The real runtime with the four real LoRA adapters registered."""
    rt = Runtime(model_dir, RuntimeConfig(kv_cache_len=kv_cache_len, max_adapters=slots))
    for i, name in enumerate(a for a in ADAPTERS if a is not None):
        rt.register_adapter(name, model_dir / "adapters" / f"adapter-{i}")
    return rt


def workload(n: int, seed: int) -> list[tuple[str, list[int], int, str | None]]:
    """Mixed lengths; a few shared system prompts so sessions and prefixes hit the cache."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 380) for _ in range(rng.choice([16, 40]))] for _ in range(3)]
    out = []
    for i in range(n):
        head = rng.choice(systems) if rng.random() < 0.6 else []
        tail = [rng.randrange(3, 380) for _ in range(rng.randint(1, 70))]
        out.append((f"r{i}", head + tail, rng.randint(1, 10), rng.choice(ADAPTERS)))
    return out


def run_alone(rt: Runtime, prompt: list[int], max_tokens: int, adapter: str | None) -> list[int]:
    rt.add_sequence("alone", prompt, SamplingParams(max_tokens=max_tokens), adapter)
    tokens: list[int] = []
    while "alone" in rt.sequences:
        out = rt.execute(StepPlan({"alone": rt.sequences["alone"].num_uncomputed}))
        tokens.extend(o.token_id for o in out.outputs)
    return tokens


async def serve(engine: Engine, requests: list[Request]) -> dict[str, list[Event]]:
    for req in requests:
        engine.submit(req)
    return await collect(engine, {r.key for r in requests}, timeout=120)


def to_requests(work: list[tuple[str, list[int], int, str | None]]) -> list[Request]:
    now = time.time()
    return [
        Request(rid, tuple(p), SamplingParams(max_tokens=m), now, now + 600.0, adapter_key=a)
        for rid, p, m, a in work
    ]


def check_exact(model_dir: Path, work, events) -> None:
    ref = runtime(model_dir, 8192)
    for rid, prompt, max_tokens, adapter in work:
        evs = events[rid]
        assert isinstance(evs[-1], Finished), evs[-1]
        streamed = [t for e in evs if isinstance(e, Tokens) for t in e.token_ids]
        assert streamed == list(evs[-1].token_ids)
        assert streamed == run_alone(ref, prompt, max_tokens, adapter), rid


async def test_two_hundred_mixed_requests_match_running_alone(model_dir: Path) -> None:
    rt = runtime(model_dir, 8192)
    port: RuntimePort = rt
    work = workload(200, seed=1)
    config = BatcherConfig(max_num_batched_tokens=256, max_num_seqs=64, max_adapters_per_step=4)
    async with Engine(port, config, adapters=rt.adapters) as engine:
        events = await serve(engine, to_requests(work))
        await engine.drain()
        stats = engine.scheduler.stats
    assert stats.max_adapters_in_step <= 4
    assert sum(e.counts.num_cached_prompt_tokens for evs in events.values() for e in evs
               if isinstance(e, Finished)) > 0  # fmt: skip
    check_exact(model_dir, work, events)
    rt.check_invariants()
    assert not rt.sequences
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks


async def test_small_cache_preempts_and_stays_exact(model_dir: Path) -> None:
    # 16 blocks of 16 tokens, and two adapter slots for four adapters: swaps too.
    rt = runtime(model_dir, 256, slots=2)
    work = [(rid, p[:60], 12, a) for rid, p, _, a in workload(40, seed=2)]
    config = BatcherConfig(max_num_batched_tokens=128, kv_headroom_blocks=1,
                           max_adapters_per_step=2)
    async with Engine(rt, config, adapters=rt.adapters) as engine:
        events = await serve(engine, to_requests(work))
        stats = engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert stats.max_adapters_in_step <= 2 and rt.num_adapter_swaps > 0
    check_exact(model_dir, work, events)
    rt.check_invariants()
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks
