"""gpu_runtime: the model, the paged KV cache and the sampler, driven by plain data.

The batcher owns ordering and admission; the runtime owns the KV blocks, the
model and sampling. There are no prefill or decode phases: each sequence has
`num_computed_tokens`, and a step plan says how many more tokens of each
sequence to compute. Prefill chunks and single-token decodes run together in
one ragged batch without padding. Prefix and session reuse are one mechanism:
chained block hashes keyed by the adapter (`None` = base model).

Usage::

    from gpu_runtime import Runtime, RuntimeConfig, SamplingParams, StepPlan

    rt = Runtime("models/tiny", RuntimeConfig(device="cpu", kv_cache_len=300_000))
    # Admission: prompt tokens already cached (no side effects) ...
    cached = rt.num_cached_tokens(prompt_ids, adapter_key=None)
    # ... then admit. Raises InvalidRequestError / ContextTooLongError (each with
    # `.code`) and nothing changes; returns the cached prompt tokens taken.
    rt.add_sequence("r-1", prompt_ids, SamplingParams(max_tokens=64, temperature=0.7, seed=1))
    while rt.sequences:
        plan = {sid: min(512, s.num_uncomputed) for sid, s in rt.sequences.items()}
        if not rt.can_schedule(plan):      # KV blocks: preempt someone, or schedule less
            ...
        out = rt.execute(StepPlan(plan))  # raises OutOfBlocksError/SchedulingError, unchanged
        for o in out.outputs:             # sequences that reached the end of their tokens
            o.token_id, o.finished, o.finish_reason, o.num_cached_prompt_tokens

API (`Runtime`):

- `add_sequence(seq_id, prompt_token_ids, params=None, adapter_key=None) -> int`
- `num_cached_tokens(token_ids, adapter_key=None) -> int` — no side effects
- `num_blocks_needed(num_scheduled_tokens) -> int`, `can_schedule(num_scheduled_tokens) -> bool`
- `execute(plan: StepPlan) -> StepOutput` — finished sequences are removed; their
  full blocks stay cached
- `remove_sequence(seq_id) -> bool` — cancel / timeout
- `preempt(seq_id)` frees the blocks (full ones stay cached), `resume(seq_id) -> int`
  re-admits it, finding its cached prefix again
- `get_sequence(seq_id) -> Sequence`, `sequences`, `tokenizer`, `memory_plan`,
  `block_manager`, `check_invariants()`

Multi-LoRA (PEFT adapters on one backbone, batched together in every step)::

    rt = Runtime("models/tiny", RuntimeConfig(max_adapters=4, max_lora_rank=64))
    info = rt.register_adapter("support-bot", "models/tiny/adapters/adapter-0")
    rt.add_sequence("r-2", prompt_ids, params, adapter_key="support-bot")

- `RuntimeConfig.max_adapters` (default 4): device slots; `0` disables LoRA (no layer
  swap). `max_lora_rank` (default 64): slot capacity, higher ranks are refused.
- `register_adapter(name, path) -> AdapterInfo` validates the PEFT directory against the
  model (raises `AdapterError`, code `invalid_request`, naming the tensor, expected and
  actual shape) and keeps its weights in host memory; any number may be registered.
  `unregister_adapter(name) -> bool` (refused while a sequence uses it).
- `rt.adapters` is the batcher's `AdapterSlots`: `resident_adapters() -> frozenset[str]`,
  `load_adapters(wanted, in_use)` swaps adapters in LRU order between steps, never
  evicting one in `in_use`. `execute` also makes a plan's adapters resident itself
  (`SchedulingError` if a plan uses more adapters than slots); `add_sequence` with an
  unregistered `adapter_key` raises `InvalidRequestError`.
- `rt.num_adapter_swaps` (loads that evicted a resident adapter),
  `rt.adapters.num_adapter_loads`.
- `gpu_runtime.lora_format.validate_adapter_dir(model_dir, adapter_dir, max_lora_rank)
  -> AdapterInfo` checks an adapter without loading anything (config.json + headers).
- KV blocks are keyed by the adapter name (`None` = base): adapters never share KV.

Tensor parallelism (one replica over `tp` GPUs, or `tp` CPU processes)::

    with Runtime("models/tiny", RuntimeConfig(tp=2, device="cuda")) as rt:  # ranks on cuda:0, :1
        ...                                 # the same API as above; the batcher sees no difference

- This process is rank 0; the constructor spawns ranks 1..tp-1 (`ranks.py`), each
  loading only its shard from safetensors, and returns when all are ready.
  `num_attention_heads % tp == 0` is required (`ModelLoadError` otherwise).
- `execute` broadcasts the step (the scheduled sequences and the adapter slots) to
  the other ranks, every rank runs its shard, rank 0 samples. `register_adapter` /
  `unregister_adapter` are broadcast too; slot loads follow rank 0's slots.
- `close()` (or leaving the `with`) stops the helper ranks and leaves the process
  group; a no-op at tp=1. Only one tensor-parallel runtime can live in a process at
  a time: close the old one before building its replacement.
- A rank that dies or hangs past `RuntimeConfig.tp_timeout_s` makes `execute` (and
  every later call that needs the ranks) raise `RankFailure`: close the runtime and
  build a new one. Helpers exit by themselves when rank 0's process dies.
- `rt.helper_pids`; `memory_plan` is per GPU (weights / tp, this rank's KV heads).
- Sharding (column/row-parallel projections, KV-head replication, vocab-parallel
  embeddings and LM head): `gpu_runtime.parallel`. GPU parity check:
  `python -m gpu_runtime.tp_check --device cuda --tp 2`.

Errors (`gpu_runtime.errors`) carry the wire `code`: `InvalidRequestError`
(`invalid_request`), `ContextTooLongError` (`context_too_long`),
`InsufficientMemoryError` (from the planner at load), `ModelLoadError`,
`SchedulingError` / `OutOfBlocksError` (a plan that does not fit the state),
`AdapterError` (`invalid_request`, a bad or mismatched adapter), `RankFailure`
(a tensor-parallel rank is gone; the replica is down).

Layer swaps: every projection is a `layers.Linear` with `forward(x, ctx)`;
`quantization="fp8"` swaps in `fp8.FP8Linear`; `lora.LoraLinear` wraps either
(the LoRA delta on top of the FP8 base), reading each row's adapter slot from
`StepContext.lora`; at tp > 1 `parallel.ColumnParallelLinear` /
`RowParallelLinear` wrap the result (the row-parallel all-reduce, in its
`forward`, sums base output and LoRA delta once).
"""

from gpu_runtime.block_manager import BlockManager, block_hash
from gpu_runtime.config import ModelConfig
from gpu_runtime.errors import (
    AdapterError,
    ContextTooLongError,
    InsufficientMemoryError,
    InvalidRequestError,
    ModelLoadError,
    OutOfBlocksError,
    RankFailure,
    RequestError,
    RuntimeErrorBase,
    SchedulingError,
)
from gpu_runtime.lora_format import AdapterInfo, validate_adapter_dir
from gpu_runtime.planner import MemoryPlan, MemoryRequest, plan_memory
from gpu_runtime.runtime import Runtime, RuntimeConfig
from gpu_runtime.sequence import (
    SamplingParams,
    SeqOutput,
    Sequence,
    SequenceStatus,
    StepOutput,
    StepPlan,
)

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "BlockManager",
    "ContextTooLongError",
    "InsufficientMemoryError",
    "InvalidRequestError",
    "MemoryPlan",
    "MemoryRequest",
    "ModelConfig",
    "ModelLoadError",
    "OutOfBlocksError",
    "RankFailure",
    "RequestError",
    "Runtime",
    "RuntimeConfig",
    "RuntimeErrorBase",
    "SamplingParams",
    "SchedulingError",
    "SeqOutput",
    "Sequence",
    "SequenceStatus",
    "StepOutput",
    "StepPlan",
    "block_hash",
    "plan_memory",
    "validate_adapter_dir",
]
