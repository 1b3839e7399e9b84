"""The worker's background tasks, each one watched.

A task that fails, or a loop that returns while it should run forever, is
handed to `on_failure` with its name and exception (the worker logs it with its
traceback and acts on it); a cancelled task, or one that ends while the worker
stops, is not a failure. Shutdown cancels and awaits them all, so none is left
pending. Also the two ways a shutdown or a slow build runs beside the loop:
`quietly` (one shutdown step, its failure logged) and `in_background_thread`
(a daemon thread a stopping worker does not wait for).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
OnFailure = Callable[[str, BaseException | None], None]


class WatchedTasks:
    def __init__(self, on_failure: OnFailure, stopping: asyncio.Event):
        self._on_failure = on_failure
        self._stopping = stopping
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, Any], name: str, *,
              runs_forever: bool = True) -> asyncio.Task[Any]:
        return self.watch(asyncio.create_task(work, name=name), name, runs_forever=runs_forever)

    def watch(self, task: asyncio.Task[Any], name: str, *,
              runs_forever: bool = True) -> asyncio.Task[Any]:
        """Report `task` if it fails, or ends while it should run forever."""
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._ended, name, runs_forever))
        return task

    def _ended(self, name: str, runs_forever: bool, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None and (not runs_forever or self._stopping.is_set()):
            return
        self._on_failure(f"worker task {name!r} " + ("failed" if exc is not None
                                                      else "ended unexpectedly"), exc)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def until_stopped(self, work: Coroutine[Any, Any, Any]) -> Any:
        """`work`'s result, or None if the worker is stopped (or fails) first."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
        return task.result()


async def quietly(work: Coroutine[Any, Any, Any], what: str) -> None:
    """One step of a shutdown: its failure is logged and the shutdown goes on — also a
    cancellation raised from inside it (a client's own task cancelled under it), which
    is not this task's; a cancellation of this task still cancels."""
    try:
        await work
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("%s was cancelled from within; going on with the shutdown", what)
    except Exception as exc:
        log.warning("%s failed (%s: %s); going on with the shutdown", what,
                    type(exc).__name__, exc)


async def in_background_thread(work: Callable[[], T]) -> T:
    """`work`'s result, computed in a daemon thread at a lower CPU priority: a stopping
    worker does not wait for it (as it would for the loop's executor), and the live eager
    steps keep the cores (Linux nices threads one by one; the compiler's worker processes
    started from it inherit that)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            result = work()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, functools.partial(future.set_exception, exc))
        else:
            loop.call_soon_threadsafe(settle, functools.partial(future.set_result, result))

    threading.Thread(target=run, name="sluice-compile", daemon=True).start()
    return await future


class StopWatchdog:
    """Ends the process when a decided stop has not ended it within `deadline_s`.

    A shutdown step can hang where no timeout reaches it: a client's stop waiting on a
    broker that is away, a pool closing while a connection is stuck in a call, a thread
    of the loop's executor blocking the interpreter's exit. A worker that has decided to
    stop and still runs looks alive to its supervisor while it serves nothing, so after
    the deadline the watchdog (a thread: the event loop may be the thing that hangs)
    logs the step it was in and exits with the worker's exit code.
    """

    def __init__(self, deadline_s: float, exit_code: Callable[[], int]):
        self.deadline_s = deadline_s
        self._exit_code = exit_code
        self.step = "deciding to stop"
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        """Start the countdown (once: the first decision to stop counts)."""
        if self._timer is None:
            self._timer = threading.Timer(self.deadline_s, self._expire)
            self._timer.name = "sluice-stop-watchdog"
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        code = self._exit_code()
        log.error("the worker decided to stop %.0f s ago and still runs (stuck in: %s); "
                  "exiting now with exit code %d", self.deadline_s, self.step, code)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os._exit(code)
