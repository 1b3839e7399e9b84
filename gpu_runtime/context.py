"""Per-step inputs shared by every layer: positions, KV-cache slots, block tables.

The runner builds one `StepContext` per step and the model passes it down to
every layer — including to every linear layer, so that a layer swap which
needs per-row data (LoRA's per-row adapter slot, `LoraBatch`) gets it from the
same object instead of hidden module state.

Row order inside a step (T = total scheduled tokens, no padding)::

    rows [0, num_decodes)          one query token per decoding sequence
    rows [num_decodes, T)          prefill chunks, one contiguous run per sequence
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch


class NativeAttention(Protocol):
    """What attention needs of the CPU kernels (cpu_attention.NativeDecodeAttention;
    a protocol here so that this module imports nothing of the runtime's)."""

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor: ...

    def prefill(self, q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                num_computed: int, scale: float, window: int | None = None) -> torch.Tensor: ...


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's run of query rows that computes several tokens."""

    start: int  # first row in the step
    end: int  # one past the last row
    num_computed: int  # tokens of this sequence already in the KV cache before the step
    block_table: torch.Tensor  # [num_blocks] int64, covers num_computed + (end - start) tokens


@dataclass(slots=True)
class LoraBatch:
    """The adapter slot of every row; built only for steps where some row has an adapter.

    Runs of rows with one slot are segments (decodes are sorted by slot, a
    prefill chunk is one run)::

        row_slots   [ 2  2  0 | -1 | 1  1  1  1 ]     decodes | decode | prefill chunk
        seg_starts  [ 0     2   3    4          8 ]
        seg_slots   [ 2     0  -1    1 ]
    """

    row_slots: torch.Tensor  # [T] int32, -1 = base model
    # Torch path: only the rows with an adapter, against the contiguous slot range used.
    rows: torch.Tensor | None  # [N] int64; None when all T rows have an adapter
    slot_lo: int  # the step's slots lie in [slot_lo, slot_lo + num_slots)
    num_slots: int
    onehot: torch.Tensor | None  # [N, num_slots, 1] model dtype; None when num_slots == 1
    # Triton path (CUDA): the segments.
    seg_starts: torch.Tensor  # [num_segs + 1] int32
    seg_slots: torch.Tensor  # [num_segs] int32
    max_seg_len: int
    use_triton: bool = False


@dataclass(slots=True)
class StepContext:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat slot = block_id * block_size + offset
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, n_kv, head_dim]
    num_decodes: int
    # Decode rows, batched: padded block tables and a key mask.
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    # The same for sliding-window layers (keys within the window); None without such layers.
    decode_window_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, S] bool
    # On the CPU's native kernels (cpu_attention.NativeDecodeAttention; every CPU step
    # where they load) decode rows take lengths, not masks, and prefill chunks read
    # their keys from the cache.
    native_attention: NativeAttention | None = None
    native_prefill: bool = True  # False: prefill chunks on SDPA all the same (faster here)
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64, keys visible to each row
    # The CPU's whole-step kernel (cpu_decode.py) when this step takes it.
    native_decoder: Callable[..., None] | None = None
    # Float32 [rows, vocab] it fills with every row's logits when the step samples each.
    native_logits: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Inputs of the Triton kernel (one program per query row), built only on CUDA.
    token_seq_idx: torch.Tensor | None = None  # [T] int32, row -> sequence index
    token_ctx_len: torch.Tensor | None = None  # [T] int32, keys visible to the row (pos + 1)
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32
    use_triton: bool = False
    lora: LoraBatch | None = None  # None: no row uses an adapter, LoRA is skipped
    # Set by `CompiledStep` for the steps it traces: attention is then the graph's custom
    # ops. (Not `torch.compiler.is_compiling()`: that flag is process-wide, so an eager
    # step would see it while another thread traces.)
    in_graph: bool = False
    # Filled by the model once per step from `positions`.
    cos: torch.Tensor | None = None  # [T, 1, head_dim] (layers.rope_cache)
    sin: torch.Tensor | None = None  # [T, 1, head_dim], first half negated
