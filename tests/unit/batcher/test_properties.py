"""Property: whatever arrives, every request ends exactly once and nothing leaks."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from batcher.config import BatcherConfig, OrderingPolicy
from batcher.scheduler import Scheduler
from batcher.types import TERMINAL_EVENT_TYPES, Expired, Finished, Tokens
from tests.unit.batcher.fake_runtime import CostModel, FakeRuntime, SimClock, run_alone
from tests.unit.batcher.sim import Trace, make_request, step

VOCAB, EOS = 100, 7

request_spec = st.fixed_dictionaries(
    {
        "at_step": st.integers(0, 8),
        "prefix": st.sampled_from([(), (1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9)]),
        "length": st.integers(1, 40),
        "max_tokens": st.integers(1, 24),
        "max_ttft": st.sampled_from([0.02, 0.1, 0.5, 2.0, 1000.0]),
        "adapter": st.sampled_from([None, "a", "b", "c", "d"]),
        "cancel_after": st.one_of(st.none(), st.integers(0, 20)),
    }
)

config_spec = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(6, 24),
        "max_num_batched_tokens": st.integers(4, 64),
        "max_num_seqs": st.integers(1, 8),
        "max_adapters_per_step": st.integers(1, 3),
        "kv_headroom_blocks": st.integers(0, 3),
        "ordering": st.sampled_from(list(OrderingPolicy)),
        "early_timeout": st.booleans(),
    }
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=2, max_size=40), cfg=config_spec)
def test_every_request_ends_exactly_once_without_leaks(specs: list[dict], cfg: dict) -> None:
    clock = SimClock()
    num_blocks = cfg.pop("num_blocks")
    rt = FakeRuntime(
        num_blocks, 4, clock=clock, cost=CostModel(0.005, 0.0002), vocab=VOCAB, eos=EOS
    )
    config = BatcherConfig(bulk_min_ttft=100.0, **cfg)
    sched = Scheduler(rt, config, clock=clock)
    trace = Trace()
    prompts = {}
    for i, spec in enumerate(specs):
        prompts[f"r{i}"] = (
            *spec["prefix"],
            *[(i * 13 + j * 5) % VOCAB for j in range(spec["length"])],
        )
    submitted: set[int] = set()
    for n in range(5000):
        for i, spec in enumerate(specs):
            rid = f"r{i}"
            if spec["at_step"] == n:
                sched.submit(
                    make_request(
                        rid, prompts[rid], arrival=clock.now, max_ttft=spec["max_ttft"],
                        max_tokens=spec["max_tokens"], adapter=spec["adapter"],
                    )
                )  # fmt: skip
                submitted.add(i)
            if spec["cancel_after"] is not None and spec["at_step"] + spec["cancel_after"] == n:
                sched.cancel(rid)
        plan = step(sched, rt, trace)
        assert len(plan.adapter_keys) <= config.max_adapters_per_step
        adapters = {prompts_adapter for prompts_adapter in _adapters_of(plan, specs)}
        assert len(adapters - {None}) <= config.max_adapters_per_step
        rt.check_no_leaks()
        if len(submitted) == len(specs) and not sched.has_work():
            break
    else:
        raise AssertionError("did not finish")

    event(f"preempted: {sched.stats.num_preemptions > 0}")
    for kind in {type(e).__name__ for e in trace.events}:
        event(f"saw {kind}")
    assert not rt.sequences
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks
    for i, spec in enumerate(specs):
        rid = f"r{i}"
        events = trace.by_request[rid]
        ends = [e for e in events if isinstance(e, TERMINAL_EVENT_TYPES)]
        assert len(ends) == 1, (rid, events)
        assert events[-1] is ends[0]
        tokens = trace.tokens(rid)
        expected = run_alone(prompts[rid], spec["max_tokens"], VOCAB, EOS, num_blocks * 4)
        assert tokens == expected[: len(tokens)]
        if isinstance(ends[0], Finished):
            assert tokens == expected == list(ends[0].token_ids)
        if isinstance(ends[0], Expired):
            assert not any(isinstance(e, Tokens) for e in events)


def _adapters_of(plan, specs):
    if plan.step is None:
        return set()
    return {specs[int(rid[1:])]["adapter"] for rid in plan.step.num_scheduled_tokens}
