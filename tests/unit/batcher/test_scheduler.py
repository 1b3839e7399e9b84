"""Exact scheduler behaviour on a simulated clock with the fake runtime."""

from __future__ import annotations

import pytest

from batcher.config import BatcherConfig, OrderingPolicy
from batcher.errors import ConfigError, DuplicateRequestError
from batcher.scheduler import Scheduler
from batcher.types import (
    Cancelled,
    Expired,
    Failed,
    Finished,
    RequestClass,
    Tokens,
)
from tests.unit.batcher.fake_runtime import CostModel, FakeRuntime, SimClock, run_alone
from tests.unit.batcher.sim import Trace, make_request, run_until_idle, step


def setup(num_blocks: int = 64, cost: CostModel | None = None, **cfg: object):
    clock = SimClock()
    rt = FakeRuntime(num_blocks=num_blocks, block_size=4, clock=clock, cost=cost)
    sched = Scheduler(rt, BatcherConfig(**cfg), clock=clock)  # type: ignore[arg-type]
    return clock, rt, sched, Trace()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7 + i * 3) % 97 for i in range(n)]


@pytest.mark.parametrize("policy", [OrderingPolicy.EDF, OrderingPolicy.FCFS])
def test_waiting_requests_start_in_deadline_order(policy: OrderingPolicy) -> None:
    clock, rt, sched, trace = setup(max_num_batched_tokens=8, ordering=policy)
    t = clock.now
    # Arrival order a, b, c; deadlines c < a < b.
    sched.submit(make_request("a", prompt(1, 8), arrival=t - 0.3, max_ttft=5.0))
    sched.submit(make_request("b", prompt(2, 8), arrival=t - 0.2, max_ttft=9.0))
    sched.submit(make_request("c", prompt(3, 8), arrival=t - 0.1, max_ttft=1.0))
    run_until_idle(sched, rt, trace)
    expected = ["c", "a", "b"] if policy is OrderingPolicy.EDF else ["a", "b", "c"]
    assert trace.first_token_order == expected
    assert [type(trace.terminal(r)) for r in "abc"] == [Finished] * 3


def test_equal_deadlines_prefer_the_cached_prefix() -> None:
    clock, rt, sched, trace = setup(max_num_batched_tokens=16)
    shared = prompt(5, 12)
    sched.submit(make_request("warm", [*shared, 1], arrival=clock.now, max_tokens=1))
    run_until_idle(sched, rt, trace)
    t = clock.now
    sched.submit(make_request("cold", [*prompt(9, 12), 2], arrival=t, max_ttft=3.0))
    sched.submit(make_request("hit", [*shared, 3], arrival=t, max_ttft=3.0))
    run_until_idle(sched, rt, trace)
    assert trace.first_token_order[1:] == ["hit", "cold"]
    done = trace.terminal("hit")
    assert isinstance(done, Finished) and done.counts.num_cached_prompt_tokens == 12


def test_request_expiring_in_the_queue_times_out_once_with_its_wait() -> None:
    # One sequence per step, 0.1 s per step: "long" decodes for 2 s while "short" waits.
    cost = CostModel(step_s=0.1, token_s=0.0)
    clock, rt, sched, trace = setup(cost=cost, max_num_seqs=1)
    sched.submit(make_request("long", prompt(1, 8), arrival=clock.now, max_tokens=20))
    step(sched, rt, trace)
    sched.submit(make_request("short", prompt(2, 8), arrival=clock.now, max_ttft=0.25))
    run_until_idle(sched, rt, trace)
    ev = trace.terminal("short")
    assert isinstance(ev, Expired)
    assert not any(isinstance(e, Tokens) for e in trace.by_request["short"])
    assert 250.0 <= ev.waited_ms <= 350.0
    assert sched.stats.num_timeouts == 1
    assert isinstance(trace.terminal("long"), Finished)
    rt.check_no_leaks()


def test_a_request_already_late_when_submitted_expires_at_once() -> None:
    """Its deadline passed while it waited elsewhere (the permission database away,
    say): a timeout with its wait, whatever its content — even no prompt at all."""
    clock, rt, sched, trace = setup()
    sched.submit(make_request("late", [], arrival=clock.now - 3.0, max_ttft=2.0))
    plan = step(sched, rt, trace)
    (ev,) = plan.events
    assert isinstance(ev, Expired) and ev.key == "late" and not ev.early
    assert ev.waited_ms == 3000.0
    assert sched.stats.num_timeouts == 1 and not sched.has_work()


def test_queue_time_counts_toward_ttft() -> None:
    clock, rt, sched, trace = setup()
    # Broker timestamps 2 s in the past: one request's budget is already spent.
    sched.submit(make_request("late", prompt(1, 8), arrival=clock.now - 2.0, max_ttft=1.5))
    sched.submit(make_request("ok", prompt(2, 8), arrival=clock.now - 2.0, max_ttft=3.0))
    plan = step(sched, rt, trace)
    assert [type(e) for e in plan.events] == [Expired]
    assert plan.events[0].waited_ms == 2000.0
    run_until_idle(sched, rt, trace)
    done = trace.terminal("ok")
    assert isinstance(done, Finished)
    assert done.latency.queue_ms == 2000.0
    assert 2000.0 < done.latency.ttft_ms < 2100.0
    assert trace.tokens("late") == []


def test_first_token_sampled_after_the_deadline_is_a_timeout() -> None:
    clock, rt, sched, trace = setup(cost=CostModel(step_s=0.5, token_s=0.0))
    sched.submit(make_request("r", prompt(1, 8), arrival=clock.now, max_ttft=0.3))
    run_until_idle(sched, rt, trace)
    assert isinstance(trace.terminal("r"), Expired)
    assert trace.tokens("r") == []
    rt.check_no_leaks()
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks


def test_long_prompts_are_chunked_and_decodes_run_every_step() -> None:
    clock, rt, sched, trace = setup(max_num_batched_tokens=16)
    sched.submit(make_request("chat", prompt(1, 6), arrival=clock.now, max_tokens=12))
    step(sched, rt, trace)
    sched.submit(make_request("doc", prompt(2, 100), arrival=clock.now, max_tokens=2))
    run_until_idle(sched, rt, trace)
    doc_chunks = [p.step.num_scheduled_tokens.get("doc") for p in trace.plans[1:] if p.step]
    assert doc_chunks[:7] == [15, 15, 15, 15, 15, 15, 10]  # 1 token per step goes to "chat"
    for p in trace.plans[1:8]:
        assert p.step.num_scheduled_tokens["chat"] == 1
    assert trace.tokens("chat") == run_alone(prompt(1, 6), 12, 100, None)


def test_prompt_larger_than_the_cache_is_rejected_at_once() -> None:
    clock, rt, sched, trace = setup(num_blocks=8)  # 32 tokens
    sched.submit(make_request("big", prompt(1, 32), arrival=clock.now))
    sched.submit(make_request("bad", [1, 2, 1000], arrival=clock.now))
    plan = step(sched, rt, trace)
    assert isinstance(plan.events[0], Failed) and plan.events[0].code == "context_too_long"
    run_until_idle(sched, rt, trace)
    bad = trace.terminal("bad")
    assert isinstance(bad, Failed) and bad.code == "invalid_request"


def test_adapter_slots_bound_each_step() -> None:
    clock, rt, sched, trace = setup(max_adapters_per_step=2, max_num_batched_tokens=64)
    adapters = ["a", "b", "c", None, "d", "e"]
    for i, key in enumerate(adapters * 2):
        sched.submit(make_request(f"r{i}", prompt(i, 5), arrival=clock.now, adapter=key))
    run_until_idle(sched, rt, trace)
    for p in trace.plans:
        assert len(p.adapter_keys) <= 2
    assert sched.stats.max_adapters_in_step == 2
    for i in range(12):
        assert trace.tokens(f"r{i}") == run_alone(prompt(i, 5), 4, 100, None)


class SlowAdapterSlots:
    """Adapters become resident one step after they are asked for."""

    def __init__(self) -> None:
        self.resident: set[str] = {"a"}
        self.loads: list[tuple[str, ...]] = []

    def resident_adapters(self) -> frozenset[str]:
        return frozenset(self.resident)

    def load_adapters(self, wanted, in_use) -> None:
        self.loads.append(tuple(wanted))
        self.resident.update(wanted)


def test_request_for_a_non_resident_adapter_waits_without_blocking_others() -> None:
    clock = SimClock()
    rt = FakeRuntime(clock=clock)
    slots = SlowAdapterSlots()
    sched = Scheduler(rt, BatcherConfig(), clock=clock, adapters=slots)
    trace = Trace()
    sched.submit(
        make_request("needs-b", prompt(1, 5), arrival=clock.now, max_ttft=1.0, adapter="b")
    )
    sched.submit(make_request("on-a", prompt(2, 5), arrival=clock.now, max_ttft=2.0, adapter="a"))
    sched.submit(make_request("base", prompt(3, 5), arrival=clock.now, max_ttft=3.0))
    plan = step(sched, rt, trace)
    assert set(plan.step.num_scheduled_tokens) == {"on-a", "base"}
    assert plan.adapters_to_load == ("b",)
    slots.load_adapters(plan.adapters_to_load, plan.adapter_keys)
    run_until_idle(sched, rt, trace)
    assert isinstance(trace.terminal("needs-b"), Finished)


def test_preemption_under_a_small_cache_keeps_outputs_exact() -> None:
    clock, rt, sched, trace = setup(num_blocks=12, max_num_batched_tokens=32, kv_headroom_blocks=0)
    for i in range(6):
        sched.submit(
            make_request(f"r{i}", prompt(i, 6 + i), arrival=clock.now + i * 1e-3, max_tokens=14)
        )
    run_until_idle(sched, rt, trace)
    assert sched.stats.num_preemptions > 0
    for i in range(6):
        assert trace.tokens(f"r{i}") == run_alone(prompt(i, 6 + i), 14, 100, None)
    rt.check_no_leaks()
    assert not rt.sequences


def test_head_request_preempts_later_deadlines_to_get_in() -> None:
    clock, rt, sched, trace = setup(num_blocks=10, max_num_batched_tokens=64, kv_headroom_blocks=0)
    sched.submit(
        make_request("bulk", prompt(1, 30), arrival=clock.now, max_ttft=100.0, max_tokens=8)
    )
    step(sched, rt, trace)
    sched.submit(make_request("urgent", prompt(2, 20), arrival=clock.now, max_ttft=0.5))
    run_until_idle(sched, rt, trace)
    assert (
        trace.first_token_order[:2] == ["bulk", "urgent"] or trace.first_token_order[0] == "urgent"
    )
    assert isinstance(trace.terminal("urgent"), Finished)
    assert sched.stats.num_preemptions >= 1
    assert trace.tokens("bulk") == run_alone(prompt(1, 30), 8, 100, None)


def test_cancel_waiting_and_running_requests_frees_blocks() -> None:
    clock, rt, sched, trace = setup(max_num_batched_tokens=8)
    sched.submit(make_request("run", prompt(1, 8), arrival=clock.now, max_tokens=50))
    sched.submit(make_request("wait", prompt(2, 8), arrival=clock.now, max_ttft=20.0))
    step(sched, rt, trace)
    assert sched.cancel("run") and sched.cancel("wait")
    assert not sched.cancel("run")  # already asked
    assert not sched.cancel("nope")
    run_until_idle(sched, rt, trace)
    assert isinstance(trace.terminal("run"), Cancelled)
    assert isinstance(trace.terminal("wait"), Cancelled)
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks
    assert not rt.sequences


def test_a_clients_cancel_is_answered_with_the_tokens_so_far() -> None:
    """A client's cancel ends a running request with `done` ("cancelled") carrying the
    tokens it generated, and a queued one the same way with none; no leaks."""
    clock, rt, sched, trace = setup(max_num_batched_tokens=8)
    sched.submit(make_request("run", prompt(1, 8), arrival=clock.now, max_tokens=50))
    sched.submit(make_request("wait", prompt(2, 8), arrival=clock.now, max_ttft=20.0))
    step(sched, rt, trace)
    assert sched.cancel("wait", answer=True)  # still queued behind "run"
    for _ in range(3):
        step(sched, rt, trace)
    assert sched.cancel("run", answer=True)
    run_until_idle(sched, rt, trace)
    ran, queued = trace.terminal("run"), trace.terminal("wait")
    assert isinstance(ran, Finished) and ran.finish_reason == "cancelled"
    assert 1 <= len(ran.token_ids) < 50
    assert isinstance(queued, Finished) and queued.finish_reason == "cancelled"
    assert queued.token_ids == ()
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks
    assert not rt.sequences


def test_step_failure_of_one_request_spares_the_others() -> None:
    clock, rt, sched, trace = setup()
    for i in range(3):
        sched.submit(make_request(f"r{i}", prompt(i, 5), arrival=clock.now))
    rt.fail_seq = "r1"
    run_until_idle(sched, rt, trace)
    err = trace.terminal("r1")
    assert isinstance(err, Failed) and err.code == "internal"
    assert [type(trace.terminal(r)) for r in ("r0", "r2")] == [Finished, Finished]
    rt.check_no_leaks()


def test_transient_step_failure_is_retried_in_isolation() -> None:
    clock, rt, sched, trace = setup(max_num_seqs=2)
    for i in range(4):
        sched.submit(make_request(f"r{i}", prompt(i, 5), arrival=clock.now + i * 1e-3))
    rt.fail_step = True
    run_until_idle(sched, rt, trace)
    ends = {r: type(trace.terminal(r)) for r in ("r0", "r1", "r2", "r3")}
    assert ends == dict.fromkeys(("r0", "r1", "r2", "r3"), Finished)
    assert sched.stats.num_isolated_failures == 1
    assert not rt.sequences


def test_step_failure_without_culprit_finds_the_culprit() -> None:
    clock, rt, sched, trace = setup(max_num_seqs=4)
    for i in range(4):
        sched.submit(make_request(f"r{i}", prompt(i, 5), arrival=clock.now + i * 1e-3))
    rt.poison = "r2"
    run_until_idle(sched, rt, trace)
    ends = {r: type(trace.terminal(r)) for r in ("r0", "r1", "r2", "r3")}
    assert ends == {"r0": Finished, "r1": Finished, "r2": Failed, "r3": Finished}
    assert trace.terminal("r2").code == "internal"
    assert sched.stats.num_isolated_failures >= 1
    assert not rt.sequences


def test_early_timeout_is_a_setting() -> None:
    for early in (False, True):
        cost = CostModel(step_s=0.0, token_s=0.01)  # 100 tokens / s
        clock, rt, sched, trace = setup(cost=cost, early_timeout=early, max_num_batched_tokens=16)
        sched.submit(make_request("warm", prompt(1, 40), arrival=clock.now, max_tokens=1))
        run_until_idle(sched, rt, trace)
        # 200 uncached tokens need ~2 s; the deadline is 1 s away.
        sched.submit(make_request("hopeless", prompt(2, 200), arrival=clock.now, max_ttft=1.0))
        plan = step(sched, rt, trace)
        if early:
            assert isinstance(plan.events[0], Expired) and plan.events[0].early
            assert sched.stats.num_early_timeouts == 1
        else:
            run_until_idle(sched, rt, trace)
            ev = trace.terminal("hopeless")
            assert isinstance(ev, Expired) and not ev.early and ev.waited_ms >= 1000.0


def test_classification_and_duplicates() -> None:
    clock, _rt, sched, _ = setup(bulk_min_ttft=60.0)
    sched.submit(make_request("i", prompt(1, 4), arrival=clock.now, max_ttft=5.0))
    sched.submit(make_request("b", prompt(1, 4), arrival=clock.now, max_ttft=600.0))
    hint = RequestClass.BULK
    sched.submit(
        make_request("h", prompt(1, 4), arrival=clock.now, max_ttft=1.0, request_class=hint)
    )
    classes = [sched.get_state(r).request_class for r in "ibh"]
    assert classes == [RequestClass.INTERACTIVE, RequestClass.BULK, RequestClass.BULK]
    with pytest.raises(DuplicateRequestError):
        sched.submit(make_request("i", prompt(1, 4), arrival=clock.now))
    with pytest.raises(ConfigError):
        BatcherConfig(max_num_batched_tokens=0)
