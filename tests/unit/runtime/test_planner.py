"""Memory planner numbers and the InsufficientMemoryError message."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime import InsufficientMemoryError, MemoryRequest, ModelConfig, plan_memory
from gpu_runtime.planner import GIB, plan_for
from tests.runtime_support import make_hf_checkpoint, make_runtime

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        max_position_embeddings=8192)


def test_llama3_8b_numbers():
    req = MemoryRequest(dtype=torch.bfloat16, kv_cache_len=300_000, block_size=16)
    plan = plan_memory(LLAMA3_8B, req, available_bytes=200 * GIB)
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert plan.num_blocks == 18_750
    assert plan.kv_cache_bytes == (300_000 + 16) * 131_072  # + one scratch block
    layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336
    expected = 2 * (32 * (layer + 2 * 4096) + 2 * 128256 * 4096 + 4096)
    assert plan.weight_bytes == expected  # 8.03e9 params in bf16
    assert 16.0e9 < plan.weight_bytes < 16.1e9
    assert plan.num_blocks * 16 >= 300_000
    odd = plan_memory(LLAMA3_8B, MemoryRequest(torch.bfloat16, kv_cache_len=17), 200 * GIB)
    assert odd.num_blocks == 2


def test_tp_and_fp8_shrink_per_device_weights():
    base = MemoryRequest(dtype=torch.bfloat16, kv_cache_len=1024)
    w1 = plan_for(LLAMA3_8B, base, 0).weight_bytes
    tp2 = plan_for(LLAMA3_8B, MemoryRequest(torch.bfloat16, 1024, tp=2), 0)
    assert abs(tp2.weight_bytes - w1 / 2) < 1e6  # only the norms are replicated
    assert tp2.kv_bytes_per_token == plan_for(LLAMA3_8B, base, 0).kv_bytes_per_token // 2
    fp8 = plan_for(LLAMA3_8B, MemoryRequest(torch.bfloat16, 1024, quantization="fp8"), 0)
    embeddings = 2 * 2 * 128256 * 4096
    ratio = (fp8.weight_bytes - embeddings) / (w1 - embeddings)
    assert 0.49 < ratio < 0.51


def test_insufficient_memory_error_explains():
    req = MemoryRequest(dtype=torch.bfloat16, kv_cache_len=300_000)
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(LLAMA3_8B, req, available_bytes=40 * GIB)
    msg = str(err.value)
    for part in (
        "need",
        "weights",
        "KV cache",
        "kv_cache_len=300000",
        "activation",
        "available 40.00 GiB",
    ):
        assert part in msg
    assert "lower kv_cache_len to at most" in msg
    assert "raise tp to 2" in msg
    assert "quantization=fp8" in msg


def test_runtime_refuses_to_load_and_never_shrinks(tmp_path):
    path, _ = make_hf_checkpoint(tmp_path)
    with pytest.raises(InsufficientMemoryError, match="insufficient memory"):
        make_runtime(path, kv_cache_len=1_000_000, memory_budget_bytes=64 << 20)
    rt = make_runtime(path, kv_cache_len=1000, memory_budget_bytes=512 << 20)
    assert rt.block_manager.num_blocks == 63  # ceil(1000 / 16)
    assert rt.runner.kv_caches[0].shape == (2, 64, 16, 2, 16)  # + the runner's scratch block


@pytest.mark.parametrize(("checkpoint", "native", "cpu", "cuda"), [
    ("bfloat16", True, "bfloat16", "bfloat16"),
    ("bfloat16", False, "float32", "bfloat16"),  # a CPU that would emulate bf16
    ("float16", True, "float32", "float16"),  # no fp16 path on the CPU
    ("float32", True, "float32", "bfloat16"),  # a float32 checkpoint is not narrowed on CPU
    (None, True, "float32", "bfloat16"),
])
def test_auto_dtype_follows_the_checkpoint_where_the_device_computes_it(
        monkeypatch, checkpoint, native, cpu, cuda) -> None:
    import dataclasses

    from gpu_runtime import loader

    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native)
    config = dataclasses.replace(LLAMA3_8B, torch_dtype=checkpoint)
    assert loader.default_dtype(config, "cpu") == cpu
    assert loader.default_dtype(config, torch.device("cpu")) == cpu
    assert loader.default_dtype(config, "cuda:1") == cuda
