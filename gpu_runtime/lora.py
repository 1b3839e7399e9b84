"""Multi-LoRA as a layer swap: `Linear` (or `FP8Linear`) -> `LoraLinear`.

A `LoraLinear` wraps the base projection and holds the device slots of one
projection: stacked A and B of every slot, `A: [S, r, in]`, `B: [S, r, out]`
with the adapter's scale folded into B, where `r` is the largest rank among
resident adapters (the storage is sized for `max_lora_rank`; smaller adapters
are zero-padded). `AdapterSlots` (adapters.py) fills the slots between steps.

Per step, `ctx.lora` says which slot each row uses (`context.LoraBatch`):

- no row uses an adapter: `ctx.lora is None`, the base projection runs alone;
- CUDA: the Triton shrink/expand pair walks row segments (triton_lora.py);
- otherwise (CPU): the rows with an adapter are gathered once, multiplied by
  the A and B of the contiguous slot range the step uses, concatenated
  (`[k*r, in]`, no copy), and each row's other slots are masked out. That is
  k times the FLOPs of one adapter with no per-row or per-adapter loop; k is
  at most `max_adapters`, and a step on one adapter costs one slot.

Under tensor parallelism the base is this rank's shard and so are the slots
(A split for row-parallel, B for column-parallel projections; adapters.py
does the slicing); `parallel.RowParallelLinear` wraps the `LoraLinear`, so
one all-reduce sums base output and delta.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.context import LoraBatch, StepContext
from gpu_runtime.lora_format import PROJECTIONS


class LoraLinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.num_slots = num_slots
        size = num_slots * max_rank
        self.register_buffer(
            "a_storage", torch.zeros(size * self.in_features, dtype=dtype, device=device), False
        )
        self.register_buffer(
            "b_storage", torch.zeros(size * self.out_features, dtype=dtype, device=device), False
        )
        self.filled: set[int] = set()  # slots whose adapter adapts this projection
        self.set_rank(0)

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    def set_rank(self, rank: int) -> None:
        """Re-view the storage as `rank`-wide slots and clear them (the caller refills)."""
        s = self.num_slots
        self.a_storage.zero_()
        self.b_storage.zero_()
        self.a = self.a_storage[: s * rank * self.in_features].view(s, rank, self.in_features)
        self.b = self.b_storage[: s * rank * self.out_features].view(s, rank, self.out_features)
        self.filled.clear()

    def write_slot(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """pair: (A [r_i, in], scaled B^T [r_i, out]) in the slots' dtype, or None to clear."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.filled.discard(slot)
        if pair is not None:
            a, bt = pair
            self.a[slot, : a.shape[0]].copy_(a, non_blocking=True)
            self.b[slot, : bt.shape[0]].copy_(bt, non_blocking=True)
            self.filled.add(slot)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        return self.add_delta(x, self.base(x, ctx), ctx)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor,
                  ctx: StepContext | None) -> torch.Tensor:
        """y ([T, out], the base output, contiguous) plus each row's adapter delta, in
        place. A fused base (cpu_linear.FusedPackedLinear) computes y for several."""
        lora = ctx.lora if ctx is not None else None
        if lora is None or not self.filled:
            return y
        if lora.use_triton:
            return self._triton(x, y, lora)
        return self._torch(x, y, lora)

    def _torch(self, x: torch.Tensor, y: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        lo, k, r = lora.slot_lo, lora.num_slots, self.rank
        a = self.a[lo : lo + k].view(k * r, self.in_features)  # contiguous: no copy
        b = self.b[lo : lo + k].view(k * r, self.out_features)
        xs = x if lora.rows is None else x.index_select(0, lora.rows)  # [N, in]
        xa = F.linear(xs, a)  # [N, k*r]
        if lora.onehot is not None:  # keep each row's own slot only
            xa = (xa.view(-1, k, r) * lora.onehot).view(-1, k * r)
        if lora.rows is None:
            return y.addmm_(xa, b)
        return y.index_add_(0, lora.rows, xa @ b)

    def _triton(self, x: torch.Tensor, y: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        from gpu_runtime.triton_lora import lora_expand_triton, lora_shrink_triton

        args = (lora.seg_starts, lora.seg_slots, lora.max_seg_len)
        xa = lora_shrink_triton(x.contiguous(), self.a, *args)  # [T, r] float32
        lora_expand_triton(y, xa, self.b, *args)
        return y


def apply_lora(
    model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype
) -> dict[tuple[int, str], LoraLinear]:
    """Wrap the seven projections of every decoder layer; returns them by (layer, name)."""
    swapped: dict[tuple[int, str], LoraLinear] = {}
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name in PROJECTIONS:
                    device = next(child.parameters()).device
                    lora = LoraLinear(child, num_slots, max_rank, dtype, device)
                    setattr(parent, name, lora)
                    swapped[(i, name)] = lora
    return swapped
