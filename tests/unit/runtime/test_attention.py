"""The Triton kernel, its torch reference and the CPU torch path agree."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.attention import decode_attention, prefill_attention
from gpu_runtime.context import PrefillChunk
from tests.runtime_support import assert_triton_check_passes
from tests.unit.runtime.triton_check import make_case


def test_triton_kernel_matches_reference_in_interpreter():
    pytest.importorskip("triton")
    assert_triton_check_passes("tests.unit.runtime.triton_check")


@pytest.mark.parametrize("window", [None, 3, 5, 16, 20])
def test_torch_paths_match_reference(window):
    """Decode (context 37), a chunk after 20 cached tokens, a fresh 7-token prefill —
    with full attention and with sliding windows inside, at and across block bounds."""
    pytest.importorskip("triton")
    from gpu_runtime.triton_attention import paged_attention_reference

    q, k_cache, v_cache, tables, seq_idx, ctx_len, scale = make_case()
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_idx, ctx_len, scale,
                                    window=window)
    if window is not None:  # the window changes the answer (so the test can fail)
        full = paged_attention_reference(q, k_cache, v_cache, tables, seq_idx, ctx_len, scale)
        assert (full - ref).abs().max() > 1e-3
    kv = torch.stack((k_cache, v_cache))  # [2, N, bs, n_kv, D]
    bt = tables.long()
    keys = torch.arange(48)[None, :]
    visible = keys < 37
    if window is not None:
        visible &= keys >= 37 - window
    dec = decode_attention(q[:1], kv, bt[:1], visible[:, None, None, :], scale)
    assert (dec - ref[:1]).abs().max() < 1e-5
    chunk = PrefillChunk(1, 6, 20, bt[1, :2])
    pre = prefill_attention(q[1:6], None, None, kv, chunk, scale, window)
    assert (pre - ref[1:6]).abs().max() < 1e-5
    fresh = bt[2, :1]
    k_new = k_cache[fresh].flatten(0, 1)[:7]
    v_new = v_cache[fresh].flatten(0, 1)[:7]
    out = prefill_attention(q[6:], k_new, v_new, kv, PrefillChunk(6, 13, 0, fresh), scale,
                            window)
    assert (out - ref[6:]).abs().max() < 1e-5


def test_launcher_rejects_bad_inputs():
    pytest.importorskip("triton")
    from gpu_runtime.triton_attention import paged_attention_triton

    q, k_cache, v_cache, tables, seq_idx, ctx_len, scale = make_case()
    with pytest.raises(ValueError, match="int32"):
        paged_attention_triton(q, k_cache, v_cache, tables.long(), seq_idx, ctx_len, scale)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention_triton(
            q.transpose(1, 2).contiguous().transpose(1, 2),
            k_cache,
            v_cache,
            tables,
            seq_idx,
            ctx_len,
            scale,
        )
    with pytest.raises(ValueError, match="shape and strides"):
        paged_attention_triton(q, k_cache, v_cache[:, :8], tables, seq_idx, ctx_len, scale)
