"""Drive a `Scheduler` over a `FakeRuntime` on simulated time; collect an `Engine`'s events."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

from batcher.engine import Engine
from batcher.scheduler import BatchPlan, Scheduler
from batcher.types import TERMINAL_EVENT_TYPES, Event, Request, Tokens
from gpu_runtime.sequence import SamplingParams
from tests.unit.batcher.fake_runtime import FakeRuntime


def make_request(
    key: str,
    prompt: list[int] | tuple[int, ...],
    *,
    arrival: float,
    max_ttft: float = 10.0,
    max_tokens: int = 4,
    adapter: str | None = None,
    **kwargs: object,
) -> Request:
    return Request(
        key=key,
        token_ids=tuple(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival,
        deadline=arrival + max_ttft,
        adapter_key=adapter,
        **kwargs,  # type: ignore[arg-type]
    )


@dataclass
class Trace:
    events: list[Event] = field(default_factory=list)
    plans: list[BatchPlan] = field(default_factory=list)
    by_request: dict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))
    first_token_order: list[str] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for ev in events:
            self.events.append(ev)
            self.by_request[ev.key].append(ev)
            if isinstance(ev, Tokens) and ev.seq == 0:
                self.first_token_order.append(ev.key)

    def terminal(self, key: str) -> Event:
        ends = [e for e in self.by_request[key] if isinstance(e, TERMINAL_EVENT_TYPES)]
        assert len(ends) == 1, f"{key}: {ends}"
        return ends[0]

    def tokens(self, key: str) -> list[int]:
        return [
            t for e in self.by_request[key] if isinstance(e, Tokens) for t in e.token_ids
        ]


def step(sched: Scheduler, rt: FakeRuntime, trace: Trace, idle_s: float = 0.01) -> BatchPlan:
    plan = sched.schedule()
    trace.plans.append(plan)
    trace.add(plan.events)
    if plan.step is None:
        rt.clock.advance(idle_s)
        return plan
    try:
        output = rt.execute(plan.step)
    except Exception as exc:
        trace.add(sched.fail_step(plan, exc))
        return plan
    trace.add(sched.update(plan, output))
    return plan


def run_until_idle(
    sched: Scheduler, rt: FakeRuntime, trace: Trace, max_steps: int = 10_000
) -> None:
    for _ in range(max_steps):
        if not sched.has_work():
            return
        step(sched, rt, trace)
    raise AssertionError("scheduler did not finish its work")


async def collect(
    engine: Engine, request_ids: set[str], timeout: float = 10.0
) -> dict[str, list[Event]]:
    """The events of each of `request_ids` from `engine`, until every one has ended."""
    out: dict[str, list[Event]] = {r: [] for r in request_ids}
    pending = set(request_ids)
    async with asyncio.timeout(timeout):
        while pending:
            ev = await engine.next_event()
            out[ev.key].append(ev)
            if isinstance(ev, TERMINAL_EVENT_TYPES):
                pending.discard(ev.key)
    return out
