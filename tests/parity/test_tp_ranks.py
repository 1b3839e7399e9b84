"""Tensor parallelism on the CPU (gloo): biases, tied embeddings, adapter swaps, FP8,
rank failures, process clean-up, `sluice generate --tp` and the tp_check script.

The model has q/k/v and MLP biases (a row-parallel bias must be added once),
tied embeddings and an odd vocabulary.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from gpu_runtime import ModelLoadError, RankFailure, StepPlan
from tests.runtime_support import (
    assert_same_runs,
    checkpoint_with_adapters,
    greedy,
    make_hf_checkpoint,
    make_runtime,
    random_prompts,
    run_mixed,
)

TOL = 1e-4
BIAS = dict(vocab_size=301, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
TP = dict(tp=2, tp_timeout_s=30)


@pytest.fixture(scope="module")
def bias(tmp_path_factory):
    return checkpoint_with_adapters(tmp_path_factory.mktemp("tp-ranks"), "bias", seed=6, **BIAS)


def _swap_heavy(rt, adapters) -> tuple[dict, dict]:
    """Two slots, three adapters of ranks 8, 4, 16: evictions and slot re-widening."""
    for i, adapter_dir in enumerate(adapters):
        rt.register_adapter(f"a{i}", adapter_dir)
    results = {}
    for keys in (["a0", "a1"], ["a2", None], ["a1", "a0"], ["a2", "a1"]):
        prompts = {f"{k}-{i}": list(range(5 + i, 20 + i)) for i, k in enumerate(keys)}
        results.update(run_mixed(rt, prompts, keys)[1])
    assert rt.num_adapter_swaps >= 3
    rt.unregister_adapter("a0")
    return results


def test_bias_tied_odd_vocab_and_adapter_swaps_equal_tp1(bias):
    path, adapters = bias
    cfg = dict(max_adapters=2, max_lora_rank=16)
    with make_runtime(path, **cfg) as rt1:
        expected = _swap_heavy(rt1, adapters)
    with make_runtime(path, **cfg, **TP) as rt2:
        got = _swap_heavy(rt2, adapters)
        base = random_prompts(2, 301)
        with make_runtime(path, max_adapters=0) as rt1:
            base_expected = run_mixed(rt1, base, [None, None])
        assert_same_runs(run_mixed(rt2, base, [None, None]), base_expected)
    for s in expected:
        assert (got[s] - expected[s]).abs().max() <= TOL, s


def test_fp8_tp2_equals_fp8_tp1(bias):
    path, _ = bias
    prompts = random_prompts(2, 301)
    with make_runtime(path, quantization="fp8", max_adapters=0) as rt1:
        expected = run_mixed(rt1, prompts, [None, None])
    with make_runtime(path, quantization="fp8", max_adapters=0, **TP) as rt2:
        assert_same_runs(run_mixed(rt2, prompts, [None, None]), expected)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_killed_rank_raises_rank_failure_without_hanging(bias):
    path, _ = bias
    rt = make_runtime(path, max_adapters=0, **TP)
    try:
        pids = rt.helper_pids
        assert len(pids) == 1 and _alive(pids[0])
        rt.add_sequence("s", list(range(3, 20)), greedy(50))
        rt.execute(StepPlan({"s": 17}))
        os.kill(pids[0], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            rt.execute(StepPlan({"s": 1}))
        assert time.monotonic() - started < 30
        with pytest.raises(RankFailure):  # the replica stays down
            rt.execute(StepPlan({"s": 1}))
    finally:
        rt.close()
    assert not any(_alive(p) for p in pids)


def test_hung_rank_raises_rank_failure_after_the_timeout(bias):
    path, _ = bias
    rt = make_runtime(path, max_adapters=0, tp=2, tp_timeout_s=3)
    try:
        pids = rt.helper_pids
        rt.add_sequence("s", list(range(3, 20)), greedy(50))
        rt.execute(StepPlan({"s": 17}))
        os.kill(pids[0], signal.SIGSTOP)  # alive, but never answers
        started = time.monotonic()
        with pytest.raises(RankFailure, match="timed out"):
            rt.execute(StepPlan({"s": 1}))
        assert 2.5 < time.monotonic() - started < 30
    finally:
        rt.close()
    assert not any(_alive(p) for p in pids)


def test_load_failure_leaves_no_helper_behind(bias, tmp_path):
    path, _ = bias
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    safetensors.torch.save_file({"model.norm.weight": torch.ones(64)}, broken / "model.safetensors")
    before = set(multiprocessing.active_children())
    with pytest.raises(ModelLoadError, match="lacks"):
        make_runtime(broken, max_adapters=0, **TP)
    assert set(multiprocessing.active_children()) <= before
    assert not torch.distributed.is_initialized()


_RANK0 = """
import sys, time
from gpu_runtime import Runtime, RuntimeConfig
rt = Runtime(sys.argv[1], RuntimeConfig(tp=2, kv_cache_len=256, max_adapters=0))
print(*rt.helper_pids, flush=True)
time.sleep(120)
"""


def test_sigterm_of_rank0_takes_the_helpers_down(bias):
    path, _ = bias
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK0, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and _alive(pids[0])
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()


def test_generate_tp2_equals_tp1(tmp_path):
    from cli import app

    runner = CliRunner()
    model = tmp_path / "tiny"
    assert runner.invoke(app, ["models", "make-tiny", str(model), "--adapters", "1"]).exit_code == 0
    args = ["generate", "--model-path", str(model), "--prompt", "Hello world", "--max-tokens", "8"]
    adapter = ["--adapter-path", str(model / "adapters" / "adapter-0")]
    for extra in ([], adapter, ["--quantization", "fp8"]):
        outs = []
        for tp in ("1", "2"):
            res = runner.invoke(app, [*args, *extra, "--tp", tp, "--json", "--seed", "1"])
            assert res.exit_code == 0, res.output
            outs.append(json.loads(res.stdout))
        assert outs[0] == outs[1], extra
    res = runner.invoke(app, [*args, "--tp", "3"])
    assert res.exit_code == 2 and "does not divide" in res.output


def test_tp_check_cpu_gloo_path(capsys):
    from bench.tp_check import main

    assert main(["--device", "cpu", "--tp", "2", "--steps", "5"]) == 0
    assert capsys.readouterr().out.strip().endswith("OK")


def test_sliding_window_tp2_equals_tp1(tmp_path):
    """Qwen2 with a full and a sliding-window layer (window 5; contexts grow to 31 tokens)."""
    path, _ = make_hf_checkpoint(tmp_path, arch="qwen2", seed=8, num_key_value_heads=2,
                                 use_sliding_window=True, sliding_window=5, max_window_layers=1)
    prompts = random_prompts(2, 256)
    with make_runtime(path, max_adapters=0) as rt1:
        assert rt1.model_config.sliding_layers == (False, True)
        expected = run_mixed(rt1, prompts, [None, None])
    with make_runtime(path, max_adapters=0, **TP) as rt2:
        assert_same_runs(run_mixed(rt2, prompts, [None, None]), expected)
