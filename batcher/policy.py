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

# The cached-prefix tie-break looks at this many of a group of equal deadlines (the
# earliest arrivals); the rest keep arrival order. A bulk job's requests share one
# deadline, and asking the prefix cache about every waiting one at every step cost
# a quarter of the engine loop with 2,000 of them queued (`sluice bench bulk`).
TIE_BREAK_LOOKUPS = 64


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
    (distinct deadlines) costs no prefix lookups, and only for the first
    TIE_BREAK_LOOKUPS of a group.
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
        head, tail = ordered[i:min(j, i + TIE_BREAK_LOOKUPS)], ordered[i + TIE_BREAK_LOOKUPS:j]
        if len(head) > 1:
            head.sort(key=lambda s: (-num_cached_tokens(s), s.arrival_order))
        out.extend(head)
        out.extend(tail)
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
