"""Logits and greedy tokens equal Hugging Face (`LlamaForCausalLM`, and Mistral and
Qwen2, the other supported architectures) on the same weights."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime import StepPlan
from tests.runtime_support import (
    assert_ragged_run_matches_hf,
    greedy,
    greedy_logits_run,
    hf_logits,
    make_hf_checkpoint,
    make_runtime,
    ragged_run,
    random_prompt,
)

TOL = 1e-4
VARIANTS = {
    "gqa": {},
    "tied_mha_bias": dict(tie_word_embeddings=True, num_key_value_heads=4, attention_bias=True),
    "llama3_rope_head_dim": dict(
        head_dim=32,
        num_key_value_heads=1,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Mistral: every layer attends to the last 7 positions only, far fewer than the
    # test contexts (up to 60 tokens), and not a multiple of the 16-token block.
    "mistral_window": dict(arch="mistral", sliding_window=7),
    # Qwen2: q/k/v biases without an `attention_bias` key.
    "qwen2": dict(arch="qwen2", num_key_value_heads=1),
    # Qwen2 whose second layer slides over 5 positions, its first attends to all.
    "qwen2_mixed_window": dict(arch="qwen2", num_key_value_heads=1, use_sliding_window=True,
                               sliding_window=5, max_window_layers=1),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_hf_checkpoint(path, seed=hash(request.param) % 1000, **VARIANTS[request.param])


def test_batch1_logits_and_greedy_match_hf(checkpoint):
    path, hf = checkpoint
    rt = make_runtime(path)
    prompt = random_prompt(23, 1)
    tokens, logits = greedy_logits_run(rt, prompt, 20)
    assert len(tokens) == 20
    ref = hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1 :]  # [20, vocab]
    assert (logits - ref).abs().max().item() <= TOL
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0
        )
    assert tokens == hf_out[0, len(prompt) :].tolist()
    rt.check_invariants()


def test_batch7_ragged_mixed_steps_match_hf(checkpoint):
    path, hf = checkpoint
    rt = make_runtime(path)
    run = ragged_run(rt)
    assert run[3] >= 2  # mixed steps
    assert_ragged_run_matches_hf(hf, run, TOL)
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks


def test_sliding_window_serves_beyond_the_window(tmp_path):
    """Contexts are not capped at the window: the model's own limit applies, and a
    session's second turn reuses its cached blocks (windowed layers read from them)."""
    path, hf = make_hf_checkpoint(tmp_path, arch="mistral", sliding_window=12)
    rt = make_runtime(path, max_model_len=200)
    assert rt.model_config.sliding_window == 12 and rt.max_model_len == 200
    first = random_prompt(70, 3)
    rt.add_sequence("t1", first, greedy(1))
    rt.execute(StepPlan({"t1": 70}))
    second = first + random_prompt(30, 4)
    cached = rt.add_sequence("t2", second, greedy(1))
    assert cached == 64  # four full blocks of the first turn
    out = rt.execute(StepPlan({"t2": len(second) - cached}, return_logits=True))
    ref = hf_logits(hf, second)[-1]
    assert (out.logits["t2"] - ref).abs().max().item() <= TOL
    rt.check_invariants()


def test_qwen2_window_only_when_used(tmp_path):
    from gpu_runtime.config import ModelConfig

    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "sliding_window": 32}
    assert ModelConfig.from_dict({**base, "use_sliding_window": False}).sliding_window is None
    # Without layer_types, layers from max_window_layers (default 28) on slide.
    assert ModelConfig.from_dict({**base, "use_sliding_window": True}).sliding_window is None
    config = ModelConfig.from_dict({**base, "use_sliding_window": True, "max_window_layers": 1})
    assert config.sliding_window == 32 and config.sliding_layers == (False, True)
    assert (config.layer_window(0), config.layer_window(1)) == (None, 32)
    layers = {"layer_types": ["sliding_attention", "full_attention"]}
    config = ModelConfig.from_dict({**base, **layers})
    assert (config.layer_window(0), config.layer_window(1)) == (32, None)
    assert ModelConfig.from_dict(
        {**base, "layer_types": ["full_attention"] * 2}).sliding_window is None
    mistral = {**base, "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_dict(mistral).sliding_layers == (True, True)
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).sliding_window is None
