"""Per-model settings (compute config, placement) and `sluice.control` events."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.names import AdapterName, ModelName, PoolName

DEFAULT_MAX_TTFT_MS = 60_000


class ComputeConfig(BaseModel):
    """How one replica of a model runs. All fields optional on update; these are defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_cache_len: int = Field(default=65_536, ge=16, le=1 << 30)
    tp: int = Field(default=1, ge=1, le=64)
    max_adapters: int = Field(default=4, ge=0, le=1024)
    max_lora_rank: int = Field(default=64, ge=1, le=1024)
    quantization: Literal["none", "fp8"] = "none"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # All-decode steps through torch.compile. None (auto): on for CPU workers, where it
    # is measured to win; off on CUDA until `benchmarks/gpu.sh` has measured it there.
    compile: bool | None = None
    # exactly_once: terminal events (and dead letters, the timeouts log) are written
    # with the consumer offsets in Kafka transactions; token events stay outside.
    delivery: Literal["at_least_once", "exactly_once"] = "at_least_once"


class Placement(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    compute_pools: list[PoolName] = Field(default_factory=lambda: ["default"], max_length=64)
    max_ttft_ms: int = Field(default=DEFAULT_MAX_TTFT_MS, ge=1, le=24 * 3600 * 1000)


class AdapterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: AdapterName
    path: str


class ModelDeployment(BaseModel):
    """The full desired state of one model: what a worker serves. Keyed by model on
    the compacted control topic, so the latest record per model is the truth."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    type: Literal["model"] = "model"
    model: ModelName
    revision: int = Field(ge=0)
    path: str
    compute_config: ComputeConfig = Field(default_factory=ComputeConfig)
    placement: Placement = Field(default_factory=Placement)
    adapters: list[AdapterSpec] = Field(default_factory=list)
    deleted: bool = False
