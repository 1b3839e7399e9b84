"""Log probabilities: the runtime's own log-softmax of the logits it sampled from."""

from __future__ import annotations

import dataclasses

import torch

from gpu_runtime import SamplingParams, StepPlan
from tests.runtime_support import make_hf_checkpoint, make_runtime


def test_logprobs_are_the_log_softmax_of_the_sampled_rows(tmp_path) -> None:
    path = make_hf_checkpoint(tmp_path, seed=3)[0]
    rt = make_runtime(path)
    asked = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=1, logprobs=3)
    rt.add_sequence("asked", list(range(3, 20)), asked)
    rt.add_sequence("plain", list(range(5, 15)), dataclasses.replace(asked, logprobs=None))
    plan = {"asked": 17, "plain": 10}
    checked = 0
    while rt.sequences:
        out = rt.execute(StepPlan(plan, return_logits=True))
        for o in out.outputs:
            if o.seq_id == "plain":
                assert o.logprob is None and o.top_logprobs == ()
                continue
            logp = torch.log_softmax(out.logits["asked"].float(), dim=-1)
            assert abs(o.logprob - logp[o.token_id].item()) < 1e-5
            values, ids = logp.topk(3)
            assert [t for t, _ in o.top_logprobs] == ids.tolist()
            assert all(abs(v - w) < 1e-5 for (_, v), w in zip(o.top_logprobs, values.tolist(),
                                                              strict=True))
            checked += 1
        plan = {s: 1 for s in rt.sequences}
    assert checked == 6
