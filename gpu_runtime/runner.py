"""The model runner: owns the model and the KV cache, turns scheduled work into tensors.

It knows nothing of requests or sampling; `Runtime` hands it, per sequence,
the tokens to compute and the block table, and gets back hidden states of the
rows to sample.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_runtime.compiled import CompiledStep
from gpu_runtime.context import LoraBatch, PrefillChunk, StepContext
from gpu_runtime.cpu_decode import NativeDecoder
from gpu_runtime.host_memory import zeroed
from gpu_runtime.model import CausalLM


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work this step."""

    token_ids: list[int]  # the tokens to compute
    num_computed: int  # tokens already in the cache before this step
    block_table: list[int]
    lora_slot: int = -1  # adapter slot of every row of this sequence; -1 = base model


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class ModelRunner:
    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, max_model_len: int,
        compile: bool = False, native_attention: Callable[..., torch.Tensor] | None = None,
        native_decoder: NativeDecoder | None = None, native_prefill: bool = True,
    ) -> None:
        config = model.config
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.dtype = model.model.norm.weight.dtype  # (a quantized embedding has no weight)
        self.block_size = block_size
        self.sliding_window = config.sliding_window
        self.use_triton = self.device.type == "cuda" and _triton_available()
        self.native_attention = native_attention  # the CPU's attention kernels (cpu_attention.py)
        self.native_prefill = native_prefill  # ... for prefill chunks too (else SDPA)
        self.max_model_len = max_model_len
        model.init_rope(max_model_len, self.device)
        # One block more than the block manager hands out: the scratch block that
        # `warm_up` writes into, so compiling never touches a sequence's cache.
        self.scratch_block = num_blocks
        shape = (2, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [zeroed(shape, self.dtype, self.device) for _ in range(config.num_layers)]
        self.native_decoder = native_decoder  # all layers of small decode steps (cpu_decode.py)
        if native_decoder is not None:
            native_decoder.bind(self.kv_caches, block_size)
        self.compiled = CompiledStep(model.forward) if compile else None
        self.step = self.compiled or model.forward
        self.last_inputs_s = 0.0

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def build_context(
        self, seqs: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, StepContext, list[int]]:
        """Decodes (one token) must come first in `seqs`.

        Returns input ids [T], the context, and the row of each sequence's last token.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        dev = self.device
        for s in seqs:
            n, start = len(s.token_ids), s.num_computed
            row = len(input_ids)
            input_ids.extend(s.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(self._slots(s.block_table, start, start + n))
            last_rows.append(row + n - 1)
            if n == 1 and not prefills:
                decode_tables.append(s.block_table)
                decode_lens.append(start + 1)
            else:
                table = torch.tensor(s.block_table, dtype=torch.int64, device=dev)
                prefills.append(PrefillChunk(row, row + n, start, table))
        ctx = StepContext(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            kv_caches=self.kv_caches,
            num_decodes=len(decode_tables),
            prefills=prefills,
            use_triton=self.use_triton,
            native_attention=self.native_attention,
            native_prefill=self.native_prefill,
        )
        if decode_tables:
            self._add_decode_inputs(ctx, decode_tables, decode_lens)
        if self.use_triton:
            self._add_triton_inputs(ctx, seqs)
        ctx.lora = self._lora_batch(seqs, len(input_ids))
        if (self.native_decoder is not None and not prefills and ctx.lora is None
                and len(input_ids) <= self.native_decoder.max_rows):
            ctx.native_decoder = self.native_decoder
        return torch.tensor(input_ids, dtype=torch.int64, device=dev), ctx, last_rows

    def _add_decode_inputs(
        self, ctx: StepContext, tables: list[list[int]], lens: list[int]
    ) -> None:
        # Compiled steps see at least two columns: dynamo would compile a graph of its
        # own for one-column tables (it specialises size 1), doubling the warm-up.
        max_blocks = max(2 if self.compiled else 1, *(len(t) for t in tables))
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        ctx.decode_block_tables = torch.tensor(padded, dtype=torch.int64, device=self.device)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=self.device)
        if self.native_attention is not None:  # it reads lengths and windows, not masks
            ctx.decode_lens = lens_t
            return
        keys = torch.arange(max_blocks * self.block_size, device=self.device)
        visible = keys[None, :] < lens_t[:, None]  # [B, S]
        ctx.decode_mask = visible[:, None, None, :]  # [B, 1, 1, S]
        if self.sliding_window is not None:  # the query at position len - 1 sees W keys
            recent = keys[None, :] >= lens_t[:, None] - self.sliding_window
            ctx.decode_window_mask = (visible & recent)[:, None, None, :]

    def _add_triton_inputs(self, ctx: StepContext, seqs: list[ScheduledSeq]) -> None:
        max_blocks = max(len(s.block_table) for s in seqs)
        padded = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        seq_idx = [i for i, s in enumerate(seqs) for _ in s.token_ids]
        dev = self.device
        ctx.block_tables = torch.tensor(padded, dtype=torch.int32, device=dev)
        ctx.token_seq_idx = torch.tensor(seq_idx, dtype=torch.int32, device=dev)
        ctx.token_ctx_len = (ctx.positions + 1).to(torch.int32)

    def _lora_batch(self, seqs: list[ScheduledSeq], num_rows: int) -> LoraBatch | None:
        """Row slots and segments (runs of one slot); None when no row uses an adapter."""
        used = sorted({s.lora_slot for s in seqs if s.lora_slot >= 0})
        if not used:
            return None
        dev = self.device
        starts, seg_slots, row_slots, rows = [0], [], [], []
        for s in seqs:
            n, row = len(s.token_ids), len(row_slots)
            row_slots.extend([s.lora_slot] * n)
            if s.lora_slot >= 0:
                rows.extend(range(row, row + n))
            if seg_slots and seg_slots[-1] == s.lora_slot:
                starts[-1] += n
            else:
                seg_slots.append(s.lora_slot)
                starts.append(row + n)
        lo, k = used[0], used[-1] + 1 - used[0]
        row_slots_t = torch.tensor(row_slots, dtype=torch.int32, device=dev)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev) if len(rows) < num_rows else None
        onehot = None
        if k > 1 and not self.use_triton:
            own = row_slots_t if rows_t is None else row_slots_t[rows_t]  # [N]
            onehot = F.one_hot(own.long() - lo, k).to(self.dtype)[:, :, None]  # [N, k, 1]
        return LoraBatch(
            row_slots=row_slots_t,
            rows=rows_t,
            slot_lo=lo,
            num_slots=k,
            onehot=onehot,
            seg_starts=torch.tensor(starts, dtype=torch.int32, device=dev),
            seg_slots=torch.tensor(seg_slots, dtype=torch.int32, device=dev),
            max_seg_len=max(b - a for a, b in itertools.pairwise(starts)),
            use_triton=self.use_triton,
        )

    @torch.inference_mode()
    def forward(self, seqs: list[ScheduledSeq], rows_to_sample: list[int]) -> torch.Tensor:
        """Compute `seqs`; return float32 logits [len(rows_to_sample), vocab].

        `rows_to_sample` indexes `seqs`; those sequences' last rows are projected.
        Under tensor parallelism only rank 0 gets the full vocabulary (see
        `parallel.VocabParallelLMHead`); the other ranks' return value is unused.
        """
        started = time.perf_counter()
        input_ids, ctx, last_rows = self.build_context(seqs)
        if ctx.native_decoder is not None and len(rows_to_sample) == len(seqs):
            # every row a decode, each sampled: the kernel's call ends with the LM head
            ctx.native_logits = torch.empty(
                (len(seqs), self.native_decoder.lm_head.out_features), dtype=torch.float32)
        self.last_inputs_s = time.perf_counter() - started  # read by the step clock
        hidden = self.step(input_ids, ctx)  # [T, hidden]
        if ctx.native_logits is not None:
            return ctx.native_logits
        if not rows_to_sample:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        index = torch.tensor([last_rows[i] for i in rows_to_sample], device=self.device)
        if self.native_decoder is not None and len(rows_to_sample) <= self.native_decoder.max_rows:
            return self.native_decoder.logits(hidden[index])
        return self.model.compute_logits(hidden[index], ctx)

    @torch.inference_mode()
    def warm_up(self) -> bool:
        """Compile both decode graphs (batch 1, and more: dynamo specialises size 1) on
        all-decode steps over the scratch block; then live steps take them. False when
        there is nothing to compile or compiling failed (`compiled.failure`)."""
        if self.compiled is None:
            return False
        # Three blocks for two rows: equal sizes would be tied in the graph (duck sizing).
        seq = ScheduledSeq([0], 0, [self.scratch_block] * 3)
        steps = []
        for seqs in ([seq], [seq, seq]):
            input_ids, ctx, _ = self.build_context(seqs)
            steps.append((input_ids, ctx))
        return self.compiled.warm(steps)
