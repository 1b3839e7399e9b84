"""Tensor-parallel parity against Hugging Face transformers, on any device.

    python -m bench.tp_check --device cuda --tp 2     # NCCL, GPUs 0 and 1
    python -m bench.tp_check --device cpu --tp 2      # gloo (run by the tests)

Writes a tiny random Llama in a temporary directory — 6 query heads over 3 KV
heads (tp=2 replicates KV heads) and an odd vocabulary — plus one PEFT LoRA
adapter, runs a base and an adapter sequence together through
`Runtime(tp=N)` for the prompt and `--steps` decode steps, and compares every
sampled row's float32 logits with transformers (and PEFT) on the same device.
Prints one line per sequence; exit status 0 when all are within `--tol`.

`--compile` runs the runtime with the compiled decode step (warmed up first)
and two base-model sequences, so the decode steps take the compiled graph; it
fails when the step fell back to eager.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

from gpu_runtime import Runtime, RuntimeConfig, SamplingParams, StepPlan
from gpu_runtime.tiny import make_tiny_adapters

CONFIG = dict(
    vocab_size=257,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    max_position_embeddings=512,
    initializer_range=0.1,  # peaky logits: no greedy near-ties
    bos_token_id=1,
    eos_token_id=2,
)


def _write_model(root: Path) -> tuple[Path, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "model")
    return root / "model", model


def _reference(model: torch.nn.Module, ids: list[int], device: str) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


def run_check(device: str, tp: int, steps: int, tol: float, root: Path,
              compile: bool = False) -> bool:
    from peft import PeftModel

    path, hf = _write_model(root)
    adapter_dir = make_tiny_adapters(path, root / "adapters", 1)[0]
    peft = PeftModel.from_pretrained(copy.deepcopy(hf), adapter_dir).eval()
    refs = {None: hf.to(device), "a0": peft.to(device)}
    config = RuntimeConfig(device=device, dtype="float32", tp=tp, kv_cache_len=1024,
                           compile=compile)
    # Compiled decode steps are the ones without an adapter: two base sequences.
    prompts = {"base": (list(range(3, 40)), None),
               "lora": (list(range(50, 61)), None if compile else "a0")}
    ok = True
    with Runtime(path, config) as rt:
        rt.register_adapter("a0", adapter_dir)
        if compile:
            print(f"compiled the decode step in {rt.warm_up():.1f} s")
        params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        for seq_id, (ids, key) in prompts.items():
            rt.add_sequence(seq_id, ids, params, adapter_key=key)
        tokens = {s: [] for s in prompts}
        logits = {s: [] for s in prompts}
        while rt.sequences:
            plan = {s: min(16, q.num_uncomputed) for s, q in rt.sequences.items()}
            out = rt.execute(StepPlan(plan, return_logits=True))
            for o in out.outputs:
                tokens[o.seq_id].append(o.token_id)
                logits[o.seq_id].append(out.logits[o.seq_id].cpu())
        if compile:
            compiled = rt.runner.compiled
            print(f"compiled steps {compiled.compiled_steps}, fallback: {compiled.failure}")
            ok &= compiled.failure is None and compiled.compiled_steps > 2
    for seq_id, (ids, key) in prompts.items():
        ref = _reference(refs[key], ids + tokens[seq_id][:-1], device)[len(ids) - 1 :]
        diff = (torch.stack(logits[seq_id]) - ref).abs().max().item()
        same = tokens[seq_id] == ref.argmax(-1).tolist()
        ok &= diff <= tol and same
        print(f"{seq_id}: tp={tp} {device} max abs diff {diff:.2e} greedy equal {same}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tp_check")
    parser.add_argument("--device", default="cuda", help="cpu | cuda")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="decode steps after the prompt")
    parser.add_argument("--tol", type=float, default=None, help="default 1e-4 CPU, 1e-3 CUDA")
    parser.add_argument("--compile", action="store_true", help="the compiled decode step")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tp:
        print(f"need {args.tp} CUDA devices, found {torch.cuda.device_count()}")
        return 2
    tol = args.tol if args.tol is not None else (1e-4 if args.device == "cpu" else 1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        ok = run_check(args.device, args.tp, args.steps, tol, Path(tmp), args.compile)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
