"""batcher: the deadline-aware continuous batcher and the engine loop.

Requests come in as plain `Request` dataclasses (from `ingest`), events go out
as plain dataclasses (to `results`); nothing here knows Kafka or pydantic.

Public API::

    from batcher import BatcherConfig, Engine, OrderingPolicy, Request, RequestClass

    engine = Engine(runtime, BatcherConfig(max_num_batched_tokens=512,
                                           max_adapters_per_step=4))
    await engine.start()                       # or `async with engine:`
    engine.submit(Request(request_id, token_ids, SamplingParams(...), arrival_time,
                          max_ttft, adapter_key=None, attempt=0, origin=(p, offset)))
    engine.cancel(request_id) -> bool
    event = await engine.next_event()          # or engine.events (asyncio.Queue)
    engine.is_full() -> bool                   # backpressure: pause partitions
    await engine.drain()                       # finish in-flight work, accept no more
    await engine.stop() -> list[Request]       # unfinished requests, no events sent

Events (`batcher.types`), each with `request_id`, `attempt`, `origin`:
`TokenEvent(seq, token_ids)`, `DoneEvent(finish_reason, token_ids, usage, timing)`,
`ErrorEvent(code, message)`, `TimeoutEvent(waited_ms, max_ttft_ms, early)`,
`CancelledEvent`. Every request gets exactly one terminal event.

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
    InvalidRequestError,
)
from batcher.runtime_port import AdapterSlots, RuntimePort
from batcher.scheduler import BatchPlan, Scheduler
from batcher.types import (
    CancelledEvent,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    Request,
    RequestClass,
    SchedulerStats,
    TimeoutEvent,
    Timing,
    TokenEvent,
    Usage,
)

__all__ = [
    "AdapterSlots",
    "BatchPlan",
    "BatcherConfig",
    "BatcherError",
    "CancelledEvent",
    "ConfigError",
    "DoneEvent",
    "DuplicateRequestError",
    "Engine",
    "EngineClosedError",
    "ErrorCode",
    "ErrorEvent",
    "Event",
    "InvalidRequestError",
    "OrderingPolicy",
    "Request",
    "RequestClass",
    "RuntimePort",
    "Scheduler",
    "SchedulerStats",
    "TimeoutEvent",
    "Timing",
    "TokenEvent",
    "Usage",
]
