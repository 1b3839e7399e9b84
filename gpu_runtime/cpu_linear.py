"""CPU projections on oneDNN's prepacked weights: `Linear` -> `PackedLinear`.

On the CPU `F.linear` multiplies by the row-major weight: float32 through MKL's
sgemm, bfloat16 through oneDNN, which lays the weight out for its kernels
again at every call. A decode step is 211 such calls on small matrices.
`PackedLinear` holds the weight in oneDNN's own blocked layout, made once at
load (`torch.ops.mkldnn._reorder_linear_weight`, the layout torch's inductor
uses for frozen CPU graphs), and multiplies with
`torch.ops.mkldnn._linear_pointwise`. The math is the same IEEE float32 (or
bfloat16 with float32 accumulation); only the summation order differs. Each
decoder layer's q/k/v and gate/up projections, which read the same input,
become one packed product each (`FusedPackedLinear`), split after.

Measured on SmolLM2-135M's 210 layer weights, 2 threads, weights cold in cache
(AMD EPYC with avx512_bf16; `python -m bench.cpu_kernels` measures the 1,
8 and 32 row cases): float32 1.7x `F.linear` at 1 row, 1.9x at 8, 1.5x at 32,
1.1x at 512; bfloat16 1.0x, 1.7x, 1.4x; the 49k-row LM head 2.2x at 1 row in
float32. In the served model: benchmarks/README.md (`sluice bench cpu`).

The layout is chosen for a hinted row count (`PACK_ROWS`); other counts work
unchanged (measured: within 10 % of a pack made for them from 1 to 512 rows).

Where the packed weight cannot be used the layers stay `Linear`: on CUDA, for
float16 (oneDNN needs avx512_fp16), under `torch.compile` (inductor packs its
own constants, and an opaque oneDNN tensor is no graph input), or when the
probe at load (one small packed product against `F.linear`) raises or disagrees;
the reason is logged. A tied LM head is packed as a copy of the embedding
table (the lookup needs the plain rows); the memory planner counts it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.config import RuntimeConfig
from gpu_runtime.context import StepContext
from gpu_runtime.layers import Linear
from gpu_runtime.lora import LoraLinear

log = logging.getLogger(__name__)

PACK_ROWS = 8  # the row count the blocked layout is chosen for (see the module doc)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W in oneDNN's blocked layout (an opaque `torch._mkldnn`
    tensor: it has no strides and cannot be sliced, read or saved)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype
        self.packed = _pack(linear.weight.data)  # not a parameter: no state_dict entry
        self.bias = linear.bias

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def why_not_packed(device: torch.device, dtype: torch.dtype, compile: bool) -> str | None:
    """None when this runtime's projections can be packed, else the reason."""
    if device.type != "cpu":
        return f"the device is {device.type}"
    if dtype not in PACKABLE_DTYPES:
        return f"{dtype} has no oneDNN CPU path here"
    if compile:  # dynamo cannot trace the opaque weight (measured: torch 2.15)
        return "the decode step is compiled (inductor packs its own constants)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    return _probe(dtype)


def _probe(dtype: torch.dtype) -> str | None:
    """One small packed product against `F.linear`: None if it runs and agrees."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, _pack(weight), None, "none", [], "")
    except Exception as exc:  # a torch without the op, or a oneDNN that refuses the CPU
        return f"the packed product failed: {type(exc).__name__}: {exc}"
    want = F.linear(x.float(), weight.float())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    error = ((got.float() - want).norm() / want.norm()).item()
    if got.shape != want.shape or not error <= tolerance:
        return f"the packed product disagrees with F.linear (relative error {error:.2g})"
    return None


class FusedAway(nn.Module):
    """Where a projection's own weight was before it joined its group's fused weight."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        raise RuntimeError("this projection is computed by its layer's fused product")


class FusedPackedLinear(nn.Module):
    """The projections of one input (q, k, v; gate, up) as one packed product, split
    after: one call instead of three, on a weight long enough to stream well
    (measured: 1.19x the separate packed products over SmolLM2's layer weights at 1
    row; 1.04-1.08x a whole decode step at batch 1 to 32).
    LoRA adapters of the parts are added to their slices of the output."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        bases = [_base(part) for part in parts]
        self.in_features = bases[0].in_features
        self.sizes = [base.out_features for base in bases]
        self.out_features = sum(self.sizes)
        self.packed = _pack(torch.cat([base.weight.data for base in bases]))
        has_bias = bases[0].bias is not None
        self.bias = (nn.Parameter(torch.cat([base.bias.data for base in bases]),
                                  requires_grad=False) if has_bias else None)
        # A plain list: the wrappers stay registered where they are (no second path to
        # their slot buffers in the module tree).
        self.loras = [part if isinstance(part, LoraLinear) else None for part in parts]

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> list[torch.Tensor]:
        return list(self.joined(x, ctx).split(self.sizes, dim=-1))  # [T, size_i] views

    def joined(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        """[T, out_features]: the parts side by side, each with its adapters' deltas."""
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if ctx is not None and ctx.lora is not None:
            start = 0
            for size, lora in zip(self.sizes, self.loras, strict=True):
                if lora is not None and lora.filled:
                    part = y[:, start : start + size]
                    part.copy_(lora.add_delta(x, part.contiguous(), ctx))
                start += size
        return y


def _base(part: nn.Module) -> nn.Module:
    return part.base if isinstance(part, LoraLinear) else part


def _fusable(parts: list[nn.Module]) -> bool:
    """Plain projections (or LoRA over plain ones) of one dtype, all with a bias or none:
    not FP8, not a tensor-parallel shard."""
    if not all(type(p) is Linear or (type(p) is LoraLinear and type(p.base) is Linear)
               for p in parts):
        return False
    bases = [_base(p) for p in parts]
    return (len({b.weight.dtype for b in bases}) == 1
            and len({b.in_features for b in bases}) == 1
            and len({b.bias is None for b in bases}) == 1)


def _fuse(parent: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    parts = [getattr(parent, name) for name in names]
    if getattr(parent, fused_name, "absent") is not None or not _fusable(parts):
        return False
    setattr(parent, fused_name, FusedPackedLinear(parts))
    for name, part in zip(names, parts, strict=True):
        if isinstance(part, LoraLinear):
            part.base = FusedAway(part.base)
        else:
            setattr(parent, name, FusedAway(part))
    return True


def pack_cpu_linears(model: nn.Module) -> tuple[int, int]:
    """Fuse each decoder layer's q/k/v and gate/up projections into one packed product
    where they allow it (`_fusable`), then swap every plain `Linear` left (inside LoRA
    and tensor-parallel wrappers too) for a `PackedLinear`. Returns (fused groups,
    packed projections). Call after every other layer swap."""
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        fused += _fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "fused_qkv")
        fused += _fuse(layer.mlp, ("gate_proj", "up_proj"), "fused_gate_up")
    packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is Linear:
                setattr(module, name, PackedLinear(child))
                packed += 1
    return fused, packed


def prepacks(config: RuntimeConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a runtime of `config` packs its CPU projections (`build_shard` does)."""
    return config.cpu_prepack and why_not_packed(device, dtype, config.compile) is None
