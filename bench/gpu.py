"""GPU mode: a Llama-3-8B-shaped random-weight model on one GPU, bf16 and fp8.

Needs nothing from outside: no broker, no download. Random weights are drawn
on the device, one layer at a time, and written as a sharded safetensors
checkpoint in a temporary directory (the runtime loads only real checkpoint
formats). Measures, in one process:

- decode tokens/s at batch 1, 16, 64, 256 (bf16 and fp8 weights);
- prefill tokens/s (16 prompts x 512 tokens per step);
- decode at batch 64 spread over 4 LoRA adapters vs 1 adapter vs none;
- the machine's limits: HBM bandwidth (a large tensor read; also the H200's
  4.8 TB/s spec) and bf16 matmul FLOP/s at the decode shapes; batch-1 decode
  as a fraction of both bandwidths (bytes of weights + KV read per step).

    python -m bench.gpu --json out.json          # ~5 min on one H200
    python -m bench.gpu --tiny --device cpu      # the same code paths, tiny shape
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.harness import (
    MatmulShape,
    figure,
    goal,
    machine_info,
    measure_bandwidth,
    measure_matmul,
    ratio,
    sync_for,
    timed,
)
from bench.runtime_bench import decode_tokens_s
from gpu_runtime import Runtime, RuntimeConfig, SamplingParams, StepPlan

H200_HBM_BYTES_S = 4.8e12
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 128001,
    "dtype": "bfloat16",
}  # fmt: skip
TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "dtype": "float32"}  # fmt: skip
BATCHES = (1, 16, 64, 256)
PROMPT_LEN = 128


def _layer_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }  # fmt: skip


def write_random_model(config: dict[str, Any], out: Path, device: str,
                       dtype: torch.dtype) -> Path:
    """A sharded HF checkpoint of N(0, 0.02) weights (norms 1), drawn on `device`."""
    gen = torch.Generator(device).manual_seed(0)
    h, vocab = config["hidden_size"], config["vocab_size"]

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=dtype)
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        return (t * 0.02).to(dtype).cpu()

    weight_map: dict[str, str] = {}

    def write(name: str, shard: dict[str, torch.Tensor]) -> None:
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))

    write("model-embed.safetensors", {"model.embed_tokens.weight": rand((vocab, h)),
                                      "model.norm.weight": rand((h,)),
                                      "lm_head.weight": rand((vocab, h))})
    for i in range(config["num_hidden_layers"]):  # one layer at a time in host memory
        write(f"model-layer-{i:03d}.safetensors",
              {f"model.layers.{i}.{n}": rand(s) for n, s in _layer_shapes(config).items()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _add_batch(rt: Runtime, tag: str, batch: int, prompt_len: int, max_tokens: int,
               keys: list[str | None] | None = None) -> list[str]:
    gen = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    prompts = torch.randint(3, rt.model_config.vocab_size, (batch, prompt_len), generator=gen)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = []
    for i, p in enumerate(prompts.tolist()):
        rt.add_sequence(f"{tag}-{i}", p, params, adapter_key=keys[i] if keys else None)
        ids.append(f"{tag}-{i}")
    return ids


def _prefill(rt: Runtime, ids: list[str], budget: int) -> None:
    """Compute every prompt token, at most `budget` tokens per step."""
    while True:
        plan: dict[str, int] = {}
        left = budget
        for sid in ids:
            s = rt.sequences.get(sid)  # None: finished (max_tokens reached) and removed
            if s is not None and s.num_computed_tokens < s.num_prompt_tokens and left > 0:
                plan[sid] = min(s.num_uncomputed, left)
                left -= plan[sid]
        if not plan:
            return
        rt.execute(StepPlan(plan))


def decode_tps(rt: Runtime, device: str, batch: int, steps: int,
               keys: list[str | None] | None = None, tag: str = "d") -> float:
    """Decode tokens/s of `batch` sequences, 128-token prompts, after one warm-up step."""
    sync = sync_for(device)
    ids = _add_batch(rt, f"{tag}{batch}", batch, PROMPT_LEN, steps + 3, keys)
    _prefill(rt, ids, budget=8192)
    return decode_tokens_s(rt, ids, steps, sync)


def prefill_tps(rt: Runtime, device: str, num_prompts: int, prompt_len: int,
                rounds: int = 3) -> float:
    sync = sync_for(device)
    best = 0.0
    for r in range(rounds + 1):  # round 0 warms up (kernel compilation)
        ids = _add_batch(rt, f"p{r}", num_prompts, prompt_len, 1)
        seconds = timed(lambda ids=ids: _prefill(rt, ids, num_prompts * prompt_len), sync)
        for sid in ids:
            rt.remove_sequence(sid)
        if r:
            best = max(best, num_prompts * prompt_len / seconds)
    return best


def step_bytes(rt: Runtime, context_len: int) -> int:
    """Bytes a batch-1 decode step must read: every weight but the embedding table, + KV."""
    c = rt.model_config
    weights = sum(p.numel() * p.element_size() for n, p in rt.model.named_parameters()
                  if "embed_tokens" not in n and "lora" not in n.lower())
    # Packed CPU projections (gpu_runtime.cpu_linear) are no parameters: count their weights.
    weights += sum(m.packed.numel() * m.packed.element_size() for m in rt.model.modules()
                   if hasattr(m, "packed"))
    if c.tie_word_embeddings and not hasattr(rt.model.lm_head, "packed"):
        weights += c.vocab_size * c.hidden_size * rt.runner.dtype.itemsize
    kv = c.num_layers * 2 * c.num_kv_heads * c.head_dim * rt.runner.dtype.itemsize * context_len
    return weights + kv


def _weights_run(rt: Runtime, device: str, tiny: bool, bandwidth: float) -> dict[str, Any]:
    steps = 4 if tiny else 32
    decode = {b: decode_tps(rt, device, b, steps) for b in BATCHES}
    num_prompts, prompt_len = (2, 32) if tiny else (16, 512)
    prefill = prefill_tps(rt, device, num_prompts, prompt_len, rounds=1 if tiny else 3)
    per_step = step_bytes(rt, PROMPT_LEN + steps // 2)
    reached = decode[1] * per_step
    return {
        "decode_tokens_s": {f"batch_{b}": figure(v, "tok/s", 1) for b, v in decode.items()},
        "prefill_tokens_s": figure(prefill, "tok/s", 0),
        "bytes_per_decode_step": figure(per_step / 1e9, "GB", 3),
        "batch_1_bandwidth_reached": figure(reached / 1e9, "GB/s", 1),
        "fraction_of_limit": {
            "batch_1_of_hbm_spec_4_8_tb_s": figure(reached / H200_HBM_BYTES_S, "fraction"),
            "batch_1_of_measured_bandwidth": figure(reached / bandwidth, "fraction"),
        },
    }


def _adapters_run(rt: Runtime, device: str, model_dir: Path, tiny: bool) -> dict[str, Any]:
    from gpu_runtime.tiny import make_tiny_adapters

    paths = make_tiny_adapters(model_dir, model_dir / "adapters", 4)
    for p in paths:
        rt.register_adapter(p.name, p)
    batch, steps = (8, 4) if tiny else (64, 32)
    modes: dict[str, list[str | None]] = {
        "none": [None] * batch,
        "1_adapter": [paths[0].name] * batch,
        "4_adapters_mixed": [paths[i % 4].name for i in range(batch)],
    }
    best = dict.fromkeys(modes, 0.0)
    for r in range(2):  # interleaved rounds, best of each
        for mode, keys in modes.items():
            best[mode] = max(best[mode], decode_tps(rt, device, batch, steps, keys, f"a{r}{mode}"))
    return {
        "batch": figure(batch, "requests", 0),
        "decode_tokens_s": {m: figure(v, "tok/s", 1) for m, v in best.items()},
        "ratios": {
            "4_adapters_over_none": ratio(best["4_adapters_mixed"], best["none"]),
            "4_adapters_over_1_adapter": ratio(best["4_adapters_mixed"], best["1_adapter"]),
        },
        "note": "adapters from gpu_runtime.tiny.make_tiny_adapters (ranks 2-16, mixed targets)",
    }


def _release(rt: Runtime | None) -> None:
    del rt
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_gpu(device: str = "cuda", *, tiny: bool = False) -> dict[str, Any]:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("GPU mode needs CUDA; use --tiny --device cpu to run it on the CPU")
    started = time.perf_counter()
    config = TINY if tiny else LLAMA3_8B
    on_gpu = device.startswith("cuda")
    dtype_name = "bfloat16" if on_gpu else "float32"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    bandwidth = measure_bandwidth(device, dtype, (4 << 30) if on_gpu else (64 << 20))
    shapes = [MatmulShape(b, hidden, inter) for b in BATCHES]
    matmul = measure_matmul(device, shapes, dtype)
    kv_len = max(BATCHES) * (PROMPT_LEN + 40) + 8192
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(config, Path(tmp), device, dtype)
        written = time.perf_counter() - started
        base = dict(device=device, dtype=dtype_name, kv_cache_len=kv_len,
                    max_num_batched_tokens=8192, max_num_seqs=max(BATCHES), max_lora_rank=16)
        rt: Runtime | None = Runtime(model_dir, RuntimeConfig(**base, max_adapters=4))
        results[dtype_name] = _weights_run(rt, device, tiny, bandwidth)
        results["adapters"] = _adapters_run(rt, device, model_dir, tiny)
        _release(rt)
        rt = Runtime(model_dir, RuntimeConfig(**base, max_adapters=0, quantization="fp8"))
        results["fp8"] = _weights_run(rt, device, tiny, bandwidth)
        _release(rt)
    bf, f8 = results[dtype_name], results["fp8"]
    results["ratios"] = {
        f"fp8_over_{dtype_name}_decode_batch_{b}": ratio(
            f8["decode_tokens_s"][f"batch_{b}"]["value"],
            bf["decode_tokens_s"][f"batch_{b}"]["value"]) for b in BATCHES
    }
    results["limits"] = {
        "hbm_spec": figure(H200_HBM_BYTES_S / 1e12, "TB/s", 2),
        "measured_bandwidth": figure(bandwidth / 1e12, "TB/s", 3),
        "matmul": {s.name: figure(matmul[s.name] / 1e12, "TFLOP/s", 3) for s in shapes},
    }
    results["goals"] = {
        "batch_1_decode_of_hbm": goal(
            ">= 0.80 of 4.8 TB/s at batch 1 (bf16)",
            bf["fraction_of_limit"]["batch_1_of_hbm_spec_4_8_tb_s"]["value"], 0.8,
            unit="fraction"),
        "4_adapters_over_1": goal(
            ">= 0.9x one adapter",
            results["adapters"]["ratios"]["4_adapters_over_1_adapter"]["value"], 0.9),
    }
    shape = ("tiny Llama (hidden 64, 2 layers)" if tiny else
             "Llama-3-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, inter 14336, "
             "vocab 128256)") + ", random weights"
    return {
        "scenario": "gpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(device),
        "model_shape": shape,
        "tiny": tiny,
        "wall_s": {"weights_written": round(written, 1),
                   "total": round(time.perf_counter() - started, 1)},
        "results": results,
    }


def print_gpu(doc: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console

    from bench.table import goals_table, scenario_table

    console = console or Console()
    console.print(f"[bold]sluice bench gpu[/] {doc['date']}  {doc['model_shape']}")
    console.print(scenario_table("gpu", doc["results"]))
    console.print(goals_table({"results": {"gpu": doc["results"]}}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (runs on a CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the JSON document here")
    args = parser.parse_args(argv)
    doc = run_gpu(args.device, tiny=args.tiny)
    print_gpu(doc)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
