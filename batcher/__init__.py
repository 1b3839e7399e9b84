"""batcher: the deadline-aware continuous batcher and the engine loop.

Requests come in as plain `Request` dataclasses and events go out as plain
dataclasses (the worker builds the one and routes the others); nothing here
knows Kafka or pydantic.

Public API::

    from batcher import BatcherConfig, Engine, OrderingPolicy, Request, RequestClass

    engine = Engine(runtime, BatcherConfig(max_num_batched_tokens=512,
                                           max_adapters_per_step=4))
    await engine.start()                       # or `async with engine:`
    engine.submit(Request(key, token_ids, SamplingParams(...), arrival_time,
                          max_ttft, adapter_key=None, attempt=0, origin=(p, offset)))
    engine.cancel(key) -> bool
    event = await engine.next_event()          # or engine.events (asyncio.Queue)
    engine.is_full() -> bool                   # backpressure: pause partitions
    await engine.drain()                       # finish in-flight work, accept no more
    await engine.stop() -> list[Request]       # unfinished requests, no events sent

Events (`batcher.types`), each with `key`, `attempt`, `origin`:
`Tokens(seq, token_ids)`, `Finished(finish_reason, token_ids, counts, latency)`,
`Failed(code, message)` (a `schemas.ErrorCode`), `Expired(waited_ms, early)`,
`Cancelled`. Every request gets exactly one terminal event; a request whose
deadline has passed when it is submitted expires at once.

Pure core (simulated clock, fake runtime): `Scheduler(runtime, config, clock=...,
adapters=...)` with `submit`, `cancel`, `schedule() -> BatchPlan`,
`update(plan, output) -> events`, `fail_step(plan, exc) -> events`.
The runtime is anything satisfying `runtime_port.RuntimePort`
(`gpu_runtime.Runtime` does); adapter residency plugs in as `AdapterSlots`.
"""

from batcher.config import BatcherConfig, OrderingPolicy
from batcher.engine import Engine
from batcher.errors import (
    BatcherError,
    ConfigError,
    DuplicateRequestError,
    EngineClosedError,
)
from batcher.runtime_port import AdapterSlots, RuntimePort
from batcher.scheduler import BatchPlan, Scheduler
from batcher.types import (
    Cancelled,
    Event,
    Expired,
    Failed,
    Finished,
    Latency,
    Request,
    RequestClass,
    SchedulerStats,
    TokenCounts,
    Tokens,
)

__all__ = [
    "AdapterSlots",
    "BatchPlan",
    "BatcherConfig",
    "BatcherError",
    "Cancelled",
    "ConfigError",
    "DuplicateRequestError",
    "Engine",
    "EngineClosedError",
    "Event",
    "Expired",
    "Failed",
    "Finished",
    "Latency",
    "OrderingPolicy",
    "Request",
    "RequestClass",
    "RuntimePort",
    "Scheduler",
    "SchedulerStats",
    "TokenCounts",
    "Tokens",
]
