"""Batched multi-LoRA as a Triton kernel pair (CUDA), launchers and torch references.

Rows come in segments, runs of rows that use one adapter slot (see
`context.LoraBatch`); a prefill chunk is one segment, decodes of one adapter
are sorted next to each other and form another. One program computes a
`BLOCK_M`-row tile of one segment, so the slot's A or B tile is loaded once
per tile (the SGMV scheme of Punica / S-LoRA)::

    shrink   xa[rows, :R]  = x[rows, :K] @ A[slot]^T        A: [S, R, K]
    expand   y[rows, :N]  += xa[rows, :R] @ B[slot]         B: [S, R, N], scale folded in

Segments with slot -1 (base model) do no work: their rows of `xa` stay zero
and their rows of `y` are not touched. Importing this module imports triton;
set ``TRITON_INTERPRET=1`` first to run on the CPU (tests do, in a subprocess).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
EXPAND_BLOCK_N = 64


@triton.jit
def _segment_tile(seg_starts_ptr, seg_slots_ptr, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """The rows (grid axis 0: segment, axis 1: row tile) and ranks this program works
    on, with their masks, and the segment's adapter slot."""
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg)
    # A base-model segment (slot -1) masks out all its rows and ranks: it touches no memory.
    end = tl.where(slot >= 0, tl.load(seg_starts_ptr + seg + 1), 0)
    R = tl.where(slot >= 0, R, 0)
    slot = tl.maximum(slot, 0)
    offs_m = tl.load(seg_starts_ptr + seg) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    return slot, offs_m, m_mask, offs_r, r_mask


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr, K, R,
    stride_xt, stride_as, stride_ar, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    slot, offs_m, m_mask, offs_r, r_mask = _segment_tile(
        seg_starts_ptr, seg_slots_ptr, R, BLOCK_M, BLOCK_R
    )
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xt + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        a = tl.load(
            a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
            mask=k_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]
        acc += tl.dot(x, a, input_precision=PRECISION)
    out = out_ptr + offs_m[:, None] * stride_ot + offs_r[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    xa_ptr, b_ptr, y_ptr, seg_starts_ptr, seg_slots_ptr, N, R,
    stride_xat, stride_bs, stride_br, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    slot, offs_m, m_mask, offs_r, r_mask = _segment_tile(
        seg_starts_ptr, seg_slots_ptr, R, BLOCK_M, BLOCK_R
    )
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b = tl.load(
        b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]
    xa = tl.load(
        xa_ptr + offs_m[:, None] * stride_xat + offs_r[None, :],
        mask=m_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(b.dtype)  # [BLOCK_M, BLOCK_R]
    delta = tl.dot(xa, b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] float32
    y_offs = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_offs, mask=mask, other=0.0)
    tl.store(y_offs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _check_segments(num_rows: int, seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    if seg_starts.dtype != torch.int32 or seg_slots.dtype != torch.int32:
        raise ValueError(f"segments must be int32, got {seg_starts.dtype}, {seg_slots.dtype}")
    if seg_starts.dim() != 1 or seg_slots.dim() != 1 or len(seg_starts) != len(seg_slots) + 1:
        raise ValueError(
            f"need seg_starts [num_segs + 1] and seg_slots [num_segs], got "
            f"{tuple(seg_starts.shape)}, {tuple(seg_slots.shape)}"
        )
    if not seg_starts.is_contiguous() or not seg_slots.is_contiguous():
        raise ValueError("seg_starts and seg_slots must be contiguous")
    if len(seg_starts) and int(seg_starts[-1]) > num_rows:
        raise ValueError(f"segments end at row {int(seg_starts[-1])}, past the {num_rows} rows")


def _check_stack(name: str, rows: torch.Tensor, stack: torch.Tensor, dim: int) -> None:
    """rows: [T, D] with a unit inner stride; stack: [S, R, dim] with a unit inner stride."""
    if rows.dim() != 2 or stack.dim() != 3 or rows.shape[1] != dim:
        raise ValueError(f"{name}: shapes do not fit: {tuple(rows.shape)}, {tuple(stack.shape)}")
    if rows.stride(-1) != 1 or stack.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension of each input must be contiguous")
    if rows.device != stack.device:
        raise ValueError(f"{name}: inputs on {rows.device} and {stack.device}")


def _check_shrink(
    x: torch.Tensor, a_stack: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> None:
    _check_stack("lora_shrink", x, a_stack, a_stack.shape[2])
    _check_segments(x.shape[0], seg_starts, seg_slots)
    if x.dtype != a_stack.dtype:
        raise ValueError(f"lora_shrink: dtype mismatch {x.dtype} vs {a_stack.dtype}")


def _check_expand(
    y: torch.Tensor,
    xa: torch.Tensor,
    b_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
) -> None:
    _check_stack("lora_expand", y, b_stack, b_stack.shape[2])
    _check_segments(y.shape[0], seg_starts, seg_slots)
    if xa.shape != (y.shape[0], b_stack.shape[1]) or xa.dtype != torch.float32:
        raise ValueError(f"lora_expand: xa must be float32 [T, R], got {xa.dtype} {xa.shape}")
    if xa.stride(-1) != 1 or y.dtype != b_stack.dtype:
        raise ValueError("lora_expand: xa needs a contiguous last dim, y the dtype of b_stack")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot wants every side >= 16


def shrink_constants(rank: int, dtype: torch.dtype) -> dict[str, object]:
    """The shrink kernel's compile-time constants (also compiled ahead of time for the
    GPU by the tests)."""
    return {"BLOCK_M": BLOCK_M, "BLOCK_R": _block_r(rank), "BLOCK_K": 32,
            "PRECISION": _precision(dtype)}


def expand_constants(rank: int, dtype: torch.dtype) -> dict[str, object]:
    return {"BLOCK_M": BLOCK_M, "BLOCK_R": _block_r(rank), "BLOCK_N": EXPAND_BLOCK_N,
            "PRECISION": _precision(dtype)}


def lora_shrink_triton(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """x: [T, K]; a_stack: [S, R, K] -> float32 xa [T, R] (zero on base-model rows)."""
    _check_shrink(x, a_stack, seg_starts, seg_slots)
    rank = a_stack.shape[1]
    out = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    if len(seg_slots) == 0 or max_seg_len == 0:
        return out
    grid = (len(seg_slots), triton.cdiv(max_seg_len, BLOCK_M))
    _shrink_kernel[grid](
        x, a_stack, out, seg_starts, seg_slots, x.shape[1], rank,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), out.stride(0),
        **shrink_constants(rank, x.dtype),
    )  # fmt: skip
    return out


def lora_expand_triton(
    y: torch.Tensor,
    xa: torch.Tensor,
    b_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> None:
    """y: [T, N] += xa [T, R] float32 @ b_stack[slot] ([S, R, N]), per segment, in place."""
    _check_expand(y, xa, b_stack, seg_starts, seg_slots)
    if len(seg_slots) == 0 or max_seg_len == 0:
        return
    rank, n = b_stack.shape[1], b_stack.shape[2]
    grid = (len(seg_slots), triton.cdiv(max_seg_len, BLOCK_M), triton.cdiv(n, EXPAND_BLOCK_N))
    _expand_kernel[grid](
        xa, b_stack, y, seg_starts, seg_slots, n, rank,
        xa.stride(0), b_stack.stride(0), b_stack.stride(1), y.stride(0),
        **expand_constants(rank, b_stack.dtype),
    )  # fmt: skip


def lora_shrink_reference(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """Pure-torch reference of `lora_shrink_triton` (one segment at a time)."""
    _check_shrink(x, a_stack, seg_starts, seg_slots)
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for i, slot in enumerate(seg_slots.tolist()):
        start, end = int(seg_starts[i]), int(seg_starts[i + 1])
        if slot >= 0:
            out[start:end] = x[start:end].float() @ a_stack[slot].float().T
    return out


def lora_expand_reference(
    y: torch.Tensor,
    xa: torch.Tensor,
    b_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> None:
    """Pure-torch reference of `lora_expand_triton` (one segment at a time)."""
    _check_expand(y, xa, b_stack, seg_starts, seg_slots)
    for i, slot in enumerate(seg_slots.tolist()):
        start, end = int(seg_starts[i]), int(seg_starts[i + 1])
        if slot >= 0:
            delta = xa[start:end] @ b_stack[slot].float()
            y[start:end] = (y[start:end].float() + delta).to(y.dtype)
