"""Multi-LoRA logits equal PEFT-wrapped transformers on the same weights (float32).

Four adapters with different ranks and target sets (one with rslora, one
written by `make_tiny_adapters` and loaded by PEFT) and the base model run
together in every step: prompt, then 20 decode steps each.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gpu_runtime.tiny import make_tiny_adapters
from tests.runtime_support import (
    greedy,
    hf_logits,
    make_hf_checkpoint,
    make_runtime,
    random_prompt,
    run_to_completion,
)

TOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp-o-r16-rslora": dict(
        r=16, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"]
    ),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model path, base HF model, {adapter name: (adapter dir, PEFT model)})."""
    from peft import LoraConfig, PeftModel, get_peft_model

    root = tmp_path_factory.mktemp("lora_parity")
    path, hf = make_hf_checkpoint(root / "model", seed=11)
    adapters = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(lora_dropout=0.0, **cfg))
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():  # PEFT starts B at zero; make every delta non-zero
            for pname, p in peft_model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        peft_model.save_pretrained(root / name)
        adapters[name] = (root / name, peft_model.eval())
    tiny_dir = make_tiny_adapters(path, root / "tiny", 1)[0]
    adapters["tiny-0"] = (tiny_dir, PeftModel.from_pretrained(copy.deepcopy(hf), tiny_dir).eval())
    return path, hf, adapters


def test_adapters_and_base_in_one_batch_match_peft(setup):
    path, hf, adapters = setup
    rt = make_runtime(path, max_lora_rank=16)
    for name, (adapter_dir, _) in adapters.items():
        info = rt.register_adapter(name, adapter_dir)
        assert info.use_rslora == (name == "mlp-o-r16-rslora")
    keys = [*adapters, None]
    prompts = {f"s{i}": random_prompt(9 + 7 * i, i) for i in range(len(keys))}
    tokens, logits = run_to_completion(rt, prompts, params=greedy(21),
                                       adapter_keys=dict(zip(prompts, keys, strict=True)))
    for (seq_id, prompt), key in zip(prompts.items(), keys, strict=True):
        ref_model = hf if key is None else adapters[key][1]
        assert len(tokens[seq_id]) == 21  # prompt + 20 decode steps
        ref = hf_logits(ref_model, prompt + tokens[seq_id][:-1])[len(prompt) - 1 :]
        diff = (torch.stack(logits[seq_id]) - ref).abs().max().item()
        assert diff <= TOL, f"{key}: max abs diff {diff}"
        assert tokens[seq_id] == ref.argmax(-1).tolist(), key
    # The adapters really change the output.
    base = hf_logits(hf, prompts["s0"])
    assert (hf_logits(adapters["all-r8"][1], prompts["s0"]) - base).abs().max() > 1e-2
    assert rt.num_adapter_swaps == 0
