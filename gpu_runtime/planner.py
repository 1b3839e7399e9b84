"""The memory planner: do weights + KV cache + activations fit on one device?

All sizes are per device (per GPU of a tensor-parallel group of `tp`):

    weights   embeddings and LM head split over the vocabulary, every projection
              split over tp, norms replicated; FP8 stores projections at one byte
              per weight plus a float32 scale per output channel
    KV cache  2 (K and V) * layers * local kv_heads * head_dim * dtype bytes per
              token (kv_heads / tp, or 1 when tp exceeds kv_heads; odd splits
              replicate more, see `parallel.num_local_kv_heads`), for kv_cache_len
              tokens, in ceil(kv_cache_len / block_size) blocks
    reserve   activations of one step of `max_num_batched_tokens` tokens and the
              sampler's float32 logits for `max_num_seqs` rows
    LoRA      max_adapters slots of rank max_lora_rank: A and B of all seven projections

The planner never shrinks anything to fit: it raises `InsufficientMemoryError`
with the breakdown and the changes that would fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from gpu_runtime.config import ModelConfig
from gpu_runtime.errors import InsufficientMemoryError, ModelLoadError
from gpu_runtime.parallel import num_local_kv_heads

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryRequest:
    """What is asked of one device."""

    dtype: torch.dtype
    kv_cache_len: int
    block_size: int = 16
    tp: int = 1
    quantization: str = "none"  # "none" | "fp8"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_adapters: int = 0  # LoRA slots
    max_lora_rank: int = 64
    lm_head_copy: bool = False  # a tied LM head held apart too (packed on CPU: cpu_linear.py)
    decode_copy: bool = False  # the layers' projections twice (the CPU decode kernel's copy)
    weight_bytes: int | None = None  # known already (a GGUF file's, as loaded), else estimated


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    available_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_len: int
    block_size: int
    num_blocks: int
    kv_cache_bytes: int
    activation_reserve_bytes: int
    lora_slot_bytes: int = 0

    @property
    def needed_bytes(self) -> int:
        return (
            self.weight_bytes
            + self.kv_cache_bytes
            + self.activation_reserve_bytes
            + self.lora_slot_bytes
        )


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _kv_heads_per_device(config: ModelConfig, tp: int) -> int:
    return num_local_kv_heads(config, tp)


def weight_bytes_per_device(config: ModelConfig, req: MemoryRequest) -> int:
    if req.weight_bytes is not None:
        return req.weight_bytes
    if req.tp < 1 or config.num_heads % req.tp:
        raise ModelLoadError(f"tp={req.tp} does not divide num_attention_heads={config.num_heads}")
    tp, dt = req.tp, _dtype_bytes(req.dtype)
    h, d = config.hidden_size, config.head_dim
    q_out = config.num_heads * d // tp
    kv_out = _kv_heads_per_device(config, tp) * d
    inter = -(-config.intermediate_size // tp)
    proj_rows_cols = [
        (q_out, h),
        (kv_out, h),
        (kv_out, h),
        (h, q_out),
        (inter, h),
        (inter, h),
        (h, inter),
    ]
    if req.quantization == "fp8":
        per_layer = sum(r * c + 4 * r for r, c in proj_rows_cols)
    else:
        per_layer = sum(r * c for r, c in proj_rows_cols) * dt
    if config.attention_bias:
        per_layer += (q_out + 2 * kv_out) * dt
    # Row-parallel biases (o_proj, down_proj) live on rank 0 only under tp; counted
    # on every rank here (an upper bound of a few KiB).
    if config.o_proj_bias:
        per_layer += h * dt
    if config.mlp_bias:
        per_layer += (2 * inter + h) * dt
    if req.decode_copy:  # cpu_decode.py's layout, rows padded to blocks of 32
        per_layer += sum(-(-r // 32) * 32 * c for r, c in proj_rows_cols) * dt
    per_layer += 2 * h * dt  # the two RMSNorms, replicated
    vocab_shard = -(-config.vocab_size // tp) * h * dt
    heads = 1 if config.tie_word_embeddings and not req.lm_head_copy else 2
    heads += req.decode_copy  # the decode kernel's LM head (cpu_decode.py)
    return config.num_layers * per_layer + heads * vocab_shard + h * dt


def lora_slot_bytes(config: ModelConfig, req: MemoryRequest) -> int:
    """Stacked A and B of every LoRA slot, rank max_lora_rank, for all seven projections."""
    h, d, tp = config.hidden_size, config.head_dim, req.tp
    q_out = config.num_heads * d // tp
    kv_out = _kv_heads_per_device(config, tp) * d
    inter = -(-config.intermediate_size // tp)
    in_plus_out = 7 * h + 2 * q_out + 2 * kv_out + 3 * inter  # sum of in + out
    per_slot = req.max_lora_rank * in_plus_out * _dtype_bytes(req.dtype)
    return config.num_layers * req.max_adapters * per_slot


def kv_bytes_per_token(config: ModelConfig, req: MemoryRequest) -> int:
    per_layer = 2 * _kv_heads_per_device(config, req.tp) * config.head_dim
    return config.num_layers * per_layer * _dtype_bytes(req.dtype)


def activation_reserve_bytes(config: ModelConfig, req: MemoryRequest) -> int:
    dt = max(_dtype_bytes(req.dtype), 4)
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_token = (4 * config.hidden_size + 3 * config.intermediate_size // req.tp + 2 * qkv) * dt
    logits = req.max_num_seqs * config.vocab_size * 4 * 4  # logits, probs, sort, noise
    return req.max_num_batched_tokens * per_token + logits


def plan_for(config: ModelConfig, req: MemoryRequest, available_bytes: int) -> MemoryPlan:
    """The plan, whether or not it fits (see `plan_memory`)."""
    if req.kv_cache_len < 1 or req.block_size < 1:
        raise ModelLoadError(
            f"kv_cache_len and block_size must be >= 1, got {req.kv_cache_len}, {req.block_size}"
        )
    if req.quantization not in ("none", "fp8"):
        raise ModelLoadError(f"unknown quantization {req.quantization!r}; choose none or fp8")
    per_token = kv_bytes_per_token(config, req)
    num_blocks = -(-req.kv_cache_len // req.block_size)
    return MemoryPlan(
        available_bytes=available_bytes,
        weight_bytes=weight_bytes_per_device(config, req),
        kv_bytes_per_token=per_token,
        kv_cache_len=req.kv_cache_len,
        block_size=req.block_size,
        num_blocks=num_blocks,
        kv_cache_bytes=(num_blocks + 1) * req.block_size * per_token,  # + the scratch block
        activation_reserve_bytes=activation_reserve_bytes(config, req),
        lora_slot_bytes=lora_slot_bytes(config, req),
    )


def plan_memory(config: ModelConfig, req: MemoryRequest, available_bytes: int) -> MemoryPlan:
    """The plan; raises `InsufficientMemoryError` if it does not fit `available_bytes`."""
    plan = plan_for(config, req, available_bytes)
    if plan.needed_bytes > available_bytes:
        raise InsufficientMemoryError(_explain(config, req, plan))
    return plan


def _fmt(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _explain(config: ModelConfig, req: MemoryRequest, plan: MemoryPlan) -> str:
    msg = (
        f"insufficient memory: need {_fmt(plan.needed_bytes)} per device "
        f"(weights {_fmt(plan.weight_bytes)} + KV cache {_fmt(plan.kv_cache_bytes)} for "
        f"kv_cache_len={req.kv_cache_len} at {plan.kv_bytes_per_token} B/token + activation "
        f"reserve {_fmt(plan.activation_reserve_bytes)} + LoRA slots "
        f"{_fmt(plan.lora_slot_bytes)}), available {_fmt(plan.available_bytes)}."
    )
    fixes = []
    room = plan.available_bytes - plan.weight_bytes - plan.activation_reserve_bytes
    max_len = room // plan.kv_bytes_per_token // req.block_size * req.block_size if room > 0 else 0
    if max_len >= req.block_size:
        fixes.append(f"lower kv_cache_len to at most {max_len}")
    for tp in (2, 4, 8):
        if tp > req.tp and config.num_heads % tp == 0:
            tp_plan = plan_for(config, replace(req, tp=tp), plan.available_bytes)
            if tp_plan.needed_bytes <= plan.available_bytes:
                fixes.append(f"raise tp to {tp} (needs {_fmt(tp_plan.needed_bytes)} per device)")
                break
    if req.quantization == "none":
        fp8 = plan_for(config, replace(req, quantization="fp8"), plan.available_bytes)
        verdict = "fits" if fp8.needed_bytes <= plan.available_bytes else "still too much"
        fixes.append(f"use quantization=fp8 (needs {_fmt(fp8.needed_bytes)}, {verdict})")
    return msg + " To fit: " + "; or ".join(fixes) + "." if fixes else msg


def available_device_bytes(device: torch.device | str) -> int:
    """Free memory on `device`: free GPU memory, or available system RAM on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
