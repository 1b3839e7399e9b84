"""Paged attention as a Triton kernel (CUDA), its launcher and a torch reference.

One program per (query row, query head): it walks the row's sequence's block
table up to the row's visible context length with an online softmax, so
prefill chunks and decodes share one launch with no padding. With a sliding
window W (a scalar per launch: one layer) a row at context length c starts at
key c - W, skipping the blocks before it. Simple rather
than fast: no split-K and one head per program; a tuned kernel replaces it
behind the same launcher signature.

Importing this module imports triton; set ``TRITON_INTERPRET=1`` before the
import to run the kernel on the CPU (tests do this in a subprocess).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_idx_ptr, ctx_len_ptr, scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(seq_idx_ptr + row)
    ctx_len = tl.load(ctx_len_ptr + row)
    # The first visible key: 0, or with a window (> 0) the first of the last `window`.
    first = tl.where(window > 0, tl.maximum(ctx_len - window, 0), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + offs_d, mask=d_mask, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.zeros([], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for b in range(first // BLOCK_SIZE, tl.cdiv(ctx_len, BLOCK_SIZE)):
        block_id = tl.load(bt_ptr + seq * stride_bt + b).to(tl.int64)
        key_pos = b * BLOCK_SIZE + offs_s
        s_mask = (key_pos < ctx_len) & (key_pos >= first)
        offs = block_id * stride_kb + offs_s[:, None] * stride_ks + kv_head * stride_kh
        kv_mask = s_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offs + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_SIZE]
        scores = tl.where(s_mask, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offs + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    o_offs = o_ptr + row * stride_ot + head * stride_oh + offs_d
    tl.store(o_offs, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq_idx: torch.Tensor,
    token_ctx_len: torch.Tensor,
    window: int | None = None,
) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys or None, got {window}")
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q must be [T, H, D], caches [N, bs, n_kv, D]; got {q.shape}, {k_cache.shape}"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"head dims or GQA group mismatch: q {q.shape}, cache {k_cache.shape}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the head dimension of q and the caches must be contiguous")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, caches {k_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be a row-contiguous [num_seqs, max_blocks] tensor")
    for name, t in (("token_seq_idx", token_seq_idx), ("token_ctx_len", token_ctx_len)):
        if t.shape != (q.shape[0],) or t.dtype != torch.int32:
            raise ValueError(
                f"{name} must be int32 [T={q.shape[0]}], got {t.dtype} {tuple(t.shape)}"
            )
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, token_seq_idx, token_ctx_len)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


def launch_constants(num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int) -> dict[str, int]:
    """The kernel's compile-time constants for a model and KV block size (also what the
    ahead-of-time compile check in the tests builds for the GPU)."""
    return {"GROUP": num_heads // num_kv_heads, "BLOCK_SIZE": block_size,
            "HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim)}


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq_idx: torch.Tensor,
    token_ctx_len: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; caches: [N, bs, n_kv, D]; block_tables: [B, max_blocks] int32;
    token_seq_idx, token_ctx_len: [T] int32 -> [T, H, D]. `window`: each row sees only
    its last `window` keys (sliding-window attention); None: all of them."""
    _check_inputs(q, k_cache, v_cache, block_tables, token_seq_idx, token_ctx_len, window)
    num_rows, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    _paged_attention_kernel[(num_rows, num_heads)](
        q, k_cache, v_cache, out, block_tables, token_seq_idx, token_ctx_len, scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        **launch_constants(num_heads, k_cache.shape[2], head_dim, k_cache.shape[1]),
    )  # fmt: skip
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq_idx: torch.Tensor,
    token_ctx_len: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Pure-torch reference with the launcher's signature (one row at a time)."""
    _check_inputs(q, k_cache, v_cache, block_tables, token_seq_idx, token_ctx_len, window)
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        ctx_len = int(token_ctx_len[row])
        first = 0 if window is None else max(0, ctx_len - window)
        table = block_tables[int(token_seq_idx[row])].long()
        k = k_cache[table].flatten(0, 1)[first:ctx_len].float()  # [visible, n_kv, D]
        v = v_cache[table].flatten(0, 1)[first:ctx_len].float()
        k = k.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,chd->hc", q[row].float(), k) * scale  # [H, ctx]
        out[row] = torch.einsum("hc,chd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
