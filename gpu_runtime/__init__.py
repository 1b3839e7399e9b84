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

Errors (`gpu_runtime.errors`) carry the wire `code`: `InvalidRequestError`
(`invalid_request`), `ContextTooLongError` (`context_too_long`),
`InsufficientMemoryError` (from the planner at load), `ModelLoadError`,
`SchedulingError` / `OutOfBlocksError` (a plan that does not fit the state).

Layer swaps: every projection is a `layers.Linear` with `forward(x, ctx)`;
`quantization="fp8"` swaps in `fp8.FP8Linear`; LoRA and tensor-parallel
linears plug in the same way, reading per-row data from the `StepContext`.
"""

from gpu_runtime.block_manager import BlockManager, block_hash
from gpu_runtime.config import ModelConfig
from gpu_runtime.errors import (
    ContextTooLongError,
    InsufficientMemoryError,
    InvalidRequestError,
    ModelLoadError,
    OutOfBlocksError,
    RequestError,
    RuntimeErrorBase,
    SchedulingError,
)
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
    "BlockManager",
    "ContextTooLongError",
    "InsufficientMemoryError",
    "InvalidRequestError",
    "MemoryPlan",
    "MemoryRequest",
    "ModelConfig",
    "ModelLoadError",
    "OutOfBlocksError",
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
]
