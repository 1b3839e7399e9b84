"""Turn 2 of a session computes only its new tokens and matches a cold run."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime import StepPlan
from gpu_runtime.tiny import make_tiny_adapters
from tests.runtime_support import greedy, make_hf_checkpoint, make_runtime


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("session"), seed=3)[0]


def _run(rt, seq_id, prompt, adapter_key=None, max_tokens=12):
    cached = rt.add_sequence(seq_id, prompt, greedy(max_tokens), adapter_key=adapter_key)
    computed, tokens, logits = [], [], []
    plan = {seq_id: len(prompt) - cached}
    while seq_id in rt.sequences:
        out = rt.execute(StepPlan(plan, return_logits=True))
        computed.append(out.num_computed_tokens[seq_id])
        tokens.append(out.outputs[0].token_id)
        logits.append(out.logits[seq_id])
        plan = {seq_id: 1}
    return cached, computed, tokens, torch.stack(logits)


def test_turn2_reuses_turn1_and_matches_cold_run(path):
    rt = make_runtime(path)
    turn1 = list(range(3, 40))  # 37 tokens
    cached1, _, gen1, _ = _run(rt, "t1", turn1)
    assert cached1 == 0
    turn2 = turn1 + gen1 + list(range(100, 109))  # 37 + 12 + 9 = 58 tokens
    # Turn 1 computed 37 + 11 tokens (the last sampled token never went through the
    # model): 3 full blocks of 16 are cached.
    assert rt.num_cached_tokens(turn2) == 48
    assert rt.num_cached_tokens(turn2, adapter_key="support-bot") == 0
    cached2, computed2, gen2, logits2 = _run(rt, "t2", turn2)
    assert cached2 == 48
    assert computed2[0] == 58  # the first step computed 10 tokens, from 48 to 58
    assert "t2" not in rt.sequences
    cold = make_runtime(path)
    cached_cold, computed_cold, gen_cold, logits_cold = _run(cold, "c", turn2)
    assert cached_cold == 0 and computed_cold[0] == 58
    assert gen2 == gen_cold
    assert (logits2 - logits_cold).abs().max().item() <= 1e-4
    rt.check_invariants()


def test_adapter_key_isolates_and_preempt_resume_finds_prefix(path, tmp_path):
    rt = make_runtime(path)
    rt.register_adapter("x", make_tiny_adapters(path, tmp_path, 1)[0])  # keys must be registered
    prompt = list(range(3, 53))  # 50 tokens
    rt.add_sequence("a", prompt, greedy(30), adapter_key="x")
    rt.execute(StepPlan({"a": 50}))
    assert rt.num_cached_tokens(prompt, adapter_key="x") == 48
    assert rt.num_cached_tokens(prompt, adapter_key=None) == 0
    seq = rt.get_sequence("a")
    rt.preempt("a")
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    rt.check_invariants()
    # 51 known tokens (50 + 1 sampled); 50 were computed: 3 full blocks come back.
    assert rt.resume("a") == 48
    out = rt.execute(StepPlan({"a": 3}))
    assert out.outputs[0].num_generated_tokens == 2
    rt.remove_sequence("a")
    rt.check_invariants()
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks
