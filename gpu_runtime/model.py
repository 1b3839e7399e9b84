"""The Llama-architecture decoder (Llama, Mistral, Qwen2) in plain torch.

Input is a flat, ragged batch of token rows (see `context.py`); there is no
batch or padding dimension anywhere. Module and parameter names mirror
Hugging Face's so a checkpoint loads with `load_state_dict(assign=True)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.attention import compiled_decode_attention, paged_attention, write_kv
from gpu_runtime.config import ModelConfig
from gpu_runtime.context import StepContext
from gpu_runtime.layers import Linear, RMSNorm, apply_rope, rope_cache


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.window = config.layer_window(layer_idx)  # None: full attention
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, q_size, bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.fused_qkv: nn.Module | None = None  # one product for q, k, v (cpu_linear.py)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        num_rows = x.shape[0]
        if self.fused_qkv is not None:
            # q and k lie side by side in the fused product's rows: one RoPE for both.
            qkv = self.fused_qkv.joined(x, ctx)  # [T, (H + 2 n_kv) * D]
            q_size, k_size, _ = self.fused_qkv.sizes
            qk = qkv[:, : q_size + k_size].view(num_rows, -1, self.head_dim)
            qk = apply_rope(qk, ctx.cos, ctx.sin)  # [T, H + n_kv, D]
            q, k = qk[:, : q_size // self.head_dim], qk[:, q_size // self.head_dim :]
            v = qkv[:, q_size + k_size :].view(num_rows, -1, self.head_dim)  # [T, n_kv, D]
        else:
            q = self.q_proj(x, ctx).view(num_rows, -1, self.head_dim)  # [T, H, D]
            k = self.k_proj(x, ctx).view(num_rows, -1, self.head_dim)  # [T, n_kv, D]
            v = self.v_proj(x, ctx).view(num_rows, -1, self.head_dim)  # [T, n_kv, D]
            q = apply_rope(q, ctx.cos, ctx.sin)
            k = apply_rope(k, ctx.cos, ctx.sin)
        kv = ctx.kv_caches[self.layer_idx]
        if ctx.in_graph:  # an all-decode step of the compiled graph (compiled.py)
            out = compiled_decode_attention(q, k, v, kv, ctx, self.scale, self.window)
        else:
            write_kv(kv, k, v, ctx.slot_mapping)
            out = paged_attention(q, k, v, kv, ctx, self.scale, self.window)  # [T, H, D]
        return self.o_proj(out.reshape(num_rows, -1), ctx)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(hidden, inter, bias)
        self.up_proj = Linear(hidden, inter, bias)
        self.down_proj = Linear(inter, hidden, bias)
        self.fused_gate_up: nn.Module | None = None  # one product for both (cpu_linear.py)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x, ctx)
        else:
            gate, up = self.gate_proj(x, ctx), self.up_proj(x, ctx)
        return self.down_proj(F.silu(gate) * up, ctx)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Built on `meta` and loaded with `assign=True`: an empty weight skips the random
        # init, whose meta-device path imports torch's Python references (1.6 s at start).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size), _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns hidden states; `compute_logits` the logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        # Not a parameter: built after loading, on the weights' device (see `init_rope`).
        self.rope: torch.Tensor | None = None  # [max_len, 2, head_dim] float32

    def init_rope(self, max_len: int, device: torch.device | str) -> None:
        self.rope = rope_cache(self.config.head_dim, self.config.rope, max_len).to(device)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids: [T] -> hidden states [T, hidden]."""
        if ctx.native_decoder is not None:  # the embedding, every layer and the norm in C
            return ctx.native_decoder(input_ids, ctx, self.rope)  # (cpu_decode.py)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.rope[ctx.positions].to(x.dtype)  # [T, 2, D]
        ctx.cos = cos_sin[:, 0:1]  # [T, 1, D]
        ctx.sin = cos_sin[:, 1:2]  # first half negated (rope_cache)
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden, ctx).float()
