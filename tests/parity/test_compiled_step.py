"""The compiled decode step (`torch.compile`, inductor) against Hugging Face and eager.

Compiled steps must give HF's logits and greedy tokens like eager ones do, on
the attention variants (GQA, a sliding window on every layer, a window on one
layer of two), with prefill and mixed steps eager and all-decode steps compiled
in one runtime; FP8 compiled equals FP8 eager; a compiler failure leaves the
runtime serving eagerly with the same answers, said in the log.
"""

from __future__ import annotations

import logging

import pytest
import torch

from gpu_runtime.compiled import CompiledStep
from tests.runtime_support import (
    assert_ragged_run_matches_hf,
    make_hf_checkpoint,
    make_runtime,
    ragged_run,
)

pytestmark = pytest.mark.slow

TOL = 1e-4
VARIANTS = {
    "gqa": {},
    "mistral_window": dict(arch="mistral", sliding_window=7),
    "qwen2_mixed_window": dict(arch="qwen2", num_key_value_heads=1, use_sliding_window=True,
                               sliding_window=5, max_window_layers=1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_decode_matches_hf(variant, tmp_path):
    path, hf = make_hf_checkpoint(tmp_path, seed=7, **VARIANTS[variant])
    rt = make_runtime(path, compile=True)
    assert rt.warm_up() > 0
    assert rt.runner.compiled.compiled_steps == 2  # the warm-up's graphs, on scratch
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks
    run = ragged_run(rt)
    assert rt.compile_failure is None
    assert rt.runner.compiled.compiled_steps > 2 + 10  # the all-decode steps
    assert_ragged_run_matches_hf(hf, run, TOL)
    assert rt.block_manager.num_free_blocks == rt.block_manager.num_blocks


def test_fp8_compiled_equals_fp8_eager(tmp_path):
    path, _ = make_hf_checkpoint(tmp_path, seed=3)
    eager = ragged_run(make_runtime(path, quantization="fp8"))
    rt = make_runtime(path, quantization="fp8", compile=True)
    assert rt.warm_up() is not None
    compiled = ragged_run(rt)
    assert rt.compile_failure is None and rt.runner.compiled.compiled_steps > 10
    assert compiled[0] == eager[0]
    for s in eager[1]:
        diff = (torch.stack(compiled[1][s]) - torch.stack(eager[1][s])).abs().max().item()
        assert diff <= TOL, f"{s}: max abs diff {diff}"


def test_steps_stay_eager_until_the_warm_up_has_compiled(tmp_path):
    """Nothing compiles on a live step: before `warm_up` every step is eager."""
    path, _ = make_hf_checkpoint(tmp_path, seed=5)
    expected = ragged_run(make_runtime(path))
    rt = make_runtime(path, compile=True)
    got = ragged_run(rt)
    assert got[0] == expected[0]
    assert rt.runner.compiled.compiled_steps == 0 and not rt.compiled_ready


def test_a_compiler_failure_at_warm_up_leaves_eager_steps_and_says_so(tmp_path, caplog):
    path, _ = make_hf_checkpoint(tmp_path, seed=5)
    expected = ragged_run(make_runtime(path))

    def broken_backend(graph, example_inputs):
        raise RuntimeError("this compiler is broken")

    rt = make_runtime(path, compile=True)
    rt.runner.compiled = rt.runner.step = CompiledStep(rt.model.forward, backend=broken_backend)
    with caplog.at_level(logging.ERROR, logger="gpu_runtime.compiled"):
        assert rt.warm_up() is None
        got = ragged_run(rt)
    assert got[0] == expected[0]
    assert "this compiler is broken" in rt.compile_failure and not rt.compiled_ready
    assert rt.runner.compiled.compiled_steps == 0
    assert any("steps eagerly from now on" in r.getMessage() and r.exc_info
               for r in caplog.records)


def test_a_compiled_step_that_fails_live_is_recomputed_eagerly(tmp_path, caplog):
    path, _ = make_hf_checkpoint(tmp_path, seed=5)
    expected = ragged_run(make_runtime(path))
    calls = []

    def failing_later(graph, example_inputs):
        def run(*args):
            calls.append(1)
            if len(calls) > 4:  # the warm-up's two graphs and two live steps work
                raise RuntimeError("this compiled graph broke")
            return graph(*args)
        return run

    rt = make_runtime(path, compile=True)
    rt.runner.compiled = rt.runner.step = CompiledStep(rt.model.forward, backend=failing_later)
    assert rt.warm_up() is not None
    with caplog.at_level(logging.ERROR, logger="gpu_runtime.compiled"):
        got = ragged_run(rt)
    assert got[0] == expected[0]  # every token served, the failed step recomputed eagerly
    assert "this compiled graph broke" in rt.compile_failure
    assert rt.runner.compiled.compiled_steps == 4
    assert any("steps eagerly from now on" in r.getMessage() and r.exc_info
               for r in caplog.records)
