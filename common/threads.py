"""Heavy torch work off the thread that steps the model: on a thread of its own that
ends with the work.

Torch's CPU kernels run on OpenMP (libgomp), which keeps a pool of threads for every
thread that has entered a parallel region, for as long as that thread lives. Once
the pools together hold more threads than there are cores, libgomp stops spinning
while it waits at a barrier and sleeps instead, and every parallel region pays a
wake-up: a worker that loaded its model on a thread of `asyncio.to_thread`'s
executor (which lives on) and stepped it on the engine's step thread decoded
SmolLM2 at ~90 ms a step instead of ~47 ms on 2 cores. A thread that ends takes its
pool with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_own_thread(fn: Callable[..., T], *args: Any, name: str = "sluice-load") -> T:
    """`fn(*args)` on a new thread, waited for; its exception is raised here."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn(*args)
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


async def in_own_thread(fn: Callable[..., T], *args: Any, name: str = "sluice-load") -> T:
    """`fn(*args)` on a new thread that ends with it, awaited without blocking the loop.
    A cancelled caller stops waiting; the work itself runs to its end."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as exc:
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future
