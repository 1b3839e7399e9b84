"""Small building blocks: the swappable linear layer, RMSNorm, RoPE tables.

Every projection is a `Linear` whose `forward(x, ctx)` receives the step
context. FP8 (`gpu_runtime.fp8.FP8Linear`), LoRA (`gpu_runtime.lora`) and the
tensor-parallel column/row linears (`gpu_runtime.parallel`) are layer swaps
with this same signature.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.config import RopeConfig
from gpu_runtime.context import StepContext


class Linear(nn.Module):
    """y = x W^T (+ b). Parameter names match Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 like the reference implementation, then scale in x's dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled per `rope.rope_type`."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).float()
    if rope.rope_type != "llama3":
        return inv_freq.float()
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


def rope_cache(head_dim: int, rope: RopeConfig, max_len: int) -> torch.Tensor:
    """[max_len, 2, head_dim] float32 per position: cos repeated over both halves, and
    sin with the first half negated (the form `apply_rope` takes)."""
    inv_freq = rope_inv_freq(head_dim, rope)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + rotate_half(x) * sin. x: [T, heads, D]; cos,
    signed_sin: [T, 1, D] in x's dtype (`rope_cache`). Rolling x by half a head and
    multiplying by the signed sin is rotate_half(x) * sin exactly (negation rounds
    nothing): the reference's values bit for bit in 4 ops instead of 7."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
