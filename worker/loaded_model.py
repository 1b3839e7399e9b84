"""The model a worker serves now: its runtime, its engine (batcher + runtime) and the
adapters loaded into it, built from one deployment snapshot.

Loading runs on a thread of its own that ends with the load (common/threads.py:
why not `to_thread`); a compute-config change drains, closes and loads again
(only one tensor-parallel runtime may exist per process). With `compile` on, the
compiled decode step is built behind live serving at tp = 1 and swapped in
between steps; at tp > 1 every rank compiles in step, so it is built first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from batcher.config import BatcherConfig
from batcher.engine import Engine, StepStats
from common.heap import freeze_heap
from common.threads import in_own_thread
from gpu_runtime import RankFailure, Runtime, RuntimeConfig
from schemas import ModelDeployment
from worker.metrics import WorkerMetrics
from worker.options import WorkerOptions
from worker.served_adapters import ServedAdapters
from worker.supervision import in_background_thread

log = logging.getLogger(__name__)

RuntimeFactory = Callable[[str, RuntimeConfig], Runtime]


class LoadedModel:
    def __init__(self, options: WorkerOptions, host_compile: bool | None,
                 runtime_factory: RuntimeFactory, metrics: WorkerMetrics,
                 on_status: Callable[[], None],
                 on_step: Callable[[StepStats], None] | None = None):
        self._options = options
        self._host_compile = host_compile  # SLUICE_COMPILE
        # A seam for fault-injection tests: they wrap the runtime's `execute`.
        self._runtime_factory = runtime_factory
        self._metrics = metrics
        self._on_status = on_status
        self._traced_step = on_step  # traces: the requests each step carried
        self.runtime: Runtime | None = None
        self.engine: Engine | None = None
        self.adapters = ServedAdapters(options.model)
        self.compiling = False  # the compiled step is being built behind live serving

    @property
    def model(self) -> str:
        return self._options.model

    def runtime_config(self, dep: ModelDeployment) -> RuntimeConfig:
        return self._options.runtime_config(dep, self._host_compile)

    async def load(self, dep: ModelDeployment) -> Engine:
        """The runtime, its adapters and a started engine for `dep`."""
        config = self.runtime_config(dep)
        runtime = await in_own_thread(self._runtime_factory, dep.path, config)
        self.runtime = runtime
        if config.compile and config.tp > 1:
            # Every rank compiles in step (the graphs' all-reduces), which would stall the
            # live steps beside it: at tp > 1 the compile comes first.
            log.info("tp=%d: compiling the decode step of %s before serving", config.tp,
                     dep.model)
            await self.warm_up(runtime)
        self.adapters = ServedAdapters(self.model)
        await self.adapters.load(runtime, dep.adapters)
        slots = self._options.adapter_slots_for(dep)
        self.engine = Engine(runtime, BatcherConfig(
            max_num_batched_tokens=self._options.max_num_batched_tokens,
            max_adapters_per_step=max(1, slots),
        ), adapters=runtime.adapters if slots > 0 else None, on_step=self._on_step,
            fatal_errors=(RankFailure,))
        await self.engine.start()
        return self.engine

    async def warm_up(self, runtime: Runtime) -> None:
        """Build the compiled decode step; any failure leaves the runtime eager."""
        self.compiling = True
        self._on_status()
        try:
            seconds = await in_background_thread(runtime.warm_up)
        except Exception as exc:
            log.error("building the compiled decode step of %s failed; serving with eager "
                      "steps", self.model, exc_info=exc)
            seconds = None
        finally:
            self.compiling = False
        if runtime is not self.runtime:
            return  # reloaded meanwhile
        if runtime.compile_failure is not None:
            log.warning("serving %s with eager steps: %s", self.model, runtime.compile_failure)
        elif seconds is not None:
            log.info("compiled the decode step of %s in %.1f s; decode steps take it from "
                     "now on", self.model, seconds)
            if self._options.freeze_heap:  # the compiled graphs live as long as the model
                freeze_heap()
        self._on_status()

    async def sync_adapters(self, dep: ModelDeployment) -> bool:
        """Adapters added or removed while serving (no reload needed); False when there
        is no model to sync."""
        if self.engine is None or self.runtime is None:
            return False
        await self.adapters.sync(self.runtime, self.engine, dep.adapters)
        return True

    async def close(self) -> None:
        """Stop the engine and close the runtime (its ranks and their memory)."""
        if self.engine is not None:
            await self.engine.stop()
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.close)

    def _on_step(self, stats: StepStats) -> None:
        self._metrics.observe_step(stats.num_seqs, stats.num_tokens, stats.seconds)
        if stats.num_adapter_loads:
            self._metrics.add_adapter_swaps(stats.num_adapter_loads)
        if self._traced_step is not None:
            self._traced_step(stats)
