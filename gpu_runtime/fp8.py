"""FP8 weights as a layer swap: `Linear` -> `FP8Linear`.

Weights are stored as float8_e4m3fn with one float32 scale per output channel
(row), `w ≈ w_fp8 * scale[:, None]`; this halves weight memory against
bf16. On CUDA devices with FP8 tensor cores (compute capability ≥ 8.9, e.g.
Hopper) the matmul runs as `torch._scaled_mm` on FP8 inputs, the activations
quantized per row on the fly; elsewhere the weight is dequantized to the
activation dtype for each matmul (correct everywhere, saves memory, not time).

Accuracy (tests/runtime/test_fp8.py): on random-weight tiny models the logits
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
    def __init__(self, linear: Linear, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        q, scale = quantize_per_channel(linear.weight.data, group)
        self.weight = nn.Parameter(q, requires_grad=False)  # [out, in] float8_e4m3fn
        self.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out] float32
        self.bias = linear.bias
        self.use_scaled_mm = (
            _has_fp8_matmul(q.device) and self.in_features % 16 == 0 and self.out_features % 16 == 0
        )

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        if self.use_scaled_mm and x.dtype == torch.bfloat16:
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


def quantize_model_fp8(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Swap every `Linear` except the LM head (often tied to the embeddings) for FP8.

    `group`: the tensor-parallel ranks; row-parallel projections then keep full scales.
    """
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is Linear and full != "lm_head":
                row_group = group if child_name in ROW_PARALLEL else None
                setattr(module, child_name, FP8Linear(child, row_group))
    return model
