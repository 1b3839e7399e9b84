"""FP8 weights: half the bytes of bf16, logits close to float32, greedy mostly equal.

Accuracy is measured on a briefly trained tiny model (arithmetic progressions
mod 128, 150 Adam steps, ~2 s): a random-init model has near-tied top logits
that any rounding flips, which says nothing about FP8 (its greedy agreement
hovers near 87%, its logit error is the same ~3-15%).

Documented tolerance, per prompt:
    ||logits_fp8 - logits_fp32||_2 <= 0.06 * ||logits_fp32 - mean(logits_fp32)||_2
(e4m3 keeps 3 mantissa bits: ~3% RMS error per weight with per-channel scales;
single-logit outliers are larger, so the bound is on the RMS, not the max).
"""

from __future__ import annotations

import pytest
import torch

from gpu_runtime import StepPlan
from gpu_runtime.fp8 import FP8Linear
from gpu_runtime.layers import Linear
from tests.runtime_support import BASE, greedy, make_hf_checkpoint, make_runtime

VOCAB = 128


def _progressions(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(2, 40, (1,), generator=g))
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        out.append([(start + (i % 3 + 1) * j) % VOCAB for j in range(length)])
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(**{**BASE, "vocab_size": VOCAB, "initializer_range": 0.02})
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        start = torch.randint(0, VOCAB, (32, 1))
        stride = torch.randint(1, 4, (32, 1))
        x = (start + stride * torch.arange(24)) % VOCAB
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp("fp8_trained")
    model.save_pretrained(path)
    return path


def _first_logits(rt, prompts):
    out = []
    for i, p in enumerate(prompts):
        cached = rt.add_sequence(f"p{i}", p, greedy(1))
        plan = StepPlan({f"p{i}": len(p) - cached}, return_logits=True)
        out.append(rt.execute(plan).logits[f"p{i}"])
    return torch.stack(out)  # [num_prompts, vocab]


def test_fp8_close_to_float32(trained):
    prompts = _progressions(40, seed=1)
    ref = _first_logits(make_runtime(trained), prompts)
    fp8_rt = make_runtime(trained, quantization="fp8")
    assert sum(isinstance(m, FP8Linear) for m in fp8_rt.model.modules()) == 2 * 7
    got = _first_logits(fp8_rt, prompts)
    centered = ref - ref.mean(-1, keepdim=True)
    rel = ((got - ref).norm(dim=-1) / centered.norm(dim=-1)).max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert rel <= 0.06, rel
    assert agree >= 0.9, agree


def test_fp8_weight_bytes_are_half_of_bf16(tmp_path):
    path, _ = make_hf_checkpoint(tmp_path, seed=7)

    def linear_bytes(rt, kind):
        return sum(
            sum(p.numel() * p.element_size() for p in m.parameters())
            for m in rt.model.modules()
            if type(m) is kind
        )

    # cpu_prepack off: the plain layers' parameters are what is counted.
    bf16 = make_runtime(path, dtype="bfloat16", cpu_prepack=False)
    fp8 = make_runtime(path, dtype="bfloat16", quantization="fp8", cpu_prepack=False)
    bf16_bytes = linear_bytes(bf16, Linear) - bf16.model.lm_head.weight.numel() * 2
    ratio = linear_bytes(fp8, FP8Linear) / bf16_bytes
    assert 0.5 <= ratio < 0.55, ratio
    assert fp8.memory_plan.weight_bytes < bf16.memory_plan.weight_bytes


def test_fp8_quantized_while_loading_equals_quantizing_the_loaded_model(tmp_path):
    from gpu_runtime.config import ModelConfig
    from gpu_runtime.fp8 import quantize_model_fp8
    from gpu_runtime.loader import load_model

    path, _ = make_hf_checkpoint(tmp_path, seed=5, attention_bias=True, mlp_bias=True)
    config = ModelConfig.from_dir(path)
    got = load_model(path, config, torch.bfloat16, "cpu", quantization="fp8").state_dict()
    want = quantize_model_fp8(load_model(path, config, torch.bfloat16, "cpu")).state_dict()
    assert got.keys() == want.keys()
    assert sum(name.endswith("weight_scale") for name in got) == 2 * 7
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_fp8_load_never_holds_two_full_precision_projections(tmp_path, monkeypatch):
    """Each projection is quantized as it is read, so loading an FP8 model needs memory
    for the FP8 model plus one full-precision tensor, not for the full-precision model
    (on a GPU: a 70B model in FP8 fits one H200 only this way)."""
    import weakref

    import gpu_runtime.loader as loader
    from gpu_runtime.config import ModelConfig

    path, _ = make_hf_checkpoint(tmp_path, seed=6)
    inputs: list[weakref.ref[torch.Tensor]] = []
    alive_at_each_call = []
    quantize = loader.quantize_per_channel

    def spy(weight, group=None):
        alive_at_each_call.append(sum(ref() is not None for ref in inputs))
        inputs.append(weakref.ref(weight))
        return quantize(weight, group)

    monkeypatch.setattr(loader, "quantize_per_channel", spy)
    model = loader.load_model(path, ModelConfig.from_dir(path), torch.bfloat16, "cpu",
                              quantization="fp8")
    assert len(inputs) == 2 * 7
    assert alive_at_each_call == [0] * len(inputs)
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 2 * 7
