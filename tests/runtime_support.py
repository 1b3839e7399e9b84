"""Shared helpers: tiny random-weight HF checkpoints and runtime drivers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from gpu_runtime import Runtime, RuntimeConfig, SamplingParams, StepPlan
from gpu_runtime.tiny import make_tiny_adapters

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.1,  # peaky logits: greedy ties would make parity flaky
            bos_token_id=1, eos_token_id=2)


def make_hf_checkpoint(path: Path, seed: int = 0, arch: str = "llama",
                       **overrides: object) -> tuple[Path, object]:
    """Save a random HF causal LM (float32; `arch` llama, mistral or qwen2) to `path`;
    return (path, hf_model)."""
    import transformers

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms init to exactly 1 and biases to 0: perturb them so
        for name, p in model.named_parameters():  # they are tested
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path, model


def checkpoint_with_adapters(root: Path, name: str, seed: int, **overrides: object
                             ) -> tuple[Path, list[Path]]:
    """`make_hf_checkpoint` at `root/name` and three tiny adapters of it (ranks 8, 4, 16)."""
    path, _ = make_hf_checkpoint(root / name, seed=seed, **overrides)
    return path, make_tiny_adapters(path, root / f"{name}-adapters", 3)


def hf_logits(hf_model: object, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of the HF model on one sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def greedy_logits_run(rt: Runtime, prompt: list[int], steps: int
                      ) -> tuple[list[int], torch.Tensor]:
    """One greedy sequence from `prompt` to its end: (tokens, float32 logits [steps, vocab])."""
    rt.add_sequence("a", prompt, greedy(steps))
    tokens, logits = [], []
    plan = {"a": len(prompt)}
    while rt.sequences:
        out = rt.execute(StepPlan(plan, return_logits=True))
        tokens.append(out.outputs[0].token_id)
        logits.append(out.logits["a"])
        plan = {"a": 1}
    return tokens, torch.stack(logits)


def make_runtime(path: Path, **overrides: object) -> Runtime:
    cfg = dict(kv_cache_len=4096, block_size=16, memory_budget_bytes=8 << 30)
    return Runtime(path, RuntimeConfig(**{**cfg, **overrides}))


def run_to_completion(
    rt: Runtime,
    prompts: dict[str, list[int]],
    chunk: int = 8,
    params: SamplingParams | None = None,
    adapter_keys: dict[str, str | None] | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Add all prompts (each with its adapter in `adapter_keys`, if any), then step with
    prefill chunks of `chunk` tokens until all finish, checking invariants every step.

    Returns per sequence its generated ids and the logits of each sampled step.
    """
    generated: dict[str, list[int]] = {s: [] for s in prompts}
    logits: dict[str, list[torch.Tensor]] = {s: [] for s in prompts}
    for seq_id, ids in prompts.items():
        rt.add_sequence(seq_id, ids, params or greedy(),
                        adapter_key=(adapter_keys or {}).get(seq_id))
    while rt.sequences:
        plan = {s: min(chunk, q.num_uncomputed) for s, q in rt.sequences.items()}
        out = rt.execute(StepPlan(plan, return_logits=True))
        for o in out.outputs:
            generated.setdefault(o.seq_id, []).append(o.token_id)
            logits.setdefault(o.seq_id, []).append(out.logits[o.seq_id])
        rt.check_invariants()
    return generated, logits


def random_prompts(n: int, vocab: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(n)
    return {f"s{i}": torch.randint(3, vocab, (5 + 6 * i,), generator=g).tolist() for i in range(n)}


def run_mixed(
    rt: Runtime, prompts: dict[str, list[int]], keys: list[str | None]
) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Prompt + 20 decode steps per sequence, all in one batch; (tokens, logits)."""
    tokens = {s: [] for s in prompts}
    logits = {s: [] for s in prompts}
    for (seq_id, ids), key in zip(prompts.items(), keys, strict=True):
        rt.add_sequence(seq_id, ids, greedy(21), adapter_key=key)
    while rt.sequences:
        plan = {s: min(8, q.num_uncomputed) for s, q in rt.sequences.items()}
        out = rt.execute(StepPlan(plan, return_logits=True))
        for o in out.outputs:
            tokens[o.seq_id].append(o.token_id)
            logits[o.seq_id].append(out.logits[o.seq_id])
    return tokens, {s: torch.stack(v) for s, v in logits.items()}


def assert_same_runs(a: tuple, b: tuple, tol: float = 1e-4) -> None:
    """Equal tokens, logits within `tol`, 21 sampled tokens each (prompt + 20 decodes)."""
    tokens_a, logits_a = a
    tokens_b, logits_b = b
    assert tokens_a == tokens_b
    for s in logits_a:
        assert len(tokens_a[s]) == 21
        diff = (logits_a[s] - logits_b[s]).abs().max().item()
        assert diff <= tol, f"{s}: max abs diff {diff}"


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def ragged_run(rt: Runtime) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]],
                                     dict[str, list[int]], int]:
    """Seven sequences (prompts of 1..40 tokens, three joining after 3 steps so they
    prefill while the others decode), 20 greedy tokens each, prefill chunks of 8.

    Returns per sequence its tokens, the logits of each sampled step and its prompt,
    and the number of mixed (decode + prefill) steps. Checks invariants every step.
    """
    lengths = [1, 5, 16, 17, 33, 40, 9]
    prompts = {f"s{i}": random_prompt(n, 10 + i) for i, n in enumerate(lengths)}
    late = {"s4", "s5", "s6"}
    tokens: dict[str, list[int]] = {s: [] for s in prompts}
    logits: dict[str, list[torch.Tensor]] = {s: [] for s in prompts}
    for s in sorted(prompts.keys() - late):
        rt.add_sequence(s, prompts[s], greedy(20))
    step, mixed_steps = 0, 0
    while rt.sequences or step < 3:
        if step == 3:
            for s in sorted(late):
                rt.add_sequence(s, prompts[s], greedy(20))
        plan = {s: min(8, q.num_uncomputed) for s, q in rt.sequences.items()}
        mixed_steps += 1 in plan.values() and any(n > 1 for n in plan.values())
        out = rt.execute(StepPlan(plan, return_logits=True))
        for o in out.outputs:
            tokens[o.seq_id].append(o.token_id)
            logits[o.seq_id].append(out.logits[o.seq_id])
        rt.check_invariants()
        step += 1
    return tokens, logits, prompts, mixed_steps


def assert_same_ragged_run(got: tuple, want: tuple, tol: float) -> None:
    """Two `ragged_run`s of one checkpoint: the same tokens, logits within `tol`."""
    assert got[0] == want[0]
    for s in got[1]:
        diff = (torch.stack(got[1][s]) - torch.stack(want[1][s])).abs().max().item()
        assert diff <= tol, (s, diff)


def assert_ragged_run_matches_hf(hf_model: object, run: tuple, tol: float) -> None:
    """Every sequence of a `ragged_run`: 20 tokens, logits within `tol` of HF's on the
    same tokens, and HF's greedy choice at every step."""
    tokens, logits, prompts, _ = run
    for s, prompt in prompts.items():
        assert len(tokens[s]) == 20
        ref = hf_logits(hf_model, prompt + tokens[s][:-1])[len(prompt) - 1 :]
        diff = (torch.stack(logits[s]) - ref).abs().max().item()
        assert diff <= tol, f"{s}: max abs diff {diff}"
        assert tokens[s] == ref.argmax(-1).tolist()


def assert_triton_check_passes(module: str) -> None:
    """Run a Triton check script (`python -m module`) in the Triton interpreter. In a
    process of its own: TRITON_INTERPRET must be set before triton is first imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
