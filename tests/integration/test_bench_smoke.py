"""`sluice bench all --quick` end to end (the CI smoke test), and GPU mode's code paths on CPU.

Figures are noisy on shared CI machines: these tests check that every
expected figure is present with a unit, never its value.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bench.harness import is_figure
from cli import bench_cmd

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXPECTED: dict[str, list[str]] = {
    "runtime": [
        "decode_tokens_s.batch_1", "decode_tokens_s.batch_64", "prefill_tokens_s",
        "eager_decode_tokens_s.batch_1", "compile_warmup",
        "baseline_hf_generate.batch_1_one_at_a_time",
        "baseline_hf_generate.batch_8_static_batching",
        "limits.memory_bandwidth", "fraction_of_limit.decode_batch_1_of_bandwidth",
        "ratios.best_decode_over_hf_one_at_a_time",
        "ratios.best_decode_over_hf_static_batching",
    ],
    "adapters": [
        "decode_tokens_s.4_adapters_mixed", "decode_tokens_s.baseline_1_adapter",
        "decode_tokens_s.baseline_base_model", "ratios.4_adapters_over_1_adapter",
        "ratios.4_adapters_over_hf_one_at_a_time", "ratios.4_adapters_over_hf_static_batching",
    ],
    "sessions": [
        "turns.turn_2.ttft.p50", "turns.turn_2.cached_prompt_tokens",
        "turns.turn_2.baseline_cold_same_length_ttft.p50",
        "baseline_cache_off_same_prompt.ttft.p50", "fraction_of_limit.cold_prefill_of_matmul",
        "ratios.turn_2_ttft_over_cold", "ratios.turn_2_ttft_over_cache_off",
    ],
    "deadlines": [
        "edf.throughput", "edf.interactive.ttft_p99", "edf.interactive.timeouts",
        "baseline_fcfs.throughput", "baseline_fcfs.interactive.timeouts",
        "fraction_of_limit.edf_throughput_of_matmul", "ratios.throughput_edf_over_fcfs",
    ],
    "startup": ["import_torch_s", "tiny.eager.first_token_s", "tiny.eager.serving_after_s",
                "tiny.eager.load_s"],
    "overhead": ["batch_1.step_cycle", "batch_1.model_forward", "batch_32.outside_forward_share",
                 "batch_32.runtime_own.sampling_and_stops", "batch_32.engine_loop",
                 "batch_32.event_path_beside_the_step"],
    "kafka": [
        "kafka_ttft.p50", "kafka_ttft.p99", "kafka_end_to_end.p50",
        "baseline_in_process_ttft.p50", "baseline_in_process_end_to_end.p99",
        "added_by_kafka.ttft_p50", "added_by_kafka.ttft_p99", "added_by_kafka.end_to_end_p50",
        "limits.two_hop_floor_p50", "ratios.ttft_p50_kafka_over_in_process",
        "tracing.ratios.ttft_p50_on_over_off", "tracing.ratios.bulk_tokens_s_on_over_off",
        "tracing.spans_exported",
    ],
    "bulk": [
        "kafka_run_batch.requests_per_s", "kafka_run_batch.completion_tokens_per_s",
        "baseline_in_process_engine.requests_per_s",
        "baseline_in_process_engine.completion_tokens_per_s",
        "ratios.tokens_s_kafka_over_in_process",
        "open_loop.kafka_all_produced_up_front.completion_tokens_per_s",
        "open_loop.kafka_auto_window.completion_tokens_per_s",
        "open_loop.kafka_auto_window.peak_in_flight",
        "open_loop.baseline_in_process_all_at_once.completion_tokens_per_s",
        "open_loop.ratios.up_front_over_in_process", "open_loop.ratios.auto_over_in_process",
        "open_loop.kafka_auto_window_worker_process.completion_tokens_per_s",
        "open_loop.ratios.auto_worker_process_over_in_process",
    ],
    "gateway": [
        "gateway_ttft.p50", "gateway_ttft.p99", "gateway_end_to_end.p50",
        "gateway_to_response_headers.p50", "baseline_sdk_ttft.p50",
        "baseline_sdk_end_to_end.p99", "added_by_gateway.ttft_p50",
        "added_by_gateway.ttft_p99", "added_by_gateway.ttft_paired_difference.p50",
        "non_streaming.gateway.p50", "non_streaming.baseline_sdk_complete.p50",
        "non_streaming.added_p50", "checks.answers_differing_from_sdk",
        "limits.http_floor_p50", "ratios.ttft_p50_gateway_over_sdk",
        "tool_calls.forced_tool_call.end_to_end.p50", "tool_calls.plain_chat.end_to_end.p50",
        "tool_calls.calls_not_fitting_the_schema",
    ],
}
GOALS = {"runtime", "sessions", "deadlines", "overhead", "kafka", "bulk", "gateway"}


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # a group, so the command is `bench`, as under `sluice`
        pass

    bench_cmd.register(app)
    return app


def _lookup(node: dict, path: str) -> object:
    for part in path.split("."):
        assert isinstance(node, dict) and part in node, f"missing {path!r} at {part!r}"
        node = node[part]
    return node


def test_bench_all_quick_writes_every_figure(endpoints, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", endpoints.kafka_bootstrap)
    monkeypatch.setenv("SLUICE_DATABASE_URL", endpoints.database_url)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(_app(), ["bench", "all", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    doc = json.loads(out.read_text())
    assert doc["scenario"] == "all" and doc["quick"] is True
    assert {"cpu_model", "cores", "torch_version", "device"} <= set(doc["machine"])
    assert set(doc["results"]) == set(EXPECTED) == set(doc["model_shape"])
    for scenario, paths in EXPECTED.items():
        results = doc["results"][scenario]
        if scenario == "adapters" and not results["available"]:
            assert "not" in results["note"]
            continue
        for path in paths:
            assert is_figure(_lookup(results, path)), (scenario, path)
        if scenario in GOALS:
            assert results["goals"] and all("met" in g for g in results["goals"].values())
    assert "goals" in result.output  # the rich table was printed


def test_gpu_mode_runs_on_cpu_with_a_tiny_shape(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    result = CliRunner().invoke(_app(), ["bench", "gpu", "--tiny", "--device", "cpu",
                                         "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    results = json.loads(out.read_text())["results"]
    for dtype in ("float32", "fp8"):
        for path in ("decode_tokens_s.batch_1", "decode_tokens_s.batch_256", "prefill_tokens_s",
                     "fraction_of_limit.batch_1_of_hbm_spec_4_8_tb_s"):
            assert is_figure(_lookup(results[dtype], path)), (dtype, path)
    assert is_figure(_lookup(results, "adapters.ratios.4_adapters_over_1_adapter"))
    assert is_figure(_lookup(results, "limits.measured_bandwidth"))


def test_bench_bulk_serves_the_real_model_when_asked(endpoints, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model smollm2`: the broker scenarios serve the bundled SmolLM2, not the tiny model."""
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", endpoints.kafka_bootstrap)
    monkeypatch.setenv("SLUICE_DATABASE_URL", endpoints.database_url)
    out = tmp_path / "bulk.json"
    result = CliRunner().invoke(_app(), ["bench", "bulk", "--quick", "--model", "smollm2",
                                         "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    doc = json.loads(out.read_text())
    assert "SmolLM2" in doc["model_shape"]["bulk"]
    for path in EXPECTED["bulk"]:
        assert is_figure(_lookup(doc["results"]["bulk"], path)), path
    tokens = _lookup(doc["results"]["bulk"], "open_loop.kafka_auto_window.completion_tokens")
    assert tokens["value"] > 0


def test_bench_refuses_an_unknown_model() -> None:
    result = CliRunner().invoke(_app(), ["bench", "bulk", "--model", "gpt-5"])
    assert result.exit_code == 2
    assert "--model must be tiny or smollm2" in result.output


@pytest.mark.parametrize(("kinds", "said"), [
    ("bogus", "unknown fault kinds ['bogus']"),
    ("lossy_links", "need a networked run"),
    (" , ", "names no kind"),
])
def test_bench_chaos_refuses_kinds_it_cannot_make(kinds: str, said: str) -> None:
    """`--kinds` narrows the nemesis (e.g. leader isolations alone); a kind it does not
    know, or a network kind without `--networked`, is refused before anything starts."""
    result = CliRunner().invoke(_app(), ["bench", "chaos", "--kinds", kinds])
    assert result.exit_code == 2
    assert said in result.output and "known: " in result.output
