"""Adapter validation (typed errors naming the problem) and the LoRA Triton kernels."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.errors import AdapterError
from gpu_runtime.lora_format import validate_adapter_dir
from gpu_runtime.tiny import TinySpec, make_tiny_adapters, make_tiny_model
from tests.runtime_support import assert_triton_check_passes, make_runtime


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_format")
    model = make_tiny_model(root / "model")
    other = make_tiny_model(root / "wide", TinySpec(hidden_size=96, num_heads=4))
    wide = make_tiny_adapters(other, root / "w", 1)
    return root, model, make_tiny_adapters(model, root / "a", 3), wide


def _copy(src: Path, dst: Path, **config_changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config_changes}))
    return dst


def test_validate_reports_ranks_targets_and_scale(dirs):
    _, model, adapters, _ = dirs
    info = validate_adapter_dir(model, adapters[2], max_lora_rank=16)
    assert (info.rank, info.use_rslora, info.scale) == (16, True, 8.0 / 4.0)
    assert info.target_modules == ("o_proj", "gate_proj", "down_proj")
    info = validate_adapter_dir(model, adapters[1], max_lora_rank=16)
    assert (info.rank, info.scale, info.target_modules) == (4, 2.0, ("q_proj", "v_proj"))


def test_mismatched_shapes_name_tensor_expected_and_actual(dirs):
    _, model, _, wide = dirs
    with pytest.raises(AdapterError) as err:
        validate_adapter_dir(model, wide[0], max_lora_rank=64)
    msg = str(err.value)
    assert "base_model.model.model.layers.0." in msg and "lora_" in msg
    assert "down_proj.lora_B.weight' has shape [96, 8], expected [64, 8]" in msg
    rt = make_runtime(model)
    with pytest.raises(AdapterError, match="expected"):
        rt.register_adapter("wide", wide[0])
    assert rt.adapters.adapters == {}


def test_rejects_rank_targets_and_missing_files(dirs, tmp_path):
    _, model, adapters, _ = dirs
    with pytest.raises(AdapterError, match="r=16 exceeds max_lora_rank=8"):
        validate_adapter_dir(model, adapters[2], max_lora_rank=8)
    bad = _copy(adapters[0], tmp_path / "lm_head", target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match=r"unsupported target modules \['lm_head'\]"):
        validate_adapter_dir(model, bad, 64)
    extra = _copy(adapters[1], tmp_path / "extra")
    state = load_file(extra / "adapter_model.safetensors")
    state["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    save_file(state, str(extra / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"unsupported tensor 'base_model\.model\.lm_head"):
        validate_adapter_dir(model, extra, 64)
    dora = _copy(adapters[1], tmp_path / "dora", use_dora=True)
    with pytest.raises(AdapterError, match="use_dora"):
        validate_adapter_dir(model, dora, 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        validate_adapter_dir(model, tmp_path / "empty", 64)
    no_weights = _copy(adapters[1], tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"no adapter_model\.safetensors"):
        validate_adapter_dir(model, no_weights, 64)
    assert AdapterError.code == "invalid_request"


def test_lora_kernels_match_reference_in_interpreter():
    pytest.importorskip("triton")
    assert_triton_check_passes("tests.unit.runtime.triton_lora_check")


def test_lora_launchers_reject_bad_inputs():
    pytest.importorskip("triton")
    from gpu_runtime.triton_lora import lora_expand_reference, lora_shrink_triton
    from tests.unit.runtime.triton_lora_check import make_case

    x, a, b, y, starts, slots, max_len = make_case()
    with pytest.raises(ValueError, match="int32"):
        lora_shrink_triton(x, a, starts.long(), slots, max_len)
    with pytest.raises(ValueError, match="contiguous"):
        lora_shrink_triton(x.t().contiguous().t(), a, starts, slots, max_len)
    with pytest.raises(ValueError, match="shapes do not fit"):
        lora_shrink_triton(x[:, :8], a, starts, slots, max_len)
    with pytest.raises(ValueError, match="past the"):
        lora_shrink_triton(x[:5], a, starts, slots, max_len)
    with pytest.raises(ValueError, match="float32"):
        lora_expand_reference(y, x[:, : a.shape[1]].double(), b, starts, slots, max_len)
