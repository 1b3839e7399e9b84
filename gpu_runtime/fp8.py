"""FP8 weights as a layer swap: `Linear` -> `FP8Linear`.

Weights are stored as float8_e4m3fn with one float32 scale per output channel
(row), `w ≈ w_fp8 * scale[:, None]`; this halves weight memory against
bf16. On CUDA devices with FP8 tensor cores (compute capability ≥ 8.9, e.g.
Hopper) the matmul runs as `torch._scaled_mm` on FP8 inputs, the activations
quantized per row on the fly; elsewhere the weight is dequantized to the
activation dtype for each matmul (correct everywhere, saves memory, not time).

Accuracy (tests/parity/test_fp8.py): on random-weight tiny models the logits
stay within 5% of the logits' own spread (max abs diff / std) and greedy
tokens agree ≥ 90% with the float32 model.

Under tensor parallelism the swap runs on each rank's shard: a column-parallel
shard holds whole rows, so its scales are exactly its rows' scales; a
row-parallel shard holds part of each row, so `quantize_per_channel`
all-reduces the per-row amax over the ranks (`group`) and the shard keeps the
full rows' scales — the same FP8 weights as at tp=1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpu_runtime.context import StepContext
from gpu_runtime.layers import Linear
from gpu_runtime.parallel import ROW_PARALLEL

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def quantize_per_channel(
    weight: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [out, in] -> (fp8 [out, in], float32 scale [out]).

    `group`: the ranks holding the other columns of these rows (row-parallel).
    """
    w = weight.float()
    amax = w.abs().amax(dim=1)  # [out]
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)  # the full rows' amax
    scale = amax.clamp(min=1e-12) / FP8_MAX  # [out]
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _has_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(nn.Module):
    """An FP8 projection. Built empty (on the meta device, filled by the loader as each
    weight is read) or from a full-precision `Linear` with `from_linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(  # [out, in] float8_e4m3fn
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = nn.Parameter(  # [out] float32
            torch.empty(out_features, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._use_scaled_mm: bool | None = None  # decided on first use, on the loaded device

    @classmethod
    def from_linear(cls, linear: Linear, group: dist.ProcessGroup | None = None) -> FP8Linear:
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features)
        q, scale = quantize_per_channel(linear.weight.data, group)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.bias = linear.bias
        return layer

    @property
    def use_scaled_mm(self) -> bool:
        if self._use_scaled_mm is None:
            self._use_scaled_mm = (
                _has_fp8_matmul(self.weight.device)
                and self.in_features % 16 == 0
                and self.out_features % 16 == 0
            )
        return self._use_scaled_mm

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.use_scaled_mm:
            return self._scaled_mm(x)
        w = self.weight.to(x.dtype) * self.weight_scale.to(x.dtype)[:, None]
        return F.linear(x, w, self.bias)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [N, in]
        x_scale = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # [N, 1]
        xq = (x2 / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        out = torch._scaled_mm(
            xq,
            self.weight.t(),
            scale_a=x_scale,
            scale_b=self.weight_scale[None, :],  # [1, out]
            bias=self.bias,
            out_dtype=x.dtype,
        )
        return out.reshape(*shape[:-1], self.out_features)


def _fp8_targets(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(parent, child name, full name) of every `Linear` FP8 replaces: all but the LM head
    (often tied to the embeddings)."""
    targets = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is Linear and full != "lm_head":
                targets.append((module, child_name, full))
    return targets


def quantize_model_fp8(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Swap every `Linear` but the LM head for FP8, quantizing its loaded weight.

    `group`: the tensor-parallel ranks; row-parallel projections then keep full scales.
    """
    for parent, child_name, _ in _fp8_targets(model):
        row_group = group if child_name in ROW_PARALLEL else None
        setattr(parent, child_name, FP8Linear.from_linear(getattr(parent, child_name), row_group))
    return model


def fp8_shells(model: nn.Module) -> dict[str, bool]:
    """Swap, on a meta-device model, every `Linear` FP8 replaces for an empty `FP8Linear`,
    so a loader can quantize each weight as it reads it (the full-precision model is
    never held). Returns `{weight name: row-parallel?}` of the swapped layers."""
    weights = {}
    for parent, child_name, full in _fp8_targets(model):
        child = getattr(parent, child_name)
        shell = FP8Linear(child.in_features, child.out_features, bias=child.bias is not None)
        setattr(parent, child_name, shell)
        weights[f"{full}.weight"] = child_name in ROW_PARALLEL
    return weights
