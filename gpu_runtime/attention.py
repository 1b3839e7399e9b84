"""Attention over the paged KV cache: the torch path (CPU and fallback).

KV cache of one layer: ``kv[0]`` keys, ``kv[1]`` values, each
``[num_blocks, block_size, n_kv, head_dim]``. A sequence's tokens live in the
blocks of its block table, in order::

    block_table = [7, 2, 9]          block_size = 4, 10 tokens
    token p  ->  block block_table[p // 4], offset p % 4
    slots:   7*4+0 .. 7*4+3 | 2*4+0 .. 2*4+3 | 9*4+0, 9*4+1

Decode rows (one query token per sequence) are batched into one
scaled-dot-product call over padded block tables with a key mask; a decode
query of a GQA model is laid out as ``[n_kv, group, D]`` so the group becomes
the query length and K/V are never repeated. Prefill chunks loop over
sequences (one SDPA call each, causal with an offset when earlier tokens are
already cached).

Sliding-window layers (`window` = W) let the token at position p see keys
(p - W, p] only: decodes use the step's windowed key mask, prefill chunks
gather only the keys some row of the chunk can see.

Inside a compiled decode step (`compiled.py`) the cache write and the decode
attention are opaque custom ops (`sluice::write_kv`, `sluice::decode_attention`,
`sluice::triton_decode_attention`): the compiler fuses the code around them and
the cache is written in place, never copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_runtime.context import PrefillChunk, StepContext


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter this step's keys/values into their cache slots.

    kv: [2, num_blocks, block_size, n_kv, D]; k, v: [T, n_kv, D]; slots: [T] int64
    """
    n_kv, head_dim = kv.shape[-2], kv.shape[-1]
    kv[0].view(-1, n_kv, head_dim).index_copy_(0, slots, k)
    kv[1].view(-1, n_kv, head_dim).index_copy_(0, slots, v)


def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D]; block_tables: [B, max_blocks]; mask: [B, 1, 1, S] -> [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    n_kv = kv.shape[-2]
    # One contiguous-row gather for K and V together (faster than advanced indexing on CPU).
    kv_seq = kv.index_select(1, block_tables.flatten())  # [2, B * max_blocks, bs, n_kv, D]
    kv_seq = kv_seq.view(2, batch, -1, n_kv, head_dim).transpose(2, 3)  # [2, B, n_kv, S, D]
    k, v = kv_seq[0], kv_seq[1]
    q = q.view(batch, n_kv, num_heads // n_kv, head_dim)  # [B, n_kv, group, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence's chunk. q: [n, H, D]; k_new, v_new: [n, n_kv, D] -> [n, H, D]."""
    n = q.shape[0]
    ctx_len = chunk.num_computed + n
    # Keys before `first` are outside every row's window (the chunk's first row sees
    # keys from num_computed + 1 - window on).
    first = 0 if window is None else max(0, chunk.num_computed + 1 - window)
    if chunk.num_computed == 0:
        k, v = k_new, v_new  # [n, n_kv, D]: nothing earlier to gather (first == 0)
    else:
        k = kv[0][chunk.block_table].flatten(0, 1)[first:ctx_len]  # [ctx - first, n_kv, D]
        v = kv[1][chunk.block_table].flatten(0, 1)[first:ctx_len]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, n_kv, ctx - first, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    mask = None
    if chunk.num_computed > 0 or window is not None:
        rows = torch.arange(n, device=q.device)[:, None] + chunk.num_computed  # query positions
        keys = torch.arange(first, ctx_len, device=q.device)[None, :]
        mask = keys <= rows  # [n, ctx - first]
        if window is not None:
            mask &= keys > rows - window
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)  # [n, H, D]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    ctx: StepContext,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """All rows of a step. q: [T, H, D]; k, v: [T, n_kv, D] (already written to kv).
    `window`: this layer's sliding attention window, None for full attention."""
    if ctx.use_triton:
        from gpu_runtime.triton_attention import paged_attention_triton

        return paged_attention_triton(
            q, kv[0], kv[1], ctx.block_tables, ctx.token_seq_idx, ctx.token_ctx_len, scale,
            window=window,
        )
    def decodes(q_rows: torch.Tensor) -> torch.Tensor:
        if ctx.native_attention is not None:  # the CPU kernel (cpu_attention.py)
            return ctx.native_attention(q_rows, kv, ctx.decode_block_tables, ctx.decode_lens,
                                        scale, window)
        mask = ctx.decode_mask if window is None else ctx.decode_window_mask
        return decode_attention(q_rows, kv, ctx.decode_block_tables, mask, scale)

    if not ctx.prefills:
        return decodes(q)
    out = torch.empty_like(q)
    if ctx.num_decodes:
        out[: ctx.num_decodes] = decodes(q[: ctx.num_decodes])
    for chunk in ctx.prefills:
        rows = slice(chunk.start, chunk.end)
        if ctx.native_attention is not None and ctx.native_prefill:  # keys read from the cache
            out[rows] = ctx.native_attention.prefill(q[rows], kv, chunk.block_table,
                                                     chunk.num_computed, scale, window)
        else:
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], kv, chunk, scale, window)
    return out


# ---- the same, as opaque ops of a compiled graph ------------------------------------


@torch.library.custom_op("sluice::write_kv", mutates_args=("kv",))
def _write_kv_op(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    write_kv(kv, k, v, slots)


@torch.library.custom_op("sluice::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return decode_attention(q, kv, block_tables, mask, scale)


@_decode_attention_op.register_fake
def _(q, kv, block_tables, mask, scale):
    return torch.empty_like(q)


@torch.library.custom_op("sluice::triton_decode_attention", mutates_args=())
def _triton_decode_attention_op(
    q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_idx: torch.Tensor,
    ctx_len: torch.Tensor, scale: float, window: int | None,
) -> torch.Tensor:
    from gpu_runtime.triton_attention import paged_attention_triton

    return paged_attention_triton(
        q, kv[0], kv[1], block_tables, seq_idx, ctx_len, scale, window=window
    )


@_triton_decode_attention_op.register_fake
def _(q, kv, block_tables, seq_idx, ctx_len, scale, window):
    return torch.empty_like(q)


def compiled_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    ctx: StepContext,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """`write_kv` + `paged_attention` of an all-decode step, traced as two custom ops."""
    torch.ops.sluice.write_kv(kv, k, v, ctx.slot_mapping)
    if ctx.use_triton:
        return torch.ops.sluice.triton_decode_attention(
            q, kv, ctx.block_tables, ctx.token_seq_idx, ctx.token_ctx_len, scale, window
        )
    mask = ctx.decode_mask if window is None else ctx.decode_window_mask
    return torch.ops.sluice.decode_attention(q, kv, ctx.decode_block_tables, mask, scale)
