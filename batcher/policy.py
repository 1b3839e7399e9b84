"""Ordering: which request goes first. Kept apart from admission (`admission.py`).

EDF orders by deadline (arrival + max_ttft, queue time included); among equal
deadlines the request with the longest cached prefix goes first (its first
token is cheapest, and its cached blocks may be evicted if it waits). FCFS
orders by arrival: the baseline the bench compares against.

Preemption picks the request that comes *last* in the same order, so the
request with the latest deadline is the one recomputed later.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from batcher.config import OrderingPolicy
from batcher.state import RequestState


def order_key(state: RequestState, policy: OrderingPolicy) -> tuple[float, int]:
    if policy is OrderingPolicy.EDF:
        return (state.deadline, state.arrival_order)
    return (state.request.arrival_time, state.arrival_order)


def order(
    states: Iterable[RequestState],
    policy: OrderingPolicy,
    num_cached_tokens: Callable[[RequestState], int] | None = None,
) -> list[RequestState]:
    """`states` in scheduling order; `num_cached_tokens` breaks EDF deadline ties.

    The cache is asked only inside groups of equal deadlines, so the common case
    (distinct deadlines) costs no prefix lookups.
    """
    ordered = sorted(states, key=lambda s: order_key(s, policy))
    if policy is not OrderingPolicy.EDF or num_cached_tokens is None:
        return ordered
    out: list[RequestState] = []
    i = 0
    while i < len(ordered):
        j = i + 1
        while j < len(ordered) and ordered[j].deadline == ordered[i].deadline:
            j += 1
        group = ordered[i:j]
        if len(group) > 1:
            group.sort(key=lambda s: (-num_cached_tokens(s), s.arrival_order))
        out.extend(group)
        i = j
    return out


def pick_victim(
    candidates: Iterable[RequestState], policy: OrderingPolicy, protected_id: str | None
) -> RequestState | None:
    """The request to preempt: last in order; `protected_id` only if it is the sole one."""
    pool = list(candidates)
    others = [s for s in pool if s.key != protected_id]
    pool = others or pool
    if not pool:
        return None
    return max(pool, key=lambda s: order_key(s, policy))
