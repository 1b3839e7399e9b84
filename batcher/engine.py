"""The engine loop: an asyncio task that owns the scheduler; the model step runs in one thread.

::

    engine = Engine(runtime, BatcherConfig(...))
    async with engine:                       # start() ... stop()
        engine.submit(request)               # plain `batcher.Request`
        engine.cancel("r-1")                 # client gone
        event = await engine.next_event()    # token / done / error / timeout / cancelled
        if engine.is_full(): ...             # pause Kafka partitions
        await engine.drain()                 # finish what is in flight, accept nothing new

Only the loop task touches the scheduler and, between steps, the runtime; the
worker thread runs `runtime.execute(plan)` (and adapter loads) alone, so the
event loop keeps polling, producing and committing while the model computes.
`submit` and `cancel` only record intent; the loop acts on them at the next
step boundary. When there is nothing to compute the loop sleeps until a
submission, a cancellation or the next deadline, never spinning.

Failures: an error the runtime attributes to one sequence fails that request
(`error internal`) and the others go on; any other step failure fails every
request the runtime holds; a bug in the scheduler itself fails every
unfinished request. The loop survives all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

from batcher.config import BatcherConfig
from batcher.errors import EngineClosedError
from batcher.runtime_port import AdapterSlots, RuntimePort
from batcher.scheduler import BatchPlan, Scheduler
from batcher.types import Event, Request
from common.timeouts import within
from gpu_runtime.sequence import StepOutput

_log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one executed step did, for metrics and traces."""

    num_seqs: int
    num_tokens: int
    seconds: float
    num_adapter_loads: int
    started_at: float = 0.0  # wall-clock seconds (the engine's clock)
    # Tokens computed per request key: the requests that rode in this step.
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
_IDLE_POLL_S = 0.05  # re-plan this often while requests wait on something other than us


class Engine:
    def __init__(
        self,
        runtime: RuntimePort,
        config: BatcherConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        adapters: AdapterSlots | None = None,
        on_step: Callable[[StepStats], None] | None = None,
        fatal_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.scheduler = Scheduler(runtime, config, clock=clock, adapters=adapters)
        self._on_step = on_step
        # Errors after which the runtime cannot go on (e.g. a tensor-parallel rank
        # died): the loop stops without ending any request, so the caller can let
        # another replica serve them again rather than fail them here.
        self._fatal_errors = fatal_errors
        self.fatal: BaseException | None = None
        self.failed = asyncio.Event()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._rt = runtime
        self._adapters = adapters
        self._clock = clock
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-step")
        self._task = asyncio.create_task(self._run(), name="sluice-engine")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """The loop survives step failures; if it dies anyway (a bug), say so and mark
        the engine failed so its owner stops instead of waiting forever."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        _log.error("engine loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self.fatal = exc
        self._closing = True
        self.failed.set()
        self._idle.set()

    async def drain(self) -> None:
        """Accept nothing new; return once every submitted request has ended."""
        self._closing = True
        self._wakeup.set()
        while self.scheduler.has_work() and self.fatal is None:
            self._idle.clear()
            await self._idle.wait()

    async def stop(self) -> list[Request]:
        """Stop after the current step; returns the unfinished requests (no events sent)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return self.scheduler.abandon()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # ---- requests in, events out ---------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; raises `EngineClosedError`, `DuplicateRequestError`."""
        if self._closing:
            raise EngineClosedError("the engine is draining or stopped")
        self.scheduler.submit(request)
        self._idle.clear()
        self._wakeup.set()

    def cancel(self, key: str, *, answer: bool = False) -> bool:
        """Cancel a request; it ends with one `cancelled` event unless it ended already
        (with `answer`, a `done` event whose finish_reason is "cancelled")."""
        found = self.scheduler.cancel(key, answer=answer)
        self._wakeup.set()
        return found

    async def run_between_steps(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the step thread, so it never overlaps a step (e.g. loading
        an adapter's weights into host memory, or dropping one)."""
        if self._executor is None:
            return fn()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn)

    async def next_event(self) -> Event:
        return await self.events.get()

    def is_full(self) -> bool:
        """Backpressure: pause fetching while this is true."""
        return self.scheduler.is_full()

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    # ---- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            try:
                plan = self.scheduler.schedule()
            except Exception as exc:
                _log.exception("scheduler failed; failing every unfinished request")
                self._emit(self.scheduler.fail_all(exc))
                continue
            self._emit(plan.events)
            if plan.step is None and not plan.adapters_to_load:
                await self._sleep()
                continue
            started_at, started = self._clock(), time.perf_counter()
            try:
                output = await loop.run_in_executor(self._executor, self._execute, plan)
                self._report_step(plan, started_at, time.perf_counter() - started)
            except self._fatal_errors as exc:
                _log.error("runtime failed for good: %s: %s", type(exc).__name__, exc)
                self.fatal = exc
                self._closing = True
                self.failed.set()
                self._idle.set()
                return
            except Exception as exc:
                _log.warning("step failed: %s: %s", type(exc).__name__, exc)
                self._emit(self.scheduler.fail_step(plan, exc))
                continue
            if output is not None:
                try:
                    self._emit(self.scheduler.update(plan, output))
                except Exception as exc:
                    _log.exception("update failed; failing every unfinished request")
                    self._emit(self.scheduler.fail_all(exc))

    def _report_step(self, plan: BatchPlan, started_at: float, seconds: float) -> None:
        if self._on_step is None:
            return
        scheduled = plan.step.num_scheduled_tokens if plan.step is not None else {}
        stats = StepStats(len(scheduled), plan.num_scheduled_tokens, seconds,
                          len(plan.adapters_to_load), started_at, scheduled)
        try:
            self._on_step(stats)
        except Exception:  # observability must never break serving
            _log.exception("on_step callback failed")

    def _execute(self, plan: BatchPlan) -> StepOutput | None:
        """Runs in the worker thread: adapter loads between steps, then the step."""
        if self._adapters is not None and plan.adapters_to_load:
            self._adapters.load_adapters(plan.adapters_to_load, plan.adapter_keys)
        return self._rt.execute(plan.step) if plan.step is not None else None

    async def _sleep(self) -> None:
        if not self.scheduler.has_work():
            self._idle.set()
            await self._wakeup.wait()
            return
        timeout = _IDLE_POLL_S
        deadline = self.scheduler.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(deadline - self._clock(), 0.0))
        with contextlib.suppress(TimeoutError):
            await within(timeout, self._wakeup.wait())

    def _emit(self, events: list[Event]) -> None:
        for event in events:
            self.events.put_nowait(event)
        if not self.scheduler.has_work():
            self._idle.set()
