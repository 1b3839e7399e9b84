"""CPU projections on oneDNN's prepacked weights (`gpu_runtime.cpu_linear`).

The packed product is checked against `F.linear` on the same weights, and a
packed runtime against transformers on the same checkpoint (the model parity
tests run packed too: it is the CPU default); `cpu_prepack=False` is the
`F.linear` runtime the two are compared with.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_runtime.config import ModelConfig
from gpu_runtime.cpu_linear import (
    FusedAway,
    FusedPackedLinear,
    PackedLinear,
    pack_cpu_linears,
    why_not_packed,
)
from gpu_runtime.layers import Linear
from gpu_runtime.lora import LoraLinear
from gpu_runtime.planner import MemoryRequest, weight_bytes_per_device
from tests.parity.test_model_parity import VARIANTS
from tests.runtime_support import (
    assert_ragged_run_matches_hf,
    make_hf_checkpoint,
    make_runtime,
    ragged_run,
)

NOT_HERE = why_not_packed(torch.device("cpu"), torch.float32, compile=False)
pytestmark = pytest.mark.skipif(NOT_HERE is not None, reason=f"no packed product: {NOT_HERE}")


def _linear(out_features: int, in_features: int, dtype: torch.dtype, bias: bool) -> Linear:
    gen = torch.Generator().manual_seed(out_features)
    linear = Linear(in_features, out_features, bias)
    linear.weight.data = torch.randn(out_features, in_features, generator=gen).to(dtype)
    if bias:
        linear.bias.data = torch.randn(out_features, generator=gen).to(dtype)
    return linear


# oneDNN packs bfloat16 only on CPUs with AVX512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere
# the runtime's probe turns it down and bfloat16 projections stay `Linear`.
NO_BF16_PACK = why_not_packed(torch.device("cpu"), torch.bfloat16, compile=False)
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    NO_BF16_PACK is not None, reason=f"no bfloat16 packed product: {NO_BF16_PACK}"))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_packed_product_equals_f_linear(dtype, rows) -> None:
    linear = _linear(200, 96, dtype, bias=True)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == (rows, 200)
    error = ((got.double() - want).norm() / want.norm()).item()
    # float32: summation order only; bfloat16: the output's own rounding (2^-9).
    assert error <= (1e-6 if dtype == torch.float32 else 4e-3), error


def test_packing_reaches_inside_lora_wrappers_and_the_lm_head(tmp_path) -> None:
    path, _ = make_hf_checkpoint(tmp_path, **VARIANTS["gqa"])
    rt = make_runtime(path, device="cpu", max_adapters=2)
    model = rt.model
    layers = model.config.num_layers
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(model.lm_head, PackedLinear)
    assert isinstance(attn.fused_qkv, FusedPackedLinear)
    assert attn.fused_qkv.sizes == [attn.q_proj.out_features, attn.k_proj.out_features,
                                    attn.v_proj.out_features]
    assert isinstance(mlp.fused_gate_up, FusedPackedLinear)
    assert isinstance(attn.q_proj, LoraLinear)  # the adapters' slots stay per projection
    assert isinstance(attn.q_proj.base, FusedAway)
    assert isinstance(attn.o_proj.base, PackedLinear)
    assert sum(isinstance(m, FusedPackedLinear) for m in model.modules()) == 2 * layers
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 2 * layers + 1
    assert not any(type(m) is Linear for m in model.modules())
    plain = make_runtime(path, device="cpu", max_adapters=2, cpu_prepack=False)
    assert not any(isinstance(m, (PackedLinear, FusedPackedLinear))
                   for m in plain.model.modules())
    assert plain.model.model.layers[0].self_attn.fused_qkv is None
    assert pack_cpu_linears(rt.model) == (0, 0)  # nothing is left to fuse or pack
    with pytest.raises(RuntimeError, match="fused product"):
        attn.q_proj.base(torch.zeros(1, attn.q_proj.in_features))


@pytest.mark.parametrize("variant", ["gqa", "tied_mha_bias", "qwen2"])
def test_packed_runtime_matches_transformers_and_the_plain_runtime(variant, tmp_path) -> None:
    path, hf = make_hf_checkpoint(tmp_path, **VARIANTS[variant])
    packed = ragged_run(make_runtime(path, device="cpu"))
    assert_ragged_run_matches_hf(hf, packed, tol=2e-4)
    plain = ragged_run(make_runtime(path, device="cpu", cpu_prepack=False))
    assert packed[0] == plain[0]  # the same tokens
    for s in packed[1]:
        diff = (torch.stack(packed[1][s]) - torch.stack(plain[1][s])).abs().max().item()
        assert diff <= 1e-4, (s, diff)


def test_no_packing_where_it_cannot_serve() -> None:
    cpu = torch.device("cpu")
    assert "compiled" in why_not_packed(cpu, torch.float32, compile=True)
    assert "no oneDNN CPU path" in why_not_packed(cpu, torch.float16, compile=False)
    assert "cuda" in why_not_packed(torch.device("cuda"), torch.float32, compile=False)


def test_planner_counts_the_tied_lm_head_copy(tmp_path) -> None:
    path, _ = make_hf_checkpoint(tmp_path, **VARIANTS["tied_mha_bias"])
    mc = ModelConfig.from_dir(path)
    assert mc.tie_word_embeddings
    shared = MemoryRequest(dtype=torch.float32, kv_cache_len=64)
    apart = MemoryRequest(dtype=torch.float32, kv_cache_len=64, lm_head_copy=True)
    extra = weight_bytes_per_device(mc, apart) - weight_bytes_per_device(mc, shared)
    assert extra == mc.vocab_size * mc.hidden_size * 4
