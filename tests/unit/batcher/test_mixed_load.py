"""Interactive + bulk load on simulated time: EDF meets interactive deadlines, bulk progresses."""

from __future__ import annotations

import random

from batcher.config import BatcherConfig, OrderingPolicy
from batcher.scheduler import Scheduler
from batcher.types import Expired, Finished, RequestClass
from tests.unit.batcher.fake_runtime import CostModel, FakeRuntime, SimClock
from tests.unit.batcher.sim import Trace, make_request, step


def run_mixed(
    ordering: OrderingPolicy, bulk_token_share: float = 0.125, rate: float = 20.0
) -> dict[str, int]:
    clock = SimClock(start=0.0)
    rt = FakeRuntime(2000, 4, clock=clock, cost=CostModel(step_s=0.005, token_s=0.0002), vocab=100)
    config = BatcherConfig(
        max_num_batched_tokens=256, ordering=ordering, bulk_token_share=bulk_token_share
    )
    sched = Scheduler(rt, config, clock=clock)
    rng = random.Random(7)
    arrivals = []
    for i in range(40):  # a bulk backlog lands first
        prompt = [rng.randrange(100) for _ in range(200)]
        bulk = make_request(
            f"b{i}",
            prompt,
            arrival=0.0,
            max_ttft=1000.0,
            max_tokens=20,
            request_class=RequestClass.BULK,
        )
        arrivals.append((0.0, bulk))
    t = 0.01
    for i in range(200):  # then interactive chat, Poisson arrivals
        t += rng.expovariate(rate)
        prompt = [rng.randrange(100) for _ in range(100)]
        arrivals.append((t, make_request(f"i{i}", prompt, arrival=t, max_ttft=0.5, max_tokens=10)))
    end_of_interactive = t
    trace = Trace()
    bulk_done_during_load = 0
    while arrivals or sched.has_work():
        while arrivals and arrivals[0][0] <= clock.now:
            sched.submit(arrivals.pop(0)[1])
        n_before = len(trace.events)
        step(sched, rt, trace, idle_s=0.001)
        if clock.now <= end_of_interactive:
            bulk_done_during_load += sum(
                isinstance(e, Finished) and e.key.startswith("b")
                for e in trace.events[n_before:]
            )
    ends = {rid: trace.terminal(rid) for rid in trace.by_request}
    return {
        "interactive_timeouts": sum(
            isinstance(e, Expired) and r[0] == "i" for r, e in ends.items()
        ),
        "interactive_done": sum(isinstance(e, Finished) and r[0] == "i" for r, e in ends.items()),
        "bulk_done": sum(isinstance(e, Finished) and r[0] == "b" for r, e in ends.items()),
        "bulk_done_during_load": bulk_done_during_load,
        "preemptions": sched.stats.num_preemptions,
    }


def test_interactive_meets_deadlines_while_bulk_progresses() -> None:
    # 30 chats/s of 110 tokens is ~70% of the simulated device; 40 bulk jobs wait too.
    edf = run_mixed(OrderingPolicy.EDF, rate=30.0)
    fcfs = run_mixed(OrderingPolicy.FCFS, rate=30.0)
    assert edf["interactive_timeouts"] == 0 and edf["interactive_done"] == 200
    assert edf["bulk_done"] == 40
    assert edf["bulk_done_during_load"] >= 10  # bulk is not starved by the interactive stream
    assert fcfs["interactive_timeouts"] > 50  # same load in arrival order: chat waits behind bulk


def test_the_oldest_bulk_request_gets_its_reserved_share_under_a_saturating_stream() -> None:
    for share, expected in ((0.125, 32), (0.0, None)):
        clock = SimClock()
        rt = FakeRuntime(2000, 4, clock=clock)
        config = BatcherConfig(max_num_batched_tokens=256, bulk_token_share=share)
        sched = Scheduler(rt, config, clock=clock)
        sched.submit(make_request("bulk", [1] * 300, arrival=clock.now - 60, max_ttft=3600.0))
        for i in range(20):  # far more interactive prompt tokens than one step holds
            sched.submit(make_request(f"i{i}", [2 + i] * 100, arrival=clock.now, max_ttft=1.0))
        plan = step(sched, rt, Trace())
        assert plan.step.num_scheduled_tokens.get("bulk") == expected
        assert sum(plan.step.num_scheduled_tokens.values()) == 256
