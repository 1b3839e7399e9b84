"""Sampling: filters, seeds independent of the batch, stop ids, stop strings, max_tokens."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime import SamplingParams
from gpu_runtime.sampling import make_batch, sample
from gpu_runtime.tiny import TinySpec, make_tiny_model
from tests.runtime_support import make_runtime, run_to_completion


def _batch(temps, ks, ps, gens=None):
    gens = gens or [None] * len(temps)
    return make_batch(temps, ks, ps, gens, torch.device("cpu"))


def test_filters_and_greedy_rows():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]] * 4)
    batch = _batch([0.0, 1.0, 1.0, 5.0], [0, 1, 0, 2], [1.0, 1.0, 0.01, 1.0])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = sample(logits, batch, gen).tolist()
        assert ids[0] == 1  # greedy
        assert ids[1] == 1  # top-k 1
        assert ids[2] == 1  # top-p tiny keeps only the best token
        assert ids[3] in (1, 2)  # top-k 2 at a high temperature


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]])).repeat(4000, 1)
    batch = _batch([1.0] * 4000, [0] * 4000, [1.0] * 4000)
    counts = torch.bincount(sample(logits, batch, torch.Generator().manual_seed(1)), minlength=3)
    assert torch.allclose(counts / 4000, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(seed=1))


def test_seeded_request_is_independent_of_batch(tiny):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = list(range(10, 30))
    alone, _ = run_to_completion(make_runtime(tiny), {"s": prompt}, params=params)
    rt = make_runtime(tiny)
    others = {f"o{i}": list(range(5 + i, 20 + 2 * i)) for i in range(5)}
    unseeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    for sid, p in others.items():
        rt.add_sequence(sid, p, unseeded)
    mixed, _ = run_to_completion(rt, {"s": prompt}, chunk=7, params=params)
    assert mixed["s"] == alone["s"]


def test_stop_token_stop_string_and_length(tiny):
    rt = make_runtime(tiny)
    prompt = rt.tokenizer.encode("Hello world").ids
    free, _ = run_to_completion(
        rt, {"a": prompt}, params=SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert len(free["a"]) == 8
    stop_id = free["a"][3]
    out = _finish(
        rt, prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop_id,), ignore_eos=True)
    )
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.num_generated_tokens == free["a"].index(stop_id) + 1
    text = rt.tokenizer.decode(free["a"][:5])
    stop = text[-2:] if text.strip() else None
    if stop:
        out = _finish(rt, prompt, SamplingParams(max_tokens=8, stop=(stop,), ignore_eos=True))
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.num_generated_tokens <= 5
    out = _finish(rt, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert (out.finish_reason, out.num_generated_tokens) == ("length", 3)


def test_eos_from_generation_config_stops(tiny):
    rt = make_runtime(tiny)
    eos = rt.model_config.eos_token_ids
    assert eos == (rt.tokenizer.token_to_id("</s>"),)
    assert rt.add_sequence("e", [5, 6], SamplingParams()) == 0
    assert rt.get_sequence("e").stop_token_ids == frozenset(eos)


def _finish(rt, prompt, params):
    from gpu_runtime import StepPlan

    rt.add_sequence("f", prompt, params)
    plan = {"f": len(prompt)}
    while True:
        out = rt.execute(StepPlan(plan)).outputs[0]
        if out.finished:
            return out
        plan = {"f": 1}
