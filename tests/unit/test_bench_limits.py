"""The machine limits `sluice bench cpu` reports beside each engine (rooflines)."""

from __future__ import annotations

import math

import pytest

from bench.cpu_limits import (
    PREFILL_LEN,
    SMOLLM2_LM_HEAD,
    SMOLLM2_PARAMS,
    measure_matmul_peak,
    roofline_tokens_s,
)

GB = 1e9


def test_batch_1_decode_is_bound_by_reading_the_weights() -> None:
    # 4 bytes a weight at 40 GB/s: one step reads 0.538 GB, whatever the peak.
    tok_s = roofline_tokens_s("decode_1", 4.0, 1e15, 40 * GB)
    assert tok_s == pytest.approx(40 * GB / (4.0 * SMOLLM2_PARAMS))
    # Half the bytes a weight (bfloat16): twice the steps.
    assert roofline_tokens_s("decode_1", 2.0, 1e15, 40 * GB) == pytest.approx(2 * tok_s)


def test_a_large_batch_is_bound_by_the_multiply_adds() -> None:
    peak = 200 * GB  # FLOP/s
    tok_s = roofline_tokens_s("decode_256", 4.0, peak, 40 * GB)
    assert tok_s == pytest.approx(peak / (2 * SMOLLM2_PARAMS))
    # More rows than the bandwidth needs never beat the compute limit.
    assert roofline_tokens_s("decode_1024", 4.0, peak, 1e15) == pytest.approx(tok_s)
    # Between the two: the slower of the two limits sets the step.
    small = roofline_tokens_s("decode_8", 4.0, peak, 40 * GB)
    assert small < tok_s and small == pytest.approx(8 * 40 * GB / (4.0 * SMOLLM2_PARAMS))


def test_prefill_counts_attention_and_one_lm_head_row() -> None:
    peak = 200 * GB
    tok_s = roofline_tokens_s("prefill", 4.0, peak, 1e15)
    weights_only = peak / (2 * (SMOLLM2_PARAMS - SMOLLM2_LM_HEAD))
    assert tok_s < weights_only  # attention adds multiply-adds
    assert tok_s > 0.85 * weights_only  # but at 512 tokens far fewer than the weights
    assert PREFILL_LEN == 512


def test_the_matmul_peak_is_measured() -> None:
    peak = measure_matmul_peak("float32")
    assert math.isfinite(peak) and 1e8 < peak < 1e14  # FLOP/s of a real CPU
