"""`apply_rope` against transformers' own rotary embedding, bit for bit."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from gpu_runtime.config import RopeConfig
from gpu_runtime.layers import apply_rope, rope_cache, rope_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    head_dim, heads, kv_heads, rows = 64, 9, 3, 17
    rope = RopeConfig(theta=100000.0)
    positions = torch.tensor([0, 1, 2, 5, 31, 100, 1023, 4000, 7, 8, 9, 10, 11, 12, 13, 14, 15])
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)

    cos_sin = rope_cache(head_dim, rope, 4096)[positions].to(dtype)
    got_q = apply_rope(q, cos_sin[:, 0:1], cos_sin[:, 1:2])
    got_k = apply_rope(k, cos_sin[:, 0:1], cos_sin[:, 1:2])

    # transformers' LlamaRotaryEmbedding: cos/sin of cat(freqs, freqs), cast to the dtype.
    freqs = torch.outer(positions.float(), rope_inv_freq(head_dim, rope))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]  # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos, sin)
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


def test_rope_of_joined_q_and_k_is_rope_of_each() -> None:
    """The fused product's q and k, roped as one block, equal each roped alone."""
    head_dim, rows = 64, 5
    cos_sin = rope_cache(head_dim, RopeConfig(theta=10000.0), 64)[torch.arange(rows)]
    qkv = torch.randn(rows, (9 + 3 + 3) * head_dim).bfloat16()
    qk = apply_rope(qkv[:, : 12 * head_dim].view(rows, -1, head_dim),
                    cos_sin[:, 0:1].bfloat16(), cos_sin[:, 1:2].bfloat16())
    q_alone = apply_rope(qkv[:, : 9 * head_dim].reshape(rows, 9, head_dim),
                         cos_sin[:, 0:1].bfloat16(), cos_sin[:, 1:2].bfloat16())
    assert torch.equal(qk[:, :9], q_alone)
