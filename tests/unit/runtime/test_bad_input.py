"""Bad requests are rejected at add time and never disturb the other sequences."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_runtime import (
    ContextTooLongError,
    InvalidSequenceError,
    SamplingParams,
    SchedulingError,
    StepPlan,
)
from tests.runtime_support import greedy, make_hf_checkpoint, make_runtime, run_to_completion


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("bad"), seed=5)[0]


def test_rejections_carry_codes_and_leave_others_intact(path):
    good = list(range(3, 30))
    solo_tokens, solo_logits = run_to_completion(make_runtime(path), {"good": good})

    rt = make_runtime(path, kv_cache_len=64, max_model_len=48)
    rt.add_sequence("good", good, greedy())
    rt.execute(StepPlan({"good": 10}))
    with pytest.raises(ContextTooLongError) as err:
        rt.add_sequence("long", list(range(3, 53)), greedy())  # > max_model_len
    assert err.value.code == "context_too_long"
    rt2 = make_runtime(path, kv_cache_len=32)
    with pytest.raises(ContextTooLongError, match="kv_cache_len"):
        rt2.add_sequence("long", list(range(3, 40)), greedy())  # > KV cache
    with pytest.raises(InvalidSequenceError) as err:
        rt.add_sequence("oov", [5, 256, 7], greedy())
    assert err.value.code == "invalid_request"
    for bad in ([-1], []):
        with pytest.raises(InvalidSequenceError):
            rt.add_sequence("x", bad, greedy())
    with pytest.raises(InvalidSequenceError):
        rt.add_sequence("x", [5], SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidSequenceError):
        rt.add_sequence("good", [5], greedy())  # duplicate id
    with pytest.raises(SchedulingError):
        rt.execute(StepPlan({"good": 10, "oov": 3}))  # a bad plan changes nothing
    assert set(rt.sequences) == {"good"}
    rt.check_invariants()

    tokens, logits = [], []
    plan = {"good": 17}
    while rt.sequences:
        out = rt.execute(StepPlan(plan, return_logits=True))
        tokens.append(out.outputs[0].token_id)
        logits.append(out.logits["good"])
        plan = {"good": 1}
    assert tokens == solo_tokens["good"]
    assert (
        max((a - b).abs().max().item() for a, b in zip(logits, solo_logits["good"], strict=True))
        < 1e-4
    )
    rt.check_invariants()
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks


def test_generation_stops_at_context_limit(path):
    """A default max_tokens gets the room left; one asked for that does not fit is
    refused, naming both numbers and the limit — never cut short in silence."""
    rt = make_runtime(path, max_model_len=40)
    default = dataclasses.replace(greedy(100), max_tokens_asked=False)
    tokens, _ = run_to_completion(rt, {"a": list(range(3, 33))}, params=default)
    assert len(tokens["a"]) == 10  # 30 prompt + 10 generated = max_model_len
    with pytest.raises(ContextTooLongError, match=r"30 tokens and max_tokens=100 make 130 "
                       r"tokens, beyond this model's context of 40 tokens") as err:
        rt.add_sequence("b", list(range(3, 33)), greedy(100))
    assert err.value.code == "context_too_long" and not rt.sequences
    rt.add_sequence("c", list(range(3, 33)), greedy(10))  # exactly fits
