"""A runtime micro-benchmark on a SmolLM-135M-shaped random-weight model.

`bench_runtime(device, quick)` measures decode tokens/s at batch 1/8/32/64 and
prefill tokens/s, Hugging Face `generate` on the same weights (when
transformers is installed), and the machine's limits: memory bandwidth (a
1 GiB read; a copy is reported beside it) and matmul FLOP/s at the decode
shapes. Fractions:

    batch-1 decode   bytes of weights read per step * steps/s  /  bandwidth
    batch-B decode   2 * params * B * steps/s  /  matmul FLOP/s at [B, hidden] shapes

Quick mode uses 4 of the 30 layers and fewer steps (said in the result).

`bench_adapters(device, quick)` measures multi-LoRA decode: one batch spread
over 4 rank-16 adapters (all seven projections) vs the same batch on one
adapter vs the base model, in one runtime, rounds interleaved, best of each.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu_runtime import Runtime, RuntimeConfig
from gpu_runtime.sequence import SamplingParams, StepPlan
from gpu_runtime.tiny import random_llama_weights

SMOLLM_135M = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}
PROMPT_LEN = 128


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def decode_tokens_s(rt: Runtime, ids: list[str], steps: int, sync: Callable[[], None],
                    rounds: int = 1) -> float:
    """Decode tokens/s of the sequences `ids`, their prompts computed: one warm-up step,
    then the best of `rounds` runs of `steps` steps. Removes the sequences after."""
    rt.execute(StepPlan(dict.fromkeys(ids, 1)))  # warm-up

    def run() -> None:
        for _ in range(steps):
            rt.execute(StepPlan(dict.fromkeys(ids, 1)))

    seconds = min(_timed(run, sync) for _ in range(rounds))
    for sid in ids:
        rt.remove_sequence(sid)
    return len(ids) * steps / seconds


def _write_model(config: dict, out: Path) -> None:
    save_file(random_llama_weights(config, seed=0), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))


def _prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(1, vocab, (batch, PROMPT_LEN), generator=g).tolist()


def _decode_tps(rt: Runtime, batch: int, steps: int, sync: Callable[[], None],
                rounds: int = 3) -> float:
    """Best of `rounds` runs of `steps` decode steps (HF's figures are best-of too)."""
    params = SamplingParams(max_tokens=rounds * steps + 2, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, rt.model_config.vocab_size)):
        rt.add_sequence(f"b{batch}-{i}", p, params)
    rt.execute(StepPlan({s: q.num_uncomputed for s, q in rt.sequences.items()}))
    return decode_tokens_s(rt, list(rt.sequences), steps, sync, rounds)


def _compiled_decode(
    path: Path, device: str, batches: list[int], steps: int, sync: Callable[[], None]
) -> tuple[dict[int, float], float]:
    """Decode tokens/s of a runtime with the compiled step, and its warm-up seconds."""
    rt = Runtime(path, RuntimeConfig(device=device, dtype="float32", kv_cache_len=64 * 256,
                                     compile=True))
    warmup_s = rt.warm_up()
    decode = {b: _decode_tps(rt, b, steps, sync) for b in batches}
    if rt.compile_failure is not None:
        raise RuntimeError(f"the compiled step fell back to eager: {rt.compile_failure}")
    return decode, warmup_s


def _prefill_tps(rt: Runtime, sync: Callable[[], None]) -> float:
    prompts = _prompts(8, rt.model_config.vocab_size)
    for i, p in enumerate(prompts):
        p[0] = i  # distinct first blocks: no prefix-cache hits across rounds
        rt.add_sequence(f"p{i}", p, SamplingParams(max_tokens=1))
    seconds = _timed(lambda: rt.execute(StepPlan(dict.fromkeys(rt.sequences, PROMPT_LEN))), sync)
    return 8 * PROMPT_LEN / seconds


def _hf_decode_tps(path: Path, batch: int, steps: int, device: str,
                   compiled: bool = False) -> float | None:
    """HF `generate` decode tokens/s; `compiled`: the gpt-fast recipe any user can copy
    (a static KV cache and `torch.compile` of the forward pass; CUDA graphs on CUDA),
    its compile warm-up excluded (reported by `_hf_compiled`)."""
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return None
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(_prompts(batch, model.config.vocab_size), device=device)
    extra: dict[str, object] = {}
    if compiled:
        mode = "reduce-overhead" if device.startswith("cuda") else None
        model.forward = torch.compile(model.forward, mode=mode, dynamic=False)
        extra["cache_implementation"] = "static"

    def gen(n: int) -> Callable[[], object]:
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
        return lambda: model.generate(ids, **kw)

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    steps = max(steps, 16)  # enough decode steps that the prefill-only run is small beside them
    with torch.inference_mode():
        warm_start = time.perf_counter()
        if compiled:  # compile the prefill and decode shapes first
            gen(steps + 1)()
            gen(1)()
            _hf_compiled.warmup_s = time.perf_counter() - warm_start
        else:
            gen(2)()
        t1 = min(_timed(gen(1), sync) for _ in range(3))
        tn = min(_timed(gen(steps + 1), sync) for _ in range(2))
    if tn - t1 > 0.2 * tn:
        return batch * steps / (tn - t1)
    # Too noisy to subtract the prefill: report the whole run's rate (a lower bound).
    return batch * (steps + 1) / tn


class _hf_compiled:  # a namespace: the last compile warm-up
    warmup_s: float | None = None


def measure_read_bandwidth(device: str, dtype: torch.dtype, num_bytes: int,
                           sync: Callable[[], None]) -> float:
    """Bytes/s of reading one `num_bytes` tensor, best of 3: the faster of a sum and a
    matrix-vector product (decoding's own access pattern; on a CPU a sum alone is
    partly compute-bound). Make `num_bytes` larger than the last-level cache."""
    rows = num_bytes // (1024 * torch.finfo(dtype).bits // 8)
    x = torch.ones(rows, 1024, dtype=dtype, device=device)
    ones = torch.ones(1024, dtype=dtype, device=device)
    best = float("inf")
    for read in (lambda: x.sum(), lambda: torch.mv(x, ones)):
        read()
        best = min(best, *(_timed(read, sync) for _ in range(3)))
    return x.numel() * x.element_size() / best


def _machine_limits(
    device: str, hidden: int, inter: int, batches: list[int], sync: Callable[[], None]
) -> dict:
    # Decoding reads weights and writes almost nothing, so the limit is a large read
    # (1 GiB, well past any last-level cache); a copy is reported beside it.
    read_bandwidth = measure_read_bandwidth(device, torch.float32, 1 << 30, sync)
    src = torch.ones(64 << 20, dtype=torch.float32, device=device)  # 256 MiB each way
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = min(_timed(lambda: dst.copy_(src), sync) for _ in range(3))
    copy_bandwidth = 2 * src.numel() * 4 / copy_s  # read + write
    flops = {}
    shapes = [(hidden, hidden), (inter, hidden), (hidden, inter)]
    weights = [torch.randn(o, i, device=device) for o, i in shapes]
    for b in batches:
        xs = [torch.randn(b, w.shape[1], device=device) for w in weights]

        def mm(xs: list[torch.Tensor] = xs) -> None:
            for _ in range(20):
                for x, w in zip(xs, weights, strict=True):
                    torch.nn.functional.linear(x, w)

        mm()
        seconds = min(_timed(mm, sync) for _ in range(3))
        flops[b] = 20 * sum(2 * b * w.numel() for w in weights) / seconds
    return {"memory_bandwidth_bytes_s": read_bandwidth, "copy_bandwidth_bytes_s": copy_bandwidth,
            "matmul_flops": flops}


def bench_runtime(device: str = "cpu", quick: bool = True) -> dict:
    """Measure the runtime (and HF) on a SmolLM-135M-shaped model; returns a JSON-able dict."""
    config = dict(SMOLLM_135M, num_hidden_layers=4 if quick else 30)
    steps = 4 if quick else 32
    batches = [1, 8, 32, 64]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        _write_model(config, path)
        rt = Runtime(path, RuntimeConfig(device=device, dtype="float32", kv_cache_len=64 * 256))
        # From the config: on CPU the projections' weights are packed, not parameters.
        mc = rt.model_config
        q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        per_layer = mc.hidden_size * (2 * q + 2 * kv) + 3 * mc.hidden_size * mc.intermediate_size
        linear_params = mc.num_layers * per_layer
        step_params = linear_params + config["vocab_size"] * config["hidden_size"]  # + LM head
        limits = _machine_limits(
            device, config["hidden_size"], config["intermediate_size"], batches, sync
        )
        eager = {b: _decode_tps(rt, b, steps, sync) for b in batches}
        prefill = _prefill_tps(rt, sync)
        # The compiled step (what a CPU worker serves by default) takes a minute or two
        # to compile the first time: full runs only.
        compiled, warmup_s = (None, None) if quick else _compiled_decode(path, device, batches,
                                                                        steps, sync)
        decode = compiled or eager
        hf = {b: _hf_decode_tps(path, b, steps, device) for b in (1, 8)}
        # The compiled baseline takes minutes to compile on a CPU: full runs only.
        hf_compiled = None if quick else _hf_decode_tps(path, 1, steps, device, compiled=True)
        hf_compile_warmup_s = None if quick else _hf_compiled.warmup_s
    bw = limits["memory_bandwidth_bytes_s"]
    return {
        "device": device,
        "quick": quick,
        "note": ("quick mode: 4 of 30 layers, 4 decode steps, eager steps only" if quick
                 else "full model, 32 steps; decode_tokens_s is the compiled step"),
        "model": {"layers": config["num_hidden_layers"], "params_per_step": step_params},
        "threads": torch.get_num_threads(),
        "decode_tokens_s": decode,
        "eager_decode_tokens_s": eager,
        "compiled_decode_tokens_s": compiled,
        "compile_warmup_s": warmup_s,
        "prefill_tokens_s": prefill,
        "hf_generate_decode_tokens_s": hf,
        "hf_static_cache_compiled_decode_tokens_s": {1: hf_compiled},
        "hf_compile_warmup_s": hf_compile_warmup_s,
        "batch1_vs_hf_compiled": (decode[1] / hf_compiled) if hf_compiled else None,
        "memory_bandwidth_gb_s": bw / 1e9,
        "copy_bandwidth_gb_s": limits["copy_bandwidth_bytes_s"] / 1e9,
        "matmul_gflops": {b: f / 1e9 for b, f in limits["matmul_flops"].items()},
        "batch1_fraction_of_bandwidth": decode[1] * step_params * 4 / bw,
        "fraction_of_matmul_limit": {
            b: decode[b] * 2 * step_params / limits["matmul_flops"][b] for b in batches
        },
    }


def _write_adapters(model_dir: Path, out_root: Path, n: int, rank: int) -> list[Path]:
    from gpu_runtime.config import ModelConfig
    from gpu_runtime.lora_format import CONFIG_FILE, PROJECTIONS, WEIGHTS_FILE, projection_shape

    config = ModelConfig.from_dir(model_dir)
    paths = []
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        state = {}
        for layer, proj in ((li, p) for li in range(config.num_layers) for p in PROJECTIONS):
            group = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{proj}"
            out_f, in_f = projection_shape(config, proj)
            state[prefix + ".lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            state[prefix + ".lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
        path = out_root / f"adapter-{i}"
        path.mkdir()
        save_file(state, str(path / WEIGHTS_FILE))
        cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
        cfg["target_modules"] = list(PROJECTIONS)
        (path / CONFIG_FILE).write_text(json.dumps(cfg))
        paths.append(path)
    return paths


def _adapter_decode_tps(
    rt: Runtime, keys: list[str | None], steps: int, sync: Callable[[], None]
) -> float:
    """Decode tokens/s of one batch, sequence i on adapter keys[i]."""
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i, (p, key) in enumerate(zip(_prompts(len(keys), 49152), keys, strict=True)):
        p[0] = i + len(keys) * hash(tuple(keys)) % 1000  # no prefix hits across modes
        rt.add_sequence(f"a{i}", p, params, adapter_key=key)
    rt.execute(StepPlan({s: q.num_uncomputed for s, q in rt.sequences.items()}))
    return decode_tokens_s(rt, list(rt.sequences), steps, sync)


def bench_adapters(device: str = "cpu", quick: bool = True) -> dict:
    """Decode tokens/s: batch over 4 adapters vs 1 adapter vs base; returns a JSON-able dict."""
    config = dict(SMOLLM_135M, num_hidden_layers=4 if quick else 30)
    steps, batch, rounds = (8, 16, 3) if quick else (16, 64, 3)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    modes: dict[str, list[str | None]] = {
        "base": [None] * batch,
        "1_adapter": ["adapter-0"] * batch,
        "4_adapters": [f"adapter-{i % 4}" for i in range(batch)],
    }
    best = dict.fromkeys(modes, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        _write_model(config, path)
        adapter_root = path / "adapters"
        adapter_root.mkdir()
        rt = Runtime(path, RuntimeConfig(
            device=device, dtype="float32", kv_cache_len=batch * 256,
            max_adapters=4, max_lora_rank=16,
        ))  # fmt: skip
        for p in _write_adapters(path, adapter_root, 4, rank=16):
            rt.register_adapter(p.name, p)
        for _ in range(rounds):
            for mode, keys in modes.items():
                best[mode] = max(best[mode], _adapter_decode_tps(rt, keys, steps, sync))
    return {
        "device": device,
        "quick": quick,
        "note": (
            "quick mode: 4 of 30 layers, batch 16, 8 decode steps"
            if quick
            else "full model, batch 64, 16 decode steps"
        ),
        "batch": batch,
        "rank": 16,
        "decode_tokens_s": best,
        "4_adapters_vs_1": best["4_adapters"] / best["1_adapter"],
        "1_adapter_vs_base": best["1_adapter"] / best["base"],
    }


if __name__ == "__main__":
    import sys

    bench = bench_adapters if "--adapters" in sys.argv else bench_runtime
    device = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "cpu"
    print(json.dumps(bench(device, "--full" not in sys.argv), indent=2))
