"""Deadline benchmark: interactive chat and bulk work under Poisson arrivals, EDF beside FCFS.

`bench_deadlines(device, quick)` builds a SmolLM-135M-shaped random-weight model
in a temporary directory (quick mode: fewer layers, said so in the result),
measures the step speed, sizes the load from it, and runs the same arrival
trace through the engine twice — EDF ordering and FCFS ordering — reporting
throughput, TTFT p50/p99 and timeouts per class, and preemptions.

The load: a burst of bulk prompts lands first, then interactive chat arrives
as a Poisson stream beside a Poisson bulk stream. In arrival order the chat
waits behind the bulk burst and times out; by deadline it goes first. The
goal is zero interactive timeouts under EDF where FCFS has some, at >= 95 %
of FCFS's throughput.

    python -m bench.batcher_bench --device cuda          # prints the JSON
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from batcher.config import BatcherConfig, OrderingPolicy
from batcher.engine import Engine
from batcher.types import TERMINAL_EVENT_TYPES, Expired, Finished, Request, RequestClass
from bench.runtime_bench import SMOLLM_135M as RUNTIME_SMOLLM_135M
from gpu_runtime import Runtime, RuntimeConfig
from gpu_runtime.sequence import SamplingParams
from gpu_runtime.tiny import random_llama_weights

# The runtime benchmark's SmolLM-135M shape, with the fields a loader and its
# stop tokens need here.
SMOLLM_135M = dict(RUNTIME_SMOLLM_135M, model_type="llama", hidden_act="silu",
                   bos_token_id=1, eos_token_id=2, dtype="float32")


@dataclass(frozen=True, slots=True)
class Load:
    interactive_rate: float  # requests / s
    bulk_rate: float
    num_bulk_burst: int
    duration_s: float
    interactive_ttft_s: float
    bulk_ttft_s: float = 600.0
    interactive_prompt: tuple[int, int] = (64, 160)
    interactive_max_tokens: int = 16
    bulk_prompt: tuple[int, int] = (256, 512)
    bulk_max_tokens: int = 32


def build_model(out_dir: Path, num_layers: int) -> Path:
    config = dict(SMOLLM_135M, num_hidden_layers=num_layers)
    save_file(random_llama_weights(config, seed=0), str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def measure_capacity(model_dir: Path, rt_config: RuntimeConfig, budget: int) -> tuple[float, float]:
    """(tokens / s, seconds / step) of a closed-loop run of bulk-shaped requests.

    End to end through the engine, so per-step overheads and decodes count; the
    open-loop load is sized from this rather than from one prefill step.
    """
    load = Load(0.0, 0.0, num_bulk_burst=max(4, budget // 64), duration_s=0.0,
                interactive_ttft_s=600.0)  # fmt: skip
    trace = [(0.0, *rest) for _, *rest in make_trace(load, seed=0)]
    config = BatcherConfig(max_num_batched_tokens=budget, max_num_seqs=256)
    result = asyncio.run(_serve(Runtime(model_dir, rt_config), config, load, trace))
    return result["throughput_tok_s"], result["wall_s"] / max(result["steps"], 1)


def make_trace(load: Load, seed: int) -> list[tuple[float, str, RequestClass, list[int], int]]:
    """(offset s, id, class, prompt, max_tokens), sorted by offset."""
    rng = random.Random(seed)
    out = []

    def add(t: float, cls: RequestClass) -> None:
        lo, hi = load.interactive_prompt if cls is RequestClass.INTERACTIVE else load.bulk_prompt
        prompt = [rng.randrange(3, 49000) for _ in range(rng.randint(lo, hi))]
        inter = cls is RequestClass.INTERACTIVE
        max_tokens = load.interactive_max_tokens if inter else load.bulk_max_tokens
        out.append((t, f"{cls.value[0]}{len(out)}", cls, prompt, max_tokens))

    for _ in range(load.num_bulk_burst):
        add(rng.uniform(0.0, 0.2), RequestClass.BULK)
    for rate, cls in (
        (load.interactive_rate, RequestClass.INTERACTIVE),
        (load.bulk_rate, RequestClass.BULK),
    ):
        t = 0.3
        while rate > 0 and (t := t + rng.expovariate(rate)) < load.duration_s:
            add(t, cls)
    return sorted(out, key=lambda x: x[0])


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


async def _serve(rt: Runtime, config: BatcherConfig, load: Load, trace: list) -> dict[str, Any]:
    ends: dict[str, Any] = {}
    classes = {rid: cls for _, rid, cls, _, _ in trace}
    async with Engine(rt, config) as engine:
        start = time.time()

        async def feed() -> None:
            for offset, rid, cls, prompt, max_tokens in trace:
                await asyncio.sleep(max(0.0, start + offset - time.time()))
                ttft = (
                    load.interactive_ttft_s if cls is RequestClass.INTERACTIVE else load.bulk_ttft_s
                )
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                engine.submit(
                    Request(rid, tuple(prompt), params, start + offset, start + offset + ttft,
                            request_class=cls)
                )

        feeder = asyncio.create_task(feed())
        while len(ends) < len(trace):
            ev = await engine.next_event()
            if isinstance(ev, TERMINAL_EVENT_TYPES):
                ends[ev.key] = ev
        await feeder
        elapsed = time.time() - start
        stats = engine.scheduler.stats
    return _summarize(ends, classes, elapsed, stats.num_preemptions, stats.num_steps)


def _summarize(ends: dict, classes: dict, elapsed: float, preemptions: int, steps: int) -> dict:
    done = [e for e in ends.values() if isinstance(e, Finished)]
    tokens = sum(e.counts.num_prompt_tokens + e.counts.num_completion_tokens for e in done)
    out: dict[str, Any] = {
        "throughput_tok_s": round(tokens / elapsed, 1),
        "completion_tok_s": round(sum(e.counts.num_completion_tokens for e in done) / elapsed, 1),
        "wall_s": round(elapsed, 2),
        "preemptions": preemptions,
        "steps": steps,
    }
    for cls in RequestClass:
        mine = [e for rid, e in ends.items() if classes[rid] is cls]
        ttfts = [e.latency.ttft_ms for e in mine if isinstance(e, Finished)]
        out[cls.value] = {
            "requests": len(mine),
            "done": len(ttfts),
            "timeouts": sum(isinstance(e, Expired) for e in mine),
            "ttft_ms_p50": _pct(ttfts, 0.5),
            "ttft_ms_p99": _pct(ttfts, 0.99),
        }
    return out


def bench_deadlines(device: str, quick: bool) -> dict[str, Any]:
    num_layers = 4 if quick else 30
    budget = 256 if quick else 1024
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), num_layers)
        rt_config = RuntimeConfig(device=device, dtype="float32", kv_cache_len=32768,
                                  max_num_batched_tokens=budget)  # fmt: skip
        rate, step_s = measure_capacity(model_dir, rt_config, budget)
        # Offered load ~75 % of the measured capacity (1/3 chat, 2/3 bulk), after a
        # bulk burst worth ~8 s of work; chat may wait ~3 full-budget steps.
        mean_chat, mean_bulk = 112 + 16, 384 + 32
        load = Load(
            interactive_rate=0.25 * rate / mean_chat,
            bulk_rate=0.5 * rate / mean_bulk,
            num_bulk_burst=max(8, int(8.0 * rate / mean_bulk)),
            duration_s=10.0 if quick else 30.0,
            interactive_ttft_s=max(0.25, 3 * budget / rate),
        )
        trace = make_trace(load, seed=1)
        results: dict[str, Any] = {}
        for policy in (OrderingPolicy.EDF, OrderingPolicy.FCFS):
            config = BatcherConfig(max_num_batched_tokens=budget, max_num_seqs=256, ordering=policy)
            rt = Runtime(model_dir, rt_config)
            results[policy.value] = asyncio.run(_serve(rt, config, load, trace))
    edf, fcfs = results["edf"], results["fcfs"]
    ratio = edf["throughput_tok_s"] / max(fcfs["throughput_tok_s"], 1e-9)
    return {
        "device": device,
        "model": {
            "shape": "SmolLM-135M (hidden 576, 9 heads, 3 KV heads, inter 1536, vocab 49152)",
            "num_layers": num_layers,
            "quick": quick,
            "note": "quick mode: 4 of 30 layers" if quick else "all 30 layers",
            "dtype": "float32",
            "weights": "random",
        },
        "measured_capacity_tok_s": round(rate, 1),
        "measured_step_ms": round(step_s * 1000, 1),
        "max_num_batched_tokens": budget,
        "load": {
            "interactive_rate_per_s": round(load.interactive_rate, 2),
            "bulk_rate_per_s": round(load.bulk_rate, 2),
            "bulk_burst": load.num_bulk_burst,
            "duration_s": load.duration_s,
            "interactive_max_ttft_ms": round(load.interactive_ttft_s * 1000, 1),
            "bulk_max_ttft_ms": load.bulk_ttft_s * 1000,
            "requests": len(trace),
        },
        "edf": edf,
        "fcfs": fcfs,
        "throughput_ratio_edf_over_fcfs": round(ratio, 3),
        "goal_met": edf["interactive"]["timeouts"] == 0
        and fcfs["interactive"]["timeouts"] > 0
        and ratio >= 0.95,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(bench_deadlines(args.device, args.quick), indent=2))


if __name__ == "__main__":
    main()
