"""A short seeded fault run (`sluice bench chaos` in small): exactly-once holds, and
at-least-once loses nothing, when a worker is paused past its session and wakes as a
zombie, a worker is SIGKILLed, a partition leader is SIGKILLed and PostgreSQL
restarts, one after another under load.

Its own three-node cluster and PostgreSQL; every request sent is checked on the reply
topic: one committed terminal event each, none for ids never sent, streamed texts
equal to `done.text` per attempt, committed offsets never going back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_seeded_fault_run_loses_and_repeats_nothing(tiny_model: Path,
                                                           tmp_path: Path) -> None:
    await _run(tiny_model, tmp_path, "exactly_once")


async def test_at_least_once_loses_nothing_under_the_same_faults(tiny_model: Path,
                                                                tmp_path: Path) -> None:
    """Repeats are allowed (as later attempts); a request without an answer is not. It
    found partitions read from the client's own position while their start was still
    being looked up: the records fetched meanwhile were dropped, for good."""
    await _run(tiny_model, tmp_path, "at_least_once")


async def _run(tiny_model: Path, tmp_path: Path, delivery: str) -> None:
    config = ChaosConfig(seed=7, requests=150, rate_per_s=3.0, sessions=40, workers=2,
                         partitions=4, faults=4, delivery=delivery,
                         pause_s=(14.0, 15.0), broker_down_s=(6.0, 8.0),
                         postgres_down_s=(2.0, 3.0), request_timeout_s=240.0)
    report = await run_chaos(config, tmp_path, tiny_model, say=print)
    summary = report.summary()
    print(summary)
    assert sorted(f.kind for f in report.faults) == sorted(config.kinds)
    assert not report.violations, report.violations[:20]
    if delivery == "exactly_once":
        assert report.terminal_histogram == {1: config.requests}, summary
    else:
        assert 0 not in report.terminal_histogram, summary
    assert report.offset_samples > 50
    assert summary["outcomes"].get("done", 0) + summary["outcomes"].get("timeout", 0) \
        == config.requests, summary["outcomes"]
