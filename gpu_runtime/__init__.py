"""gpu_runtime: the model, the paged KV cache and the sampler, driven by plain data.

The batcher owns ordering and admission; the runtime owns the KV blocks, the
model and sampling. There are no prefill or decode phases: each sequence has
`num_computed_tokens`, and a step plan says how many more tokens of each
sequence to compute; prefill chunks and decodes run together in one ragged
batch. Prefix and session reuse are one mechanism: chained block hashes keyed
by the adapter (`None` = the base model).

    rt = Runtime("models/tiny", RuntimeConfig(kv_cache_len=300_000, max_adapters=4))
    rt.add_sequence("r-1", prompt_ids, SamplingParams(max_tokens=64))  # -> cached tokens
    out = rt.execute(StepPlan({"r-1": 512}))                           # -> sampled tokens

A map of the room (each module says the rest):

- `runtime.py`: `Runtime` — admit, step (`execute`), preempt/resume, adapters;
  check-then-act.
- `sequences.py`: `SequenceTable` — sequences and their KV blocks, no model (the
  batcher's fake runtime reuses it); `block_manager.py`: blocks, free list,
  chained hashes, LRU eviction of cached blocks.
- `sequence.py`: the plain data in and out (`SamplingParams`, `Sequence`,
  `StepPlan`, `StepOutput`).
- `model.py`, `layers.py`, `attention.py`, `runner.py`: the model in plain
  torch, one ragged step; `triton_attention.py`: the paged-attention kernel;
  `compiled.py`: all-decode steps through `torch.compile`, eager fallback.
- `lora.py`, `lora_format.py`, `adapters.py`, `triton_lora.py`: multi-LoRA (PEFT
  format, device slots, kernels); `fp8.py`: FP8 weights, quantized as they load.
- `parallel.py`, `ranks.py`: tensor parallelism (parallel layers with the
  all-reduce in `forward`, rank processes).
- `config.py`, `loader.py`, `planner.py`: model and runtime config, safetensors
  loading, the memory plan; `sampling.py`, `stops.py`: the batched sampler and
  when a sequence is done.
- `tiny.py`: a small random-weight Llama (and adapters); `errors.py`: errors
  carrying the wire `code`.
"""

from gpu_runtime.block_manager import BlockManager, block_hash
from gpu_runtime.config import ModelConfig, RuntimeConfig, SamplingDefaults
from gpu_runtime.errors import (
    AdapterError,
    ContextTooLongError,
    InsufficientMemoryError,
    InvalidSequenceError,
    ModelLoadError,
    OutOfBlocksError,
    RankFailure,
    RuntimeErrorBase,
    SchedulingError,
    SequenceError,
)
from gpu_runtime.lora_format import AdapterInfo, validate_adapter_dir
from gpu_runtime.planner import MemoryPlan, MemoryRequest, plan_memory
from gpu_runtime.runtime import Runtime
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
    "InvalidSequenceError",
    "MemoryPlan",
    "MemoryRequest",
    "ModelConfig",
    "ModelLoadError",
    "OutOfBlocksError",
    "RankFailure",
    "Runtime",
    "RuntimeConfig",
    "RuntimeErrorBase",
    "SamplingDefaults",
    "SamplingParams",
    "SchedulingError",
    "SeqOutput",
    "Sequence",
    "SequenceError",
    "SequenceStatus",
    "StepOutput",
    "StepPlan",
    "block_hash",
    "plan_memory",
    "validate_adapter_dir",
]
