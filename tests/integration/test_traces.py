"""A producer's trace through sluice, into a real Jaeger (started by the tests).

A request produced by a plain librdkafka client with a made-up `traceparent` is
answered by a real worker exporting OTLP to Jaeger: every reply record carries a
`traceparent` of the same trace, naming sluice's span of the request, and
Jaeger's query API holds that span — a child of the producer's span — with its
children (queue wait, admission, prefill, decode with its step events,
delivery, commit). Through the gateway: the HTTP request's `traceparent` is the
parent of the gateway's span, the parent of the worker's.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from typing import Any

import orjson
import pytest

from common.settings import Settings
from common.tracing import parse_traceparent
from infra.jaeger import render
from tests.integration.pipeline_helpers import (
    drop_schema,
    register_tiny,
    served_gateway,
    worker_process,
)

pytestmark = [pytest.mark.integration]

SPANS = {"sluice.request", "queue wait", "admission", "prefill", "decode", "delivery",
         "commit"}


def _otel_env(jaeger: Any) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within moments, not 5 s


def _made_up_parent() -> tuple[str, str, str]:
    """(trace id, span id, traceparent) of a producer's span."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _produce(settings: Settings, key: str, request_id: str, traceparent: str) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap,
                         "partitioner": "murmur2_random"})
    request = {"v": 1, "request_id": request_id, "model": "tiny",
               "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True,
               "stream": True, "reply_topic": settings.topic("results")}
    producer.produce(settings.requests_topic("tiny"), value=orjson.dumps(request),
                     key=request_id.encode(),
                     headers=[("authorization", f"Bearer {key}"),
                              ("traceparent", traceparent), ("tracestate", "acme=7")])
    assert producer.flush(30) == 0


def _replies(settings: Settings, request_id: str, timeout_s: float = 120
             ) -> list[tuple[dict[str, Any], dict[str, bytes]]]:
    """(event, headers) of each reply record of `request_id`, up to its terminal event."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap,
                         "group.id": f"{settings.topic_prefix}-traces-{time.monotonic_ns()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([settings.topic("results")])
    out: list[tuple[dict[str, Any], dict[str, bytes]]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            event = orjson.loads(msg.value())
            if event["request_id"] == request_id:
                out.append((event, dict(msg.headers() or [])))
                if event["type"] in ("done", "error", "timeout"):
                    return out
    finally:
        consumer.close()
    raise AssertionError(f"no terminal event for {request_id}: {out}")


async def _trace(jaeger: Any, trace_id: str, names: set[str], timeout_s: float = 60
                 ) -> dict[str, Any]:
    """The trace from Jaeger's query API once it holds spans of every name in `names`."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        trace = await asyncio.to_thread(jaeger.trace, trace_id)
        if trace is not None:
            seen = {span["operationName"] for span in trace["spans"]}
            if names <= seen:
                return trace
        await asyncio.sleep(0.5)
    raise AssertionError(f"Jaeger has spans {sorted(seen)} of trace {trace_id}, not "
                         f"{sorted(names - seen)}:\n{jaeger.log()}")


def _parent(span: dict[str, Any]) -> str | None:
    refs = [r for r in span["references"] if r["refType"] == "CHILD_OF"]
    return refs[0]["spanID"] if refs else None


def _service(trace: dict[str, Any], span: dict[str, Any]) -> str:
    return trace["processes"][span["processID"]]["serviceName"]


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
async def test_a_producers_trace_goes_through_the_worker_to_the_replies(
        settings, tiny_model, tmp_path, jaeger, delivery) -> None:
    """Exactly once, the terminal event goes through a transactional producer and the
    commit span ends with the transaction that commits its offset."""
    _client, key = register_tiny(settings, tiny_model, compute_config={"delivery": delivery})
    trace_id, producer_span, traceparent = _made_up_parent()
    try:
        with worker_process(settings, "tiny", tmp_path, env=_otel_env(jaeger)) as worker:
            worker.wait_for_log("serving tiny")
            assert "tracing on" in worker.log()
            await asyncio.to_thread(_produce, settings, key, "traced-1", traceparent)
            replies = await asyncio.to_thread(_replies, settings, "traced-1")
            assert replies[-1][0]["type"] == "done", worker.log()
            assert len(replies) >= 7  # six tokens, then done
            contexts = {headers["traceparent"] for _event, headers in replies}
            assert len(contexts) == 1  # every reply names the same span: sluice's
            reply_parent = parse_traceparent(contexts.pop())
            assert reply_parent is not None and reply_parent.trace_id == trace_id
            assert reply_parent.span_id != producer_span
            assert {headers.get("tracestate") for _e, headers in replies} == {b"acme=7"}

            trace = await _trace(jaeger, trace_id, SPANS)
    finally:
        await drop_schema(settings)
    spans = {span["operationName"]: span for span in trace["spans"]}
    root = spans["sluice.request"]
    # The chain: producer's span <- sluice.request <- each phase.
    assert _parent(root) == producer_span
    assert root["spanID"] == reply_parent.span_id
    for name in SPANS - {"sluice.request"}:
        assert _parent(spans[name]) == root["spanID"], name
    assert {_service(trace, span) for span in trace["spans"]} == {"sluice-worker"}
    tags = {tag["key"]: tag["value"] for tag in root["tags"]}
    assert tags["messaging.message.id"] == "traced-1"
    assert tags["sluice.outcome"] == "done" and tags["gen_ai.usage.output_tokens"] == 6
    # Decode rode in steps: one event each (after prefill's step made the first token).
    decode_steps = [log for log in spans["decode"]["logs"]
                    if {"key": "event", "type": "string", "value": "step"} in log["fields"]]
    assert len(decode_steps) == 5
    assert len(spans["prefill"]["logs"]) >= 1
    # In order on the request's timeline, inside the request's own span.
    start = {name: span["startTime"] for name, span in spans.items()}
    assert (start["sluice.request"] <= start["queue wait"] <= start["admission"]
            <= start["prefill"] <= start["decode"] <= start["delivery"] <= start["commit"])
    end = root["startTime"] + root["duration"]
    # Jaeger gives start and duration in microseconds, each rounded apart from the
    # other: the commit and the request end on the same nanosecond, but their sums
    # may part by one microsecond (seen in CI: 1796575287073523 against ...522)
    assert spans["commit"]["startTime"] + spans["commit"]["duration"] <= end + 1
    tree = render(trace)  # as `python -m infra.jaeger show` prints it
    assert "  sluice.request [sluice-worker]" in tree and "    decode [sluice-worker]" in tree


async def test_the_gateways_http_traceparent_is_the_parent_of_its_request(
        settings, tiny_model, tmp_path, jaeger, monkeypatch) -> None:
    for name, value in _otel_env(jaeger).items():
        monkeypatch.setenv(name, value)  # the gateway in this process, and the worker
    _client, key = register_tiny(settings, tiny_model)
    trace_id, http_span, traceparent = _made_up_parent()
    try:
        async with served_gateway(settings, key, "traces", timeout_s=120) as (api, _port):
            with worker_process(settings, "tiny", tmp_path) as worker:
                # A first request meets the worker joining its group: the one traced
                # below shows a warm path.
                await api.completions.create(model="tiny", prompt="Once", max_tokens=2)
                done = await api.completions.create(
                    model="tiny", prompt="Once upon", max_tokens=8, temperature=0,
                    extra_headers={"traceparent": traceparent})
                assert done.choices[0].text is not None, worker.log()
                trace = await _trace(jaeger, trace_id,
                                     {"POST /v1/completions", "sluice.request", "commit"})
    finally:
        await drop_schema(settings)
    spans = {span["operationName"]: span for span in trace["spans"]}
    gateway = spans["POST /v1/completions"]
    assert _parent(gateway) == http_span
    assert _service(trace, gateway) == "sluice-gateway"
    assert _parent(spans["sluice.request"]) == gateway["spanID"]
    assert _service(trace, spans["sluice.request"]) == "sluice-worker"
    assert {tag["key"]: tag["value"] for tag in gateway["tags"]}[
        "http.response.status_code"] == 200
    print(render(trace))  # the README's example (pytest -s)


@pytest.fixture(autouse=True)
def _no_inherited_otel(monkeypatch) -> None:
    """Only what a test sets: a developer's own OTEL_* settings stay out."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
