"""Tensor parallelism: which shard each rank holds, and the parallel layers.

`tp` ranks hold one model replica between them (Megatron-style, on
torch.distributed; the process model is in `ranks.py`). Per decoder layer:

    q/k/v, gate/up   ColumnParallelLinear: each rank computes its own output
                     features (its query heads, its KV heads, its slice of the
                     MLP's intermediate features); no communication
    o, down          RowParallelLinear: each rank multiplies its slice of the
                     input features; `forward` all-reduces the partial sums
    norms            replicated (every rank holds the full hidden state)

So a layer costs two all-reduces of [T, hidden]. Bias of a row-parallel
layer: rank 0 loads it, the other ranks hold zeros, so the all-reduce adds it
once.

KV heads (GQA). Query heads are split evenly (`num_heads % tp == 0`, the
planner checks it); rank r holds query heads [r*H/tp, (r+1)*H/tp). A rank holds
the KV heads its query heads read. Attention needs every local KV head to
serve the same number of local query heads, so the local group size is
`g' = gcd(H/K, H/tp)` and the rank holds `(H/tp) / g'` KV heads, local KV head
j being global head `(first_q + j*g') // (H/K)`. When tp divides K that is
the plain split (K/tp heads each); when K divides tp each KV head is
replicated on tp/K ranks. Only odd cases replicate more, e.g. H=6, K=3, tp=2::

    query heads   rank 0: 0 1 2        rank 1: 3 4 5
    KV head used          0 0 1                1 2 2
    rank holds    KV heads [0, 0, 1]   KV heads [1, 2, 2]    (g' = gcd(2, 3) = 1)

(3 local KV heads where ceil(3/2) = 2 would do with per-head indexing; the
uniform group keeps the attention code, both paths, unchanged.)

Vocabulary: embeddings and LM head are vocab-parallel, rank r holding token
rows [r*V//tp, (r+1)*V//tp) — a balanced split, so an odd V just gives shards
one row apart. The embedding masks foreign ids and all-reduces; the LM head
computes its shard's logits, pads them to ceil(V/tp) columns and gathers them
to rank 0, which alone samples. Vocab-parallel, not replicated: at Llama-3
sizes the two [128256, 4096] matrices are 2 GiB of bf16 per GPU if replicated
(the planner counts them split), against one all-reduce of [T, hidden] and one
gather of [N, V/tp] logits per step, next to the 2 * num_layers all-reduces
the layers already do.

Weights are read shard by shard (`Shard.read` on a safetensors `get_slice`),
so no rank ever materialises a full tensor. LoRA follows its base layer (see
`ShardLayout.lora_shards`); FP8 row-parallel layers all-reduce the per-row
amax so their scales are the full rows' scales (see fp8.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpu_runtime.config import ModelConfig
from gpu_runtime.context import StepContext
from gpu_runtime.errors import ModelLoadError

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def split(n: int, tp: int, rank: int) -> range:
    """The balanced contiguous share of rank `rank` of n items (shares differ by at most 1)."""
    return range(rank * n // tp, (rank + 1) * n // tp)


def check_tp(config: ModelConfig, tp: int) -> None:
    if tp < 1 or config.num_heads % tp:
        raise ModelLoadError(f"tp={tp} does not divide num_attention_heads={config.num_heads}")
    if tp > 1 and config.num_heads % config.num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads={config.num_heads} is not a multiple of "
            f"num_key_value_heads={config.num_kv_heads}"
        )


def local_kv_group(config: ModelConfig, tp: int) -> int:
    """g': query heads per local KV head on every rank."""
    return math.gcd(config.num_heads // config.num_kv_heads, config.num_heads // tp)


def num_local_kv_heads(config: ModelConfig, tp: int) -> int:
    check_tp(config, tp)
    if tp == 1:
        return config.num_kv_heads
    return config.num_heads // tp // local_kv_group(config, tp)


@dataclass(frozen=True, slots=True)
class Shard:
    """The positions along `dim` of a full tensor that one rank holds, in order."""

    dim: int
    index: range | tuple[int, ...]  # a range when contiguous; repeats when KV heads replicate

    def _bounds(self) -> tuple[int, int]:
        return min(self.index), max(self.index) + 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The shard of a full in-memory tensor (adapters)."""
        lo, hi = self._bounds()
        return self._reindex(full.narrow(self.dim, lo, hi - lo), lo)

    def read(self, sl: object, ndim: int) -> torch.Tensor:
        """The shard read from a safetensors `get_slice` object: only its rows/columns."""
        lo, hi = self._bounds()
        part = sl[lo:hi] if self.dim == 0 else sl[(slice(None),) * (ndim - 1) + (slice(lo, hi),)]
        return self._reindex(part, lo)

    def _reindex(self, part: torch.Tensor, lo: int) -> torch.Tensor:
        if isinstance(self.index, range):
            return part.contiguous()
        index = torch.tensor(self.index, dtype=torch.int64, device=part.device) - lo
        return part.index_select(self.dim, index)


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What rank `rank` of a `tp`-way replica holds of every tensor."""

    config: ModelConfig
    tp: int
    rank: int

    def __post_init__(self) -> None:
        check_tp(self.config, self.tp)

    @property
    def q_heads(self) -> range:
        return split(self.config.num_heads, self.tp, self.rank)

    @property
    def kv_heads(self) -> tuple[int, ...]:
        """The global KV head of each local KV head (repeats when replicated)."""
        c, g_local = self.config, local_kv_group(self.config, self.tp)
        group = c.num_heads // c.num_kv_heads
        first = self.q_heads.start
        n = num_local_kv_heads(c, self.tp)
        return tuple((first + j * g_local) // group for j in range(n))

    @property
    def intermediate(self) -> range:
        return split(self.config.intermediate_size, self.tp, self.rank)

    def vocab(self, rank: int | None = None) -> range:
        return split(self.config.vocab_size, self.tp, self.rank if rank is None else rank)

    def local_config(self) -> ModelConfig:
        """The config whose `CausalLM` has this rank's projection shapes (vocab stays full)."""
        return replace(
            self.config,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
        )

    def projection_shard(self, proj: str) -> Shard:
        """Shard of a projection's weight [out, in]: dim 0 column-, dim 1 row-parallel."""
        d = self.config.head_dim
        q = range(self.q_heads.start * d, self.q_heads.stop * d)
        kv_heads = self.kv_heads
        kv: range | tuple[int, ...] = tuple(h * d + i for h in kv_heads for i in range(d))
        if kv_heads == tuple(range(kv_heads[0], kv_heads[-1] + 1)):
            kv = range(kv_heads[0] * d, (kv_heads[-1] + 1) * d)
        index = {
            "q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q,
            "gate_proj": self.intermediate, "up_proj": self.intermediate,
            "down_proj": self.intermediate,
        }[proj]  # fmt: skip
        return Shard(1 if proj in ROW_PARALLEL else 0, index)

    def tensor_shard(self, name: str) -> Shard | None:
        """How to read checkpoint tensor `name`: a Shard, or None for the full tensor."""
        if name in VOCAB_PARALLEL:
            return Shard(0, self.vocab())
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in COLUMN_PARALLEL + ROW_PARALLEL:
            return None  # norms: replicated
        shard = self.projection_shard(parts[-2])
        if parts[-1] == "bias":
            return Shard(0, shard.index) if shard.dim == 0 else None
        return shard

    def zero_on_this_rank(self, name: str) -> bool:
        """Row-parallel biases live on rank 0 only: the all-reduce adds them once."""
        parts = name.split(".")
        return self.rank > 0 and parts[-1] == "bias" and parts[-2] in ROW_PARALLEL

    def lora_shards(self, proj: str) -> tuple[Shard | None, Shard | None]:
        """(shard of A [r, in], shard of scaled B^T [r, out]), consistent with the base layer.

        Column-parallel: B's output features are split, A is whole. Row-parallel:
        A's input features are split, B is whole, and the delta is a partial sum
        that the layer's one all-reduce adds together with the base output.
        """
        shard = Shard(1, self.projection_shard(proj).index)
        return (shard, None) if proj in ROW_PARALLEL else (None, shard)


class VocabParallelEmbedding(nn.Module):
    """Token rows [lo, hi) of the embedding; the all-reduce assembles every row."""

    def __init__(self, vocab: range, hidden_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.lo, self.hi = vocab.start, vocab.stop
        self.group = group
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.lo) & (input_ids < self.hi)  # [T]
        x = F.embedding((input_ids - self.lo) * mine, self.weight)  # [T, hidden]
        x = x.masked_fill_(~mine[:, None], 0)
        dist.all_reduce(x, group=self.group)  # [T, hidden]: each row from its owner rank
        return x


class VocabParallelLMHead(nn.Module):
    """Logits of token columns [lo, hi); gathered to rank 0, which samples."""

    def __init__(self, layout: ShardLayout, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.vocab_size = layout.config.vocab_size
        self.tp, self.rank, self.group = layout.tp, layout.rank, group
        self.shard_sizes = [len(layout.vocab(r)) for r in range(layout.tp)]
        shape = (self.shard_sizes[layout.rank], layout.config.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        """x: [N, hidden] -> [N, vocab] on rank 0; this rank's [N, ceil(V/tp)] elsewhere."""
        width = max(self.shard_sizes)
        local = F.linear(x, self.weight)  # [N, V_r]
        local = F.pad(local, (0, width - local.shape[1]))  # [N, width]: gather wants equal sizes
        parts = [torch.empty_like(local) for _ in range(self.tp)] if self.rank == 0 else None
        dist.gather(local, parts, group_dst=0, group=self.group)
        if parts is None:
            return local
        return torch.cat([p[:, :n] for p, n in zip(parts, self.shard_sizes, strict=True)], dim=1)


class ColumnParallelLinear(nn.Module):
    """This rank's output features of a projection: no communication."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner  # Linear / FP8Linear / LoraLinear holding the output shard
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        return self.inner(x, ctx)  # [T, out / tp]


class RowParallelLinear(nn.Module):
    """This rank's input features of a projection; the all-reduce sums the ranks' parts."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner = inner  # Linear / FP8Linear / LoraLinear holding the input shard
        self.group = group
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        y = self.inner(x, ctx)  # [T, out]: partial sum, base output + LoRA delta of this shard
        dist.all_reduce(y, group=self.group)  # [T, out]: one all-reduce for both
        return y


def use_vocab_parallel(model: nn.Module, layout: ShardLayout, group: dist.ProcessGroup) -> None:
    """Swap embeddings and LM head (on the meta device, before loading)."""
    hidden = layout.config.hidden_size
    model.model.embed_tokens = VocabParallelEmbedding(layout.vocab(), hidden, group)
    model.lm_head = VocabParallelLMHead(layout, group)


def wrap_parallel_linears(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Wrap the seven projections of every layer, after the FP8 and LoRA swaps."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name in COLUMN_PARALLEL:
                    setattr(parent, name, ColumnParallelLinear(child))
                elif name in ROW_PARALLEL:
                    setattr(parent, name, RowParallelLinear(child, group))
