"""How a worker is told what to do, and the plain values it hands its rooms.

`WorkerOptions` come from `sluice worker`'s flags; the settings (the
environment) are turned here into the plain option objects ingest and results
take, and a deployment's compute config into the runtime's.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import Settings
from common.topics import internal_topic_names
from gpu_runtime import RuntimeConfig
from ingest.verdicts import IngestOptions
from results.writer import ResultsOptions
from schemas import ModelDeployment


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    model: str
    device: str = "cpu"
    tp: int | None = None  # None: the model's compute config decides
    # None: the lowest index no live worker of this host and pool holds (`worker.identity`).
    replica: int | None = None
    instance_id: str | None = None
    max_num_batched_tokens: int = 512
    memory_budget_bytes: int | None = None
    adapter_slots: int | None = None  # None: the compute config's max_adapters
    wait_for_model_s: float = 600.0
    compile: bool | None = None  # None: SLUICE_COMPILE, else the compute config, else auto
    # The process is this worker's own (`sluice worker`): its heap is frozen once the model
    # is loaded (`common.heap`). Off for a worker inside another program (tests, benches).
    freeze_heap: bool = False

    def adapter_slots_for(self, dep: ModelDeployment) -> int:
        if self.adapter_slots is not None:
            return self.adapter_slots
        return dep.compute_config.max_adapters

    def tp_for(self, dep: ModelDeployment) -> int:
        return self.tp or dep.compute_config.tp

    def device_for(self, dep: ModelDeployment) -> str:
        """Replica k of a GPU host uses GPUs k*tp .. k*tp + tp - 1."""
        if self.device == "cuda":
            return f"cuda:{(self.replica or 0) * self.tp_for(dep)}"
        return self.device

    def compile_for(self, dep: ModelDeployment, host_default: bool | None = None) -> bool:
        """`--compile/--no-compile`, else the host's SLUICE_COMPILE, else the compute
        config, else off: measured on 2 CPU cores (SmolLM2-135M), the compiled step is
        0.91-1.07x eager's speed at batch 1, 8 and 32, while building it takes 19 s (warm
        inductor cache) to 133 s (cold) beside live serving, whose steps it slows (the
        compiler holds the GIL: single steps stalled up to 9 s). A compiled CPU runtime
        also keeps its projections on `F.linear`, not on the prepacked weights that make
        eager steps 1.4-1.9x faster (gpu_runtime/cpu_linear.py). Not measured on CUDA."""
        for choice in (self.compile, host_default, dep.compute_config.compile):
            if choice is not None:
                return choice
        return False

    def runtime_config(
        self, dep: ModelDeployment, host_compile: bool | None = None
    ) -> RuntimeConfig:
        cc = dep.compute_config
        return RuntimeConfig(
            device=self.device_for(dep), dtype=None if cc.dtype == "auto" else cc.dtype,
            kv_cache_len=cc.kv_cache_len, quantization=cc.quantization,
            memory_budget_bytes=self.memory_budget_bytes,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_adapters=self.adapter_slots_for(dep), max_lora_rank=cc.max_lora_rank,
            tp=self.tp_for(dep), compile=self.compile_for(dep, host_compile),
        )


def ingest_options(settings: Settings, model: str, instance_id: str) -> IngestOptions:
    return IngestOptions(
        model=model, request_topic=settings.requests_topic(model),
        group_id=settings.topic(model), instance_id=instance_id,
        default_reply_topic=settings.topic("results"),
        internal_topics=frozenset(internal_topic_names(settings)),
        internal_prefixes=(settings.topic("requests."),),
        reply_topic_pattern=settings.reply_topic_pattern,
        kafka_options=settings.kafka_options(),
    )


def results_options(settings: Settings, model: str) -> ResultsOptions:
    return ResultsOptions(
        model=model, timeouts_topic=settings.topic("timeouts"),
        deadletter_topic=settings.topic("deadletter"),
        producer_options=settings.producer_options(),
        request_timeout_s=settings.client.timeout_secs,
    )
