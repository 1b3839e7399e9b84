"""Run as `TRITON_INTERPRET=1 python -m tests.unit.runtime.triton_lora_check`: LoRA kernels
vs torch.

A separate process because TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import torch


def make_case(seed: int = 0, k: int = 40, n: int = 72, rank: int = 12):
    """Segments: two decodes on slot 2, a base decode, a decode on 0, a 19-row prefill on 1."""
    g = torch.Generator().manual_seed(seed)
    num_slots = 3
    seg_starts = torch.tensor([0, 2, 3, 4, 23], dtype=torch.int32)
    seg_slots = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    rows = int(seg_starts[-1])
    x = torch.randn(rows, k, generator=g)
    a_stack = torch.randn(num_slots, rank, k, generator=g)
    b_stack = torch.randn(num_slots, rank, n, generator=g)
    y = torch.randn(rows, n, generator=g)
    return x, a_stack, b_stack, y, seg_starts, seg_slots, 19


def main() -> None:
    from tests.unit.runtime.triton_check import check_device, on_device

    device = check_device()
    from gpu_runtime.triton_lora import (
        lora_expand_reference,
        lora_expand_triton,
        lora_shrink_reference,
        lora_shrink_triton,
    )

    for seed, (k, n, rank) in enumerate(((40, 72, 12), (64, 32, 16))):
        x, a, b, y, starts, slots, max_len = on_device(device, make_case(seed, k, n, rank))
        xa = lora_shrink_triton(x, a, starts, slots, max_len)
        xa_ref = lora_shrink_reference(x, a, starts, slots, max_len)
        shrink_diff = (xa - xa_ref).abs().max().item()
        y_got, y_ref = y.clone(), y.clone()
        lora_expand_triton(y_got, xa_ref, b, starts, slots, max_len)
        lora_expand_reference(y_ref, xa_ref, b, starts, slots, max_len)
        expand_diff = (y_got - y_ref).abs().max().item()
        if shrink_diff > 1e-4 or expand_diff > 1e-4:
            raise SystemExit(f"mismatch: shrink {shrink_diff}, expand {expand_diff}")
        if not torch.equal(y_got[2], y[2]):
            raise SystemExit("the base-model row was changed")
        print(f"k={k} n={n} rank={rank}: shrink {shrink_diff:.2e}, expand {expand_diff:.2e}")
    print("OK")


if __name__ == "__main__":
    main()
