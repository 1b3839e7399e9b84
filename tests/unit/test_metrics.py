"""WorkerMetrics: exact values in a private registry, and the HTTP endpoint."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from worker.metrics import WorkerMetrics, start_http_server

LABELS = {"model": "tiny", "pool": "pool-1"}


@pytest.fixture
def metrics() -> WorkerMetrics:
    return WorkerMetrics("tiny", "pool-1")


def value(m: WorkerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {**LABELS, **labels})


def test_private_registry_is_not_the_global_one(metrics: WorkerMetrics) -> None:
    other = WorkerMetrics("tiny", "pool-1")  # same names twice: no duplicate error
    metrics.add_generated_tokens(3)
    assert metrics.registry is not REGISTRY
    assert value(other, "sluice_generated_tokens_total") == 0
    assert REGISTRY.get_sample_value("sluice_generated_tokens_total", LABELS) is None


def test_gauges(metrics: WorkerMetrics) -> None:
    metrics.set_queue(7, 3)
    metrics.set_kv(num_used_blocks=40, num_free_blocks=216)
    metrics.set_queue(5, 4)
    assert value(metrics, "sluice_requests_waiting") == 5
    assert value(metrics, "sluice_requests_running") == 4
    assert value(metrics, "sluice_kv_blocks_used") == 40
    assert value(metrics, "sluice_kv_blocks_free") == 216


def test_steps_and_tokens(metrics: WorkerMetrics) -> None:
    metrics.observe_step(num_seqs=3, num_tokens=100, seconds=0.02)
    metrics.observe_step(num_seqs=8, num_tokens=8)
    metrics.add_generated_tokens(8)
    metrics.add_generated_tokens(3)
    assert value(metrics, "sluice_batch_sequences_count") == 2
    assert value(metrics, "sluice_batch_sequences_sum") == 11
    assert value(metrics, "sluice_batch_sequences_bucket", le="4.0") == 1
    assert value(metrics, "sluice_batch_tokens_sum") == 108
    assert value(metrics, "sluice_batch_tokens_bucket", le="16.0") == 1
    assert value(metrics, "sluice_step_seconds_count") == 1
    assert value(metrics, "sluice_generated_tokens_total") == 11


def test_latencies(metrics: WorkerMetrics) -> None:
    metrics.observe_ttft(0.004)
    metrics.observe_ttft(42.0)
    metrics.observe_inter_token(0.0008)
    metrics.observe_inter_token(-1.0)  # clock skew never makes a negative sample
    assert value(metrics, "sluice_ttft_seconds_count") == 2
    assert value(metrics, "sluice_ttft_seconds_bucket", le="0.005") == 1
    assert value(metrics, "sluice_ttft_seconds_bucket", le="60.0") == 2
    assert value(metrics, "sluice_inter_token_seconds_bucket", le="0.001") == 2
    assert value(metrics, "sluice_inter_token_seconds_sum") == pytest.approx(0.0008)


def test_end_to_end_and_max_ttft(metrics: WorkerMetrics) -> None:
    assert value(metrics, "sluice_max_ttft_seconds") is None  # unknown until placed
    metrics.set_max_ttft(60.0)
    metrics.set_max_ttft(0.25)
    metrics.observe_end_to_end(0.3)
    metrics.observe_end_to_end(-0.1)
    assert value(metrics, "sluice_max_ttft_seconds") == 0.25
    assert value(metrics, "sluice_request_seconds_count") == 2
    assert value(metrics, "sluice_request_seconds_bucket", le="0.001") == 1
    assert value(metrics, "sluice_request_seconds_bucket", le="0.25") == 1
    assert value(metrics, "sluice_request_seconds_bucket", le="0.5") == 2


def test_adapters(metrics: WorkerMetrics) -> None:
    metrics.set_adapters(num_loaded=5, num_slots_used=3, num_slots=4)
    assert value(metrics, "sluice_adapters_loaded") == 5
    assert value(metrics, "sluice_adapter_slots_used") == 3
    assert value(metrics, "sluice_adapter_slots") == 4


def test_status_is_one_series_per_status(metrics: WorkerMetrics) -> None:
    def statuses() -> dict[str, float]:
        return {s: v for s in ("warming", "waiting", "serving", "serving (compiled)", "idle",
                               "stopping") if (v := value(metrics, "sluice_worker_status",
                                                          status=s)) is not None}

    assert statuses() == {"warming": 1, "waiting": 0, "serving": 0, "serving (compiled)": 0,
                          "idle": 0, "stopping": 0}
    metrics.set_status("serving (compiled)")
    assert [s for s, v in statuses().items() if v == 1] == ["serving (compiled)"]
    metrics.set_status("waiting (the database is away)")  # free text is not a label
    assert [s for s, v in statuses().items() if v == 1] == ["waiting"]
    metrics.set_status("draining")  # a status added later: a series of its own
    assert value(metrics, "sluice_worker_status", status="draining") == 1
    assert value(metrics, "sluice_worker_status", status="waiting") == 0


def test_cache_hit_counters(metrics: WorkerMetrics) -> None:
    metrics.observe_prompt(120, 96)
    metrics.observe_prompt(30, 0)
    assert value(metrics, "sluice_prompt_tokens_total") == 150
    assert value(metrics, "sluice_cached_prompt_tokens_total") == 96


def test_terminals_errors_timeouts(metrics: WorkerMetrics) -> None:
    assert value(metrics, "sluice_requests_total", type="timeout") == 0  # pre-initialised
    assert value(metrics, "sluice_request_errors_total", code="overloaded") == 0
    metrics.observe_terminal("done")
    metrics.observe_terminal("done")
    metrics.observe_terminal("error", "unauthorized")
    metrics.observe_terminal("error")
    metrics.observe_terminal("timeout")
    metrics.observe_dead_letter()
    metrics.add_adapter_swaps(2)
    assert value(metrics, "sluice_requests_total", type="done") == 2
    assert value(metrics, "sluice_requests_total", type="error") == 2
    assert value(metrics, "sluice_requests_total", type="timeout") == 1
    assert value(metrics, "sluice_request_errors_total", code="unauthorized") == 1
    assert value(metrics, "sluice_request_errors_total", code="internal") == 1
    assert value(metrics, "sluice_request_timeouts_total") == 1
    assert value(metrics, "sluice_dead_lettered_records_total") == 1
    assert value(metrics, "sluice_adapter_swaps_total") == 2
    with pytest.raises(ValueError, match="unknown terminal"):
        metrics.observe_terminal("cancelled")  # type: ignore[arg-type]


def test_lag_per_partition(metrics: WorkerMetrics) -> None:
    metrics.set_lag(0, 12)
    metrics.set_lag(3, 0)
    metrics.set_lag(0, 5)
    assert value(metrics, "sluice_consumer_lag", partition="0") == 5
    assert value(metrics, "sluice_consumer_lag", partition="3") == 0
    metrics.forget_partition(3)
    metrics.forget_partition(9)  # never set: no error
    assert value(metrics, "sluice_consumer_lag", partition="3") is None


def test_lag_of_a_paused_partition_comes_from_the_broker() -> None:
    """A paused partition's highwater stands still while records arrive: its end offset
    (asked of the broker) counts instead; a partition with no known end is left out."""
    from aiokafka import TopicPartition

    from worker.gauges import partition_lags

    tp0, tp1, tp2, tp3 = (TopicPartition("t", i) for i in range(4))
    highwater = {tp0: 10, tp1: 10, tp2: None, tp3: 7}
    points = {tp0: (4, "h=9"), tp1: (4, "h=9"), tp3: None}
    lags = partition_lags([tp0, tp1, tp2, tp3], highwater.get, {tp1: 25},
                          lambda tp: points.get(tp))
    assert lags == {tp0: 6, tp1: 21, tp3: 0}


def test_render_is_text_format(metrics: WorkerMetrics) -> None:
    metrics.add_generated_tokens(4)
    text = metrics.render().decode()
    assert 'sluice_generated_tokens_total{model="tiny",pool="pool-1"} 4.0' in text
    assert "# TYPE sluice_ttft_seconds histogram" in text


@pytest.fixture
def served(metrics: WorkerMetrics) -> Iterator[str]:
    with start_http_server(metrics, 0, host="127.0.0.1") as server:
        assert server.port > 0
        yield f"http://127.0.0.1:{server.port}"


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_scrape_over_http(metrics: WorkerMetrics, served: str) -> None:
    metrics.observe_terminal("error", "overloaded")
    metrics.set_lag(2, 17)
    metrics.observe_ttft(0.3)
    status, body = get(served + "/metrics")
    assert status == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    base = tuple(sorted(LABELS.items()))
    assert samples[("sluice_request_errors_total",
                    tuple(sorted({**LABELS, "code": "overloaded"}.items())))] == 1
    assert samples[("sluice_consumer_lag",
                    tuple(sorted({**LABELS, "partition": "2"}.items())))] == 17
    assert samples[("sluice_ttft_seconds_count", base)] == 1
    assert samples[("sluice_requests_waiting", base)] == 0


def test_probes(metrics: WorkerMetrics, served: str) -> None:
    assert get(served + "/healthz") == (200, b"ok\n")
    assert get(served + "/readyz")[0] == 503
    metrics.set_ready(True)
    assert get(served + "/readyz") == (200, b"ready\n")
    metrics.set_ready(False)
    assert get(served + "/readyz")[0] == 503


def test_close_frees_the_port(metrics: WorkerMetrics) -> None:
    server = start_http_server(metrics, 0, host="127.0.0.1")
    port = server.port
    server.close()
    again = start_http_server(metrics, port, host="127.0.0.1")  # the port is free again
    try:
        assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    finally:
        again.close()
