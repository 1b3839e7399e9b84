"""bfloat16 on the CPU against transformers in bfloat16, on the same weights.

The tolerance is bfloat16's own: a bf16 forward differs from the float32 one by
rounding (8 mantissa bits), and how much depends on the weights and the order of
operations. So each check measures transformers' bf16 logits against its float32
logits, and allows sluice's bf16 logits at most twice that distance from
transformers' bf16 logits (plus 0.02 for logits near zero): as close to the
reference as the reference is to exact arithmetic, with room for a different but
equally valid order of rounding (sluice normalises, rotates and attends in its own
kernels). Greedy tokens: on the real model equal to transformers' bf16 `generate`;
on random weights, where two logits are often within rounding of each other, each
token sluice picks is transformers' pick or within that tolerance of it.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.parity.test_model_parity import VARIANTS
from tests.runtime_support import (
    greedy_logits_run,
    make_hf_checkpoint,
    make_runtime,
    random_prompt,
)

CHECKED = ("gqa", "tied_mha_bias", "llama3_rope_head_dim", "mistral_window", "qwen2")


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _check(rt, hf32, prompt: list[int], steps: int, exact_greedy: bool) -> None:
    hf16 = type(hf32)(hf32.config).eval()
    hf16.load_state_dict(hf32.state_dict())
    hf16 = hf16.to(torch.bfloat16)
    tokens, ours = greedy_logits_run(rt, prompt, steps)
    if exact_greedy:
        assert tokens == _hf_greedy(hf16, prompt, steps)
    ids = prompt + tokens[:-1]  # the reference reads what sluice generated
    ref16 = _hf_logits(hf16, ids)[len(prompt) - 1:]
    ref32 = _hf_logits(hf32, ids)[len(prompt) - 1:]
    bf16_error = (ref16 - ref32).abs().max().item()
    ours_error = (ours - ref16).abs().max().item()
    tolerance = 2 * bf16_error + 0.02
    assert bf16_error > 0  # the check measures something
    assert ours_error <= tolerance, (ours_error, bf16_error)
    assert ours.dtype == torch.float32  # sampling reads float32 logits
    for step, token in enumerate(tokens):
        best = int(ref16[step].argmax())
        margin = (ref16[step, best] - ref16[step, token]).item()
        assert token == best or margin <= tolerance, (step, token, best, margin, tolerance)


@pytest.mark.parametrize("variant", CHECKED)
def test_bf16_cpu_matches_transformers_bf16(variant, tmp_path) -> None:
    seed = zlib.crc32(variant.encode()) % 1000  # stable across processes, unlike hash()
    path, hf32 = make_hf_checkpoint(tmp_path, seed=seed, **VARIANTS[variant])
    rt = make_runtime(path, dtype="bfloat16", device="cpu")
    assert rt.runner.kv_caches[0].dtype == torch.bfloat16
    assert next(rt.model.parameters()).dtype == torch.bfloat16
    _check(rt, hf32, random_prompt(23, 1), 16, exact_greedy=False)
    rt.check_invariants()


def test_bf16_cpu_real_model_greedy_equals_transformers(tmp_path) -> None:
    from transformers import LlamaForCausalLM

    from tests.real_model import smollm2_dir

    path = smollm2_dir()
    hf32 = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rt = make_runtime(path, dtype="bfloat16", device="cpu")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                        "<|im_start|>assistant\n", add_special_tokens=False).ids
    _check(rt, hf32, prompt, 24, exact_greedy=True)
