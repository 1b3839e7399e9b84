"""Heavy torch work runs on a thread that ends with it (common/threads.py: OpenMP keeps
a thread pool per live thread that used it)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from common.threads import in_own_thread, run_in_own_thread


def test_run_in_own_thread_returns_and_the_thread_is_gone() -> None:
    seen: list[threading.Thread] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread())
        return x * 2

    assert run_in_own_thread(work, 21) == 42
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()


def test_run_in_own_thread_raises_the_work_s_error() -> None:
    def work() -> None:
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        run_in_own_thread(work)


async def test_in_own_thread_keeps_the_loop_running_and_the_thread_ends() -> None:
    seen: list[threading.Thread] = []
    ticks = 0

    def work() -> str:
        seen.append(threading.current_thread())
        time.sleep(0.2)
        return "loaded"

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    assert await in_own_thread(work) == "loaded"
    ticker.cancel()
    assert ticks >= 5  # the loop was not blocked
    seen[0].join(timeout=1)
    assert not seen[0].is_alive()
    assert seen[0] not in {t for t in threading.enumerate()}


async def test_in_own_thread_raises_the_work_s_error() -> None:
    def work() -> None:
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        await in_own_thread(work)
