"""Multi-LoRA batching on a tiny model: mixed steps, LRU slot swaps, KV isolation, FP8."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime import SchedulingError, StepPlan
from gpu_runtime.tiny import make_tiny_adapters, make_tiny_model
from tests.runtime_support import greedy, make_runtime, run_to_completion

MIX_TOL = 1e-5  # same math, different matmul shapes: float32 rounding only


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tiny")
    model = make_tiny_model(root / "model")
    return model, make_tiny_adapters(model, root / "adapters", 6)


def _runtime(tiny, num_adapters: int = 6, **overrides):
    model, adapter_dirs = tiny
    rt = make_runtime(model, kv_cache_len=2048, max_lora_rank=16, **overrides)
    for d in adapter_dirs[:num_adapters]:
        rt.register_adapter(d.name, d)
    return rt


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _drive(rt, work: dict[str, tuple[list[int], str | None]], max_tokens: int = 5):
    """Add all, step with 16-token prefill chunks; returns seq -> stacked sampled logits."""
    for seq_id, (prompt, key) in work.items():
        rt.add_sequence(seq_id, prompt, greedy(max_tokens), adapter_key=key)
    logits = {s: [] for s in work}
    mixed = 0
    while rt.sequences:
        plan = {s: min(16, q.num_uncomputed) for s, q in rt.sequences.items()}
        mixed += 1 in plan.values() and any(n > 1 for n in plan.values())
        out = rt.execute(StepPlan(plan, return_logits=True))
        for o in out.outputs:
            logits[o.seq_id].append(out.logits[o.seq_id])
    return {s: torch.stack(v) for s, v in logits.items()}, mixed


def test_mixed_step_rows_equal_rows_run_alone(tiny):
    keys = ["adapter-0", "adapter-1", "adapter-2", "adapter-3", None]
    work = {}
    for i, key in enumerate(keys):
        work[f"dec{i}"] = (_prompt(4, i), key)  # decoding while the long ones prefill
        work[f"pre{i}"] = (_prompt(40, 10 + i), key)
    rt = _runtime(tiny, 4)
    together, mixed = _drive(rt, work)
    assert mixed >= 2
    alone_rt = _runtime(tiny, 4)
    for seq_id, item in work.items():
        alone, _ = _drive(alone_rt, {seq_id: item})
        diff = (together[seq_id] - alone[seq_id]).abs().max().item()
        assert diff <= MIX_TOL, f"{seq_id}: {diff}"
    # Each adapter changes its rows.
    assert (together["pre0"] - together["pre4"]).abs().max() > 1e-3


def test_six_adapters_four_slots_swap_in_lru_order(tiny):
    names = [d.name for d in tiny[1]]
    work = {f"s{i}": (_prompt(6 + i, 50 + i), names[i % 6]) for i in range(12)}
    reference, _ = _drive(_runtime(tiny, 6, max_adapters=6), work)
    rt = _runtime(tiny, 6, max_adapters=4)
    assert rt.adapters.resident_adapters() == frozenset()
    for seq_id, (prompt, key) in work.items():
        rt.add_sequence(seq_id, prompt, greedy(5), adapter_key=key)
    logits = {s: [] for s in work}
    while rt.sequences:
        # Like the batcher: at most 4 adapters per step, loaded between steps.
        wanted = list(dict.fromkeys(rt.sequences[s].adapter_key for s in rt.sequences))[:4]
        rt.adapters.load_adapters(wanted, frozenset())
        assert set(wanted) <= rt.adapters.resident_adapters()
        plan = {s: q.num_uncomputed for s, q in rt.sequences.items() if q.adapter_key in wanted}
        out = rt.execute(StepPlan(plan, return_logits=True))
        for o in out.outputs:
            logits[o.seq_id].append(out.logits[o.seq_id])
    for seq_id in work:
        diff = (torch.stack(logits[seq_id]) - reference[seq_id]).abs().max().item()
        assert diff <= MIX_TOL, f"{seq_id}: {diff}"
    assert rt.num_adapter_swaps >= 2
    assert rt.adapters.num_adapter_loads == 4 + rt.num_adapter_swaps


def test_lru_victim_and_step_limits(tiny):
    rt = _runtime(tiny, 6, max_adapters=2)
    rt.adapters.load_adapters(["adapter-0", "adapter-1"], frozenset())
    rt.add_sequence("a", [5, 6], greedy(3), adapter_key="adapter-0")
    rt.execute(StepPlan({"a": 2}))  # adapter-0 is now the most recently used
    rt.adapters.load_adapters(["adapter-2"], frozenset())
    assert rt.adapters.slots == ["adapter-0", "adapter-2"]
    assert rt.num_adapter_swaps == 1
    rt.adapters.load_adapters(["adapter-3"], frozenset({"adapter-0", "adapter-2"}))
    assert rt.adapters.slots == ["adapter-0", "adapter-2"]  # nothing evictable: waits
    for i, key in enumerate(["adapter-3", "adapter-4"]):
        rt.add_sequence(f"b{i}", [7, 8], greedy(3), adapter_key=key)
    with pytest.raises(SchedulingError, match="3 adapters; there are 2 slots"):
        rt.execute(StepPlan({"a": 1, "b0": 2, "b1": 2}))
    rt.execute(StepPlan({"b0": 2, "b1": 2}))  # a direct caller: execute swaps them in
    assert rt.adapters.resident_adapters() == {"adapter-3", "adapter-4"}


def test_same_prefix_under_two_adapters_never_shares_blocks(tiny):
    rt = _runtime(tiny, 2)
    prompt = _prompt(33, 7)  # two full blocks + 1 token
    tables = {}
    for i, key in enumerate(["adapter-0", "adapter-1", None]):
        assert rt.add_sequence(f"r{i}", prompt, greedy(2), adapter_key=key) == 0
        tables[key] = list(rt.get_sequence(f"r{i}").block_table)
    rt.execute(StepPlan({f"r{i}": 33 for i in range(3)}))
    assert rt.get_sequence("r0").block_table == [0, 1, 2]
    assert rt.get_sequence("r1").block_table == [3, 4, 5]
    assert rt.get_sequence("r2").block_table == [6, 7, 8]
    for i in range(3):
        rt.remove_sequence(f"r{i}")
    # A second turn finds exactly its own adapter's blocks.
    for i, key in enumerate(["adapter-0", "adapter-1", None]):
        assert rt.add_sequence(f"t{i}", prompt, greedy(2), adapter_key=key) == 32
        assert rt.get_sequence(f"t{i}").block_table == [3 * i, 3 * i + 1]
    assert rt.num_cached_tokens(prompt, "adapter-2") == 0
    rt.check_invariants()


def test_fp8_base_with_lora_runs_and_is_close(tiny):
    work = {f"s{i}": (_prompt(20, 90 + i), f"adapter-{i}") for i in range(3)}
    work["base"] = (_prompt(20, 99), None)
    ref, _ = _drive(_runtime(tiny, 3), work, max_tokens=1)
    got, _ = _drive(_runtime(tiny, 3, quantization="fp8"), work, max_tokens=1)
    for seq_id in work:
        centered = ref[seq_id] - ref[seq_id].mean(-1, keepdim=True)
        rel = ((got[seq_id] - ref[seq_id]).norm() / centered.norm()).item()
        assert rel <= 0.1, (seq_id, rel)
    # The delta is applied on top of FP8: adapter rows differ from the base row's model.
    assert (got["s0"] - ref["base"]).abs().max() > 1e-3


def test_unknown_adapter_and_unregister_in_use(tiny):
    from gpu_runtime import InvalidSequenceError
    from gpu_runtime.errors import AdapterError

    rt = _runtime(tiny, 1)
    with pytest.raises(InvalidSequenceError, match="not registered"):
        rt.add_sequence("x", [5, 6], greedy(1), adapter_key="nope")
    with pytest.raises(AdapterError, match="already registered"):
        rt.register_adapter("adapter-0", tiny[1][0])
    rt.add_sequence("x", [5, 6], greedy(1), adapter_key="adapter-0")
    with pytest.raises(AdapterError, match="in use"):
        rt.unregister_adapter("adapter-0")
    run_to_completion(rt, {}, chunk=4)  # finishes "x"
    assert rt.unregister_adapter("adapter-0") and not rt.unregister_adapter("adapter-0")
    assert rt.adapters.resident_adapters() == frozenset()
