"""Tensor parallelism on the CPU (gloo): shard layout, planner, tp=2 logits equal tp=1.

The model has 3 KV heads under 6 query heads (tp=2 replicates KV heads) and
an odd vocabulary; one tp=2 runtime (two processes, ~3 s to start) is shared
by the checks through a module-scoped fixture. Only one tensor-parallel
runtime can live in a process at a time, so the other tp=2 tests are in
test_tp_ranks.py.
"""

from __future__ import annotations

import pytest
import torch

from gpu_runtime import InsufficientMemoryError, ModelConfig, plan_memory
from gpu_runtime.parallel import ShardLayout, num_local_kv_heads
from gpu_runtime.planner import MemoryRequest, plan_for
from tests.runtime_support import (
    assert_same_runs,
    checkpoint_with_adapters,
    make_runtime,
    random_prompts,
    run_mixed,
    run_to_completion,
)

TOL = 1e-4
KV3 = dict(vocab_size=257, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
TP = dict(tp=2, tp_timeout_s=30)


@pytest.fixture(scope="module")
def kv3(tmp_path_factory):
    return checkpoint_with_adapters(tmp_path_factory.mktemp("tp"), "kv3", seed=5, **KV3)


@pytest.fixture(scope="module")
def kv3_tp2(kv3):
    path, adapters = kv3
    with make_runtime(path, max_lora_rank=16, **TP) as rt:
        for i, adapter_dir in enumerate(adapters):
            rt.register_adapter(f"a{i}", adapter_dir)
        yield rt


def test_shard_layout_replicates_kv_heads_and_splits_odd_vocab():
    kv3 = ModelConfig(257, 96, 128, 2, 6, 3, 16, 512)
    r0, r1 = ShardLayout(kv3, 2, 0), ShardLayout(kv3, 2, 1)
    assert (r0.q_heads, r1.q_heads) == (range(0, 3), range(3, 6))
    assert (r0.kv_heads, r1.kv_heads) == ((0, 0, 1), (1, 2, 2))
    assert (r0.vocab(), r1.vocab()) == (range(0, 128), range(128, 257))
    llama = ModelConfig(1000, 64, 128, 2, 8, 2, 8, 512)
    assert [ShardLayout(llama, 4, r).kv_heads for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert [ShardLayout(llama, 2, r).kv_heads for r in range(2)] == [(0,), (1,)]
    assert num_local_kv_heads(llama, 8) == 1 and num_local_kv_heads(kv3, 3) == 1


def test_kv3_odd_vocab_base_and_adapters_equal_tp1(kv3, kv3_tp2):
    path, adapters = kv3
    assert kv3_tp2.runner.kv_caches[0].shape[-2] == 3  # KV heads (0, 0, 1) on rank 0
    keys = ["a0", "a1", "a2", None]
    prompts = random_prompts(4, 257)
    with make_runtime(path, max_lora_rank=16) as rt1:
        for i, adapter_dir in enumerate(adapters):
            rt1.register_adapter(f"a{i}", adapter_dir)
        expected = run_mixed(rt1, prompts, keys)
    assert_same_runs(run_mixed(kv3_tp2, prompts, keys), expected)
    kv3_tp2.check_invariants()


def test_kv3_chunked_prefill_reuses_cache_across_steps(kv3, kv3_tp2):
    path, _ = kv3
    prompts = {"long": list(range(3, 90)), "short": [7, 8, 9]}
    with make_runtime(path) as rt1:
        expected = run_to_completion(rt1, prompts, chunk=16)
    tokens, logits = run_to_completion(kv3_tp2, prompts, chunk=16)
    assert tokens == expected[0]
    for s in prompts:
        assert (torch.stack(logits[s]) - torch.stack(expected[1][s])).abs().max() <= TOL


def test_planner_per_rank_weights_halve_and_error_names_tp(kv3):
    def weights(config: ModelConfig, tp: int) -> int:
        return plan_for(config, MemoryRequest(torch.float32, 1024, tp=tp), 0).weight_bytes

    def norms(config: ModelConfig) -> int:  # replicated on every rank
        return (2 * config.num_layers + 1) * config.hidden_size * 4

    base = ModelConfig(256, 64, 128, 2, 4, 2, 16, 512)  # tests' default: 2 KV heads
    assert weights(base, 2) == weights(base, 1) / 2 + norms(base) / 2
    config = ModelConfig.from_dir(kv3[0])  # 3 KV heads: each rank holds 3, odd vocab
    one, two = weights(config, 1), weights(config, 2)
    kv_replicated = config.num_layers * 2 * (3 * 16) * 96 * 4 // 2
    vocab_rounding = 2 * (129 - 128.5) * 96 * 4  # the planner counts ceil(257 / 2) rows
    assert two == one / 2 + norms(config) / 2 + kv_replicated + vocab_rounding
    kv = [plan_for(config, MemoryRequest(torch.float32, 1024, tp=tp), 0) for tp in (1, 2)]
    assert kv[0].kv_bytes_per_token == kv[1].kv_bytes_per_token  # (0, 0, 1) and (1, 2, 2)
    big = ModelConfig(32000, 4096, 11008, 32, 32, 8, 128, 4096)  # 6.7e9 parameters
    with pytest.raises(InsufficientMemoryError, match="raise tp to 2"):
        plan_memory(big, MemoryRequest(torch.bfloat16, 8192), available_bytes=12 << 30)
