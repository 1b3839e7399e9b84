"""The quick benchmark runs end to end and says it is the quick one."""

from __future__ import annotations

import time

import pytest

from bench.runtime_bench import bench_runtime


@pytest.mark.slow
def test_bench_quick_mode_is_quick():
    start = time.perf_counter()
    result = bench_runtime("cpu", quick=True)
    assert time.perf_counter() - start < 60
    assert result["quick"] is True and "quick mode" in result["note"]
    assert set(result["decode_tokens_s"]) == {1, 8, 32, 64}
    assert all(v > 0 for v in result["decode_tokens_s"].values())
    assert result["prefill_tokens_s"] > 0 and result["memory_bandwidth_gb_s"] > 0


@pytest.mark.slow
def test_bench_adapters_quick_mode():
    from bench.runtime_bench import bench_adapters

    result = bench_adapters("cpu", quick=True)
    assert result["quick"] is True and "quick mode" in result["note"]
    assert set(result["decode_tokens_s"]) == {"base", "1_adapter", "4_adapters"}
    assert all(v > 0 for v in result["decode_tokens_s"].values())
