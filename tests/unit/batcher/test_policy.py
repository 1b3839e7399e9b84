"""Ordering: EDF with the cached-prefix tie-break, bounded for big groups of equal
deadlines (a bulk job's)."""

from __future__ import annotations

from batcher.config import OrderingPolicy
from batcher.policy import TIE_BREAK_LOOKUPS, order
from batcher.state import RequestState
from batcher.types import Request, RequestClass
from gpu_runtime.sequence import SamplingParams


def _state(i: int, deadline: float) -> RequestState:
    request = Request(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=4), 0.0, deadline)
    return RequestState(request, RequestClass.BULK, arrival_order=i)


def test_equal_deadlines_go_longest_cached_prefix_first() -> None:
    states = [_state(i, 100.0) for i in range(5)] + [_state(5, 50.0)]
    cached = {"r0": 0, "r1": 16, "r2": 0, "r3": 32, "r4": 16, "r5": 0}
    ordered = order(states, OrderingPolicy.EDF, lambda s: cached[s.key])
    assert [s.key for s in ordered] == ["r5", "r3", "r1", "r4", "r0", "r2"]


def test_a_big_tie_asks_the_cache_about_its_head_only() -> None:
    count = TIE_BREAK_LOOKUPS * 3
    states = [_state(i, 100.0) for i in range(count)]
    asked: list[str] = []

    def cached(state: RequestState) -> int:
        asked.append(state.key)
        return state.arrival_order % 7

    ordered = order(states, OrderingPolicy.EDF, cached)
    assert len(asked) == TIE_BREAK_LOOKUPS
    head = ordered[:TIE_BREAK_LOOKUPS]
    assert {s.arrival_order for s in head} == set(range(TIE_BREAK_LOOKUPS))
    assert [s.arrival_order % 7 for s in head] == sorted((s.arrival_order % 7 for s in head),
                                                         reverse=True)
    assert [s.arrival_order for s in ordered[TIE_BREAK_LOOKUPS:]] == list(
        range(TIE_BREAK_LOOKUPS, count))


def test_fcfs_never_asks_the_cache() -> None:
    states = [_state(i, 100.0 - i) for i in range(4)]
    ordered = order(states, OrderingPolicy.FCFS, lambda s: 1 / 0)
    assert [s.key for s in ordered] == ["r0", "r1", "r2", "r3"]
