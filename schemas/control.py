"""Per-model settings (compute config, placement) and `sluice.control` events."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.names import AdapterName, ModelName, PoolName

DEFAULT_MAX_TTFT_MS = 60_000


class ComputeConfig(BaseModel):
    """How one replica of a model runs. All fields optional on update; these are defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_cache_len: int = Field(default=65_536, ge=16, le=1 << 30, description=(
        "Size of a replica's KV cache, in tokens (16 to 2^30); default 65536. Prompts that "
        "do not fit are refused with error context_too_long."))
    tp: int = Field(default=1, ge=1, le=64, description=(
        "Tensor parallelism: the GPUs (or ranks) one replica is split over, 1 to 64; "
        "default 1."))
    max_adapters: int = Field(default=4, ge=0, le=1024, description=(
        "LoRA adapter slots on the device, 0 to 1024; default 4. 0 disables LoRA."))
    max_lora_rank: int = Field(default=64, ge=1, le=1024, description=(
        "The largest LoRA rank a slot holds, 1 to 1024; default 64. Adapters of a higher "
        "rank are refused."))
    quantization: Literal["none", "fp8"] = Field(default="none", description=(
        "none (default), or fp8: FP8 weights."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(default="auto", description=(
        "The weights' and activations' dtype. auto (default): on CUDA the checkpoint's "
        "16-bit dtype; on CPU bfloat16 for a bfloat16 checkpoint where the CPU has native "
        "bf16 (avx512_bf16 or AMX), else float32."))
    # All-decode steps through torch.compile, built behind live serving. None: off (see
    # `worker.options.WorkerOptions.compile_for` for the measurement behind it).
    compile: bool | None = Field(default=None, description=(
        "Run all-decode steps through torch.compile, built in the background while the "
        "worker already serves eagerly. null (default): off. A worker's "
        "--compile/--no-compile or SLUICE_COMPILE overrides it."))
    # exactly_once: terminal events (and dead letters, the timeouts log) are written
    # with the consumer offsets in Kafka transactions; token events stay outside.
    delivery: Literal["at_least_once", "exactly_once"] = Field(
        default="at_least_once", description=(
            "at_least_once (default): one terminal event per attempt, so a request "
            "served again after a worker failure is answered again. exactly_once: "
            "terminal events, dead letters and timeout records are written with the "
            "request offsets in Kafka transactions, so a read_committed reader sees exactly "
            "one terminal event per request; token events stay outside the transactions."))


class Placement(BaseModel):
    """Where a model runs and how long its requests may wait for a first token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    compute_pools: list[PoolName] = Field(
        default_factory=lambda: ["default"], max_length=64, description=(
            "The compute pools whose workers serve the model (a worker's pool is "
            "SLUICE_POOL / --pool), at most 64; default [\"default\"]. Pool names: 1-64 "
            "letters, digits, '.', '_' or '-', starting with a letter or digit."))
    max_ttft_ms: int = Field(default=DEFAULT_MAX_TTFT_MS, ge=1, le=24 * 3600 * 1000, description=(
        "Most milliseconds from the broker's timestamp of a request record to its first "
        "token, 1 to 86,400,000; default 60000. A request's own max_ttft_ms may only "
        "tighten it."))


class AdapterSpec(BaseModel):
    """One LoRA adapter registered for a model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: AdapterName = Field(description=(
        "The adapter's name, as requests give it in `adapter`: 1-64 letters, digits, '-' "
        "or '_', starting with a letter or digit."))
    path: str = Field(description=(
        "The PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), as "
        "workers see it."))


class ModelDeployment(BaseModel):
    """The full desired state of one model: what a worker serves. Keyed by model on
    the compacted control topic, so the latest record per model is the truth.

    Topic `<prefix>.control` (compacted), key: the model key (UTF-8). Written by the
    control plane after every change; a removed model's key gets a tombstone (a null
    value) instead."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = Field(default=1, description="Message format version; always 1.")
    type: Literal["model"] = Field(default="model", description='Always "model".')
    model: ModelName = Field(description=(
        "The model's key (also the record's key and the <model> of its request topic): "
        "1-64 letters, digits, '-' or '_', starting with a letter or digit."))
    revision: int = Field(ge=0, description=(
        "Grows by one with every change of the model; a worker ignores a record whose "
        "revision is not newer than the one it holds."))
    path: str = Field(description=(
        "The model's Hugging Face directory (config.json, *.safetensors, optionally "
        "tokenizer.json), as workers see it."))
    compute_config: ComputeConfig = Field(default_factory=ComputeConfig, description=(
        "How each replica runs; changing it makes workers drain, reload and resume."))
    placement: Placement = Field(default_factory=Placement, description=(
        "Where the model runs and its first-token deadline; changes apply at once."))
    adapters: list[AdapterSpec] = Field(default_factory=list, description=(
        "The LoRA adapters registered for the model; default none."))
    deleted: bool = Field(default=False, description=(
        "Always false in records sluice writes: a removed model is a tombstone instead."))
