"""`sluice batch`'s in-flight window: fixed when asked, else Little's law on the rate
answers come back at; `run_window` never exceeds it."""

from __future__ import annotations

import asyncio

import pytest

from sluice.batch import BatchSummary, InFlightWindow, run_window


def test_a_fixed_window_stays_fixed() -> None:
    window = InFlightWindow(8)
    for k in range(100):
        window.finished(window._started + k * 0.01, 0.5)
    assert window.limit == 8


def test_auto_follows_the_rate_of_answers() -> None:
    window = InFlightWindow()
    assert window.limit == InFlightWindow.START
    t0 = window._started
    for k in range(50):  # 100 answers/s during the first half second: too early to tell
        window.finished(t0 + k * 0.01, 0.05)
    assert window.limit == InFlightWindow.START
    for k in range(500):  # quick answers (50 ms) at 100/s: the shortest queue, 2 s
        window.finished(t0 + 1.0 + k * 0.01, 0.05 + (k % 10) * 0.1)
    assert window.limit == pytest.approx(100 * 2.0, rel=0.05)
    for k in range(500):  # a big model: 2 s at best, 100/s: 4 x 2 s = 8 s of queue
        window.finished(t0 + 6.5 + k * 0.01, 2.0 + (k % 10))
    assert window.limit == pytest.approx(100 * 8.0, rel=0.05)
    for k in range(500):  # 10 s at best: the queue is capped at 20 s
        window.finished(t0 + 12.0 + k * 0.01, 10.0 + (k % 10))
    assert window.limit == pytest.approx(100 * 20.0, rel=0.05)
    for k in range(20):  # slow answers, 2/s: never below the floor
        window.finished(t0 + 18.0 + k * 0.5, 1.0)
    assert window.limit == InFlightWindow.FLOOR


def test_auto_is_capped() -> None:
    window = InFlightWindow()
    t0 = window._started
    for k in range(60_000):  # 10,000 answers/s
        window.finished(t0 + 1.0 + k * 0.0001, 5.0)
    assert window.limit == InFlightWindow.CEILING


async def test_run_window_keeps_to_the_limit_and_handles_every_item() -> None:
    window = InFlightWindow(5)
    summary = BatchSummary()
    now, peak, seen = 0, 0, []

    async def handle(item: int) -> None:
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        await asyncio.sleep(0.001 * (item % 3))
        seen.append(item)
        now -= 1

    await run_window(range(40), handle, window, summary)
    assert sorted(seen) == list(range(40))
    assert peak == summary.peak_in_flight == 5


async def test_run_window_raises_the_first_failure_as_itself() -> None:
    async def handle(item: int) -> None:
        await asyncio.sleep(0)
        if item == 3:
            raise KeyError("line 3")

    with pytest.raises(KeyError, match="line 3"):
        await run_window(range(10), handle, InFlightWindow(4))
