"""A short seeded fault run (`sluice bench chaos` in small): exactly-once holds, and
at-least-once loses nothing, when a worker is paused past its session and wakes as a
zombie, a worker is SIGKILLed, a partition leader is SIGKILLed and PostgreSQL
restarts, one after another under load.

Networked, the same holds over real network faults: brokers, PostgreSQL and each
worker in a network namespace of their own (`infra.netns`; root, `ip` and `nft`, else
skipped), a worker cut from every broker past its session timeout (a zombie of the
network), the leading broker cut from its followers, a worker cut from PostgreSQL, a
lossy and bandwidth-capped link.

Its own three-node cluster and PostgreSQL; every request sent is checked on the reply
topic: one committed terminal event each, none for ids never sent, streamed texts
equal to `done.text` per attempt, committed offsets never going back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, run_chaos
from infra import netns

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHORT = ChaosConfig(seed=7, requests=150, rate_per_s=3.0, sessions=40, workers=2,
                    partitions=4, faults=4, pause_s=(14.0, 15.0), broker_down_s=(6.0, 8.0),
                    postgres_down_s=(2.0, 3.0), request_timeout_s=240.0, warmup_s=0.0)
# Cuts just past the sessions they must outlast (a worker's 10 s, a broker's 6 s).
NETWORKED = dataclasses.replace(SHORT, requests=90, networked=True, partition_s=(12.0, 13.0),
                                broker_down_s=(7.0, 8.0), db_cut_s=(5.0, 6.0),
                                lossy_s=(6.0, 7.0), loss_percent=(10, 15),
                                bandwidth_bytes_per_s=(32_000, 48_000))


async def test_a_seeded_fault_run_loses_and_repeats_nothing(tiny_model: Path,
                                                           tmp_path: Path) -> None:
    await _run(tiny_model, tmp_path, _short(
        "exactly_once", ("worker_pause", "broker_kill", "worker_cut_from_brokers",
                         "leader_isolated_from_brokers", "lossy_links")))


async def test_at_least_once_loses_nothing_under_the_same_faults(tiny_model: Path,
                                                                tmp_path: Path) -> None:
    """Repeats are allowed (as later attempts); a request without an answer is not. It
    found partitions read from the client's own position while their start was still
    being looked up: the records fetched meanwhile were dropped, for good."""
    await _run(tiny_model, tmp_path, _short(
        "at_least_once", ("worker_kill", "postgres_restart", "worker_cut_from_brokers",
                          "worker_cut_from_database")))


def _short(delivery: str, networked_kinds: tuple[str, ...]) -> ChaosConfig:
    """One short seed per delivery mode (the suite's budget for both is ~4 min): the
    network kinds among the process kinds where namespaces can be made, else the four
    process kinds alone (said in the output)."""
    reason = netns.unavailable()
    if reason is not None:
        print(f"chaos without network faults: {reason}")
        return dataclasses.replace(SHORT, delivery=delivery)
    return dataclasses.replace(NETWORKED, delivery=delivery, faults=len(networked_kinds),
                               kinds=networked_kinds)


async def _run(tiny_model: Path, tmp_path: Path, config: ChaosConfig) -> None:
    report = await run_chaos(config, tmp_path, tiny_model, say=print)
    summary = report.summary()
    print(summary)
    assert sorted(f.kind for f in report.faults) == sorted(config.kinds)
    assert not report.violations, report.violations[:20]
    if config.delivery == "exactly_once":
        assert report.terminal_histogram == {1: config.requests}, summary
    else:
        assert 0 not in report.terminal_histogram, summary
    assert report.offset_samples > 50
    assert not report.worker_exits, report.worker_exits  # none but the nemesis's own
    # After every fault, each worker serves its share of the partitions again.
    assert all(f.capacity_back_s is not None for f in report.faults), summary["faults"]
    assert summary["outcomes"].get("done", 0) + summary["outcomes"].get("timeout", 0) \
        == config.requests, summary["outcomes"]
