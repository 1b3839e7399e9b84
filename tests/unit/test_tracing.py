"""Traces without a backend: W3C trace context parsing, when tracing is on, what it costs
off (no OpenTelemetry import at all), and a request's span tree as a worker builds it,
exported to the SDK's in-memory exporter. (Through Kafka into a real Jaeger:
tests/integration/test_traces.py.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from aiokafka import TopicPartition

from batcher import types as bt
from batcher.engine import StepStats
from common.otlp import Finished, encode
from common.tracing import (
    RequestSpans,
    Stages,
    Tracing,
    context_headers,
    parse_traceparent,
    trace_headers,
    traces_wanted,
)
from ingest.offsets import OffsetTracker
from ingest.verdicts import Admitted
from results.detokenize import IncrementalDecoder
from results.inflight import InFlight
from results.writer import ResultsOptions, ResultWriter
from schemas import ErrorCode, InferenceRequest, Timing
from tests.unit.fake_producer import FakeProducer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
TP = TopicPartition("sluice.requests.tiny", 0)


def test_traceparent_parsing_follows_w3c() -> None:
    parsed = parse_traceparent(PARENT)
    assert parsed is not None and parsed.trace_id == TRACE_ID
    assert parsed.span_id == "00f067aa0ba902b7" and parsed.sampled
    assert parse_traceparent(b"00-" + TRACE_ID.encode() + b"-00f067aa0ba902b7-00").sampled is False
    # A later version may append fields; version 00 may not; ff and zero ids are invalid.
    assert parse_traceparent(f"01-{TRACE_ID}-00f067aa0ba902b7-01-future") is not None
    for bad in (f"00-{TRACE_ID}-00f067aa0ba902b7-01-extra", f"ff-{TRACE_ID}-00f067aa0ba902b7-01",
                f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-{TRACE_ID}-{'0' * 16}-01",
                f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01", "00-abc-def-01", ""):
        assert parse_traceparent(bad) is None, bad


def test_a_records_trace_context_is_its_valid_traceparent_and_tracestate() -> None:
    auth = ("authorization", b"Bearer k")
    assert context_headers([auth]) is None
    assert context_headers([auth, ("TraceParent", PARENT.encode()),
                            ("tracestate", b"vendor=1")]) == [
        ("traceparent", PARENT.encode()), ("tracestate", b"vendor=1")]
    assert context_headers([("traceparent", b"garbage"), ("tracestate", b"v=1")]) is None
    # Two parents: neither is trusted.
    assert context_headers([("traceparent", PARENT.encode())] * 2) is None
    assert trace_headers(PARENT, None) == [("traceparent", PARENT.encode())]
    assert trace_headers("nonsense", "v=1") == [] and trace_headers(None) == []


def test_the_standard_variables_switch_tracing_on_and_off() -> None:
    assert traces_wanted({}) is None
    assert traces_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) == "otlp"
    assert traces_wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x/v1/traces"}) == "otlp"
    assert traces_wanted({"OTEL_TRACES_EXPORTER": "otlp"}) == "otlp"
    assert traces_wanted({"OTEL_TRACES_EXPORTER": "none",
                          "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) is None
    assert traces_wanted({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) is None
    assert traces_wanted({"OTEL_TRACES_EXPORTER": "zipkin,otlp"}) == "otlp"
    assert traces_wanted({"OTEL_TRACES_EXPORTER": "zipkin"}) is None


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env}, timeout=120)


def test_tracing_off_imports_no_opentelemetry() -> None:
    """The worker, the gateway and their tracing, built with no OTEL_* variable: nothing
    of OpenTelemetry is imported (its cost, none)."""
    done = _python(
        "import sys, worker.worker, gateway.app\n"
        "from common.tracing import Tracing\n"
        "assert not Tracing.from_env('sluice-worker')\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))", {})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_asked_for_without_the_extra_it_says_so_once_and_stays_off() -> None:
    done = _python(
        "import sys, logging\n"
        "sys.modules['opentelemetry'] = None  # as if the extra were not installed\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from common.tracing import Tracing\n"
        "assert not Tracing.from_env('sluice-worker')\n",
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "OTEL" in line]
    assert len(lines) == 1 and "sluice-engine[otel]" in lines[0]


# ---- a request's spans, as a worker builds them ------------------------------------------

class Collected:
    """An exporter that keeps what it is given (`common.otlp.Exporter.add`)."""

    def __init__(self) -> None:
        self.spans: list[Finished] = []

    def add(self, item: Finished | RequestSpans) -> None:
        # A worker's request comes as one tuple; the encoding process makes its spans.
        self.spans.extend([item] if isinstance(item, Finished) else item.spans())

    def shutdown(self) -> None:
        pass


@pytest.fixture
def exported() -> tuple[Tracing, Collected]:
    spans = Collected()
    return Tracing(spans), spans


def _admitted(offset: int, arrival: float, headers) -> tuple[Admitted, InFlight]:
    request = InferenceRequest(request_id=f"r-{offset}", model="tiny", prompt="hi")
    admitted = Admitted(request, TP, offset, 0, "replies", arrival_time=arrival,
                        max_ttft_ms=60_000, token_ids=[1, 2, 3], trace_headers=headers,
                        read_time=arrival + 0.010)
    ctx = InFlight(request=request, topic_partition=TP, offset=offset, reply_topic="replies",
                   attempt=0, arrival_time=arrival, max_ttft_ms=60_000,
                   decoder=IncrementalDecoder(None, []), reply_headers=headers)
    return admitted, ctx


def _by_name(spans: list[Finished]) -> dict[str, Finished]:
    return {span.name: span for span in spans}


def test_a_request_becomes_a_span_tree_under_its_producer(exported) -> None:
    from worker.tracing import RequestTracer

    tracing, collected = exported
    held: dict[str, InFlight] = {}
    tracker = OffsetTracker()
    tracer = RequestTracer(tracing, held)
    tracker.watch = tracer
    tracker.assign(TP, None)
    arrival = 1_000.0
    admitted, ctx = _admitted(5, arrival, [("traceparent", PARENT.encode()),
                                          ("tracestate", b"acme=7")])
    tracer.begin(ctx, admitted)
    held["k"] = ctx
    # The reply records name sluice's span, in the producer's trace.
    reply = parse_traceparent(dict(ctx.reply_headers)["traceparent"])
    assert reply.trace_id == TRACE_ID and reply.span_id != "00f067aa0ba902b7"
    assert dict(ctx.reply_headers)["tracestate"] == b"acme=7"
    # Two prompt chunks, then three decode steps beside other requests.
    steps = [(arrival + 0.02, 0.01, 2, 1), (arrival + 0.03, 0.01, 1, 1),
             (arrival + 0.05, 0.01, 1, 3), (arrival + 0.06, 0.01, 1, 3),
             (arrival + 0.07, 0.01, 1, 2)]
    for started, seconds, tokens, seqs in steps:
        tracer.on_step(StepStats(seqs, tokens, seconds, 0, started, {"k": tokens, "x": 1}))
    finished = bt.Finished("k", 0, ctx, "stop", (7, 8, 9, 10), bt.TokenCounts(3, 1, 4),
                           bt.Latency(queue_ms=20, ttft_ms=40.5, total_ms=80))
    tracer.ending(ctx, finished)
    tracker.start(TP, 5)
    tracer.acking(tracker.finish)(TP, 5)
    assert collected.spans == []  # all of it waits for the commit
    tracker.mark_committed(tracker.pending_commits())

    by_name = _by_name(collected.spans)
    assert set(by_name) == {"sluice.request", "queue wait", "admission", "prefill", "decode",
                            "delivery", "commit"}
    root = by_name["sluice.request"]
    assert root.parent_id.hex() == "00f067aa0ba902b7" and root.span_id.hex() == reply.span_id
    for name, span in by_name.items():
        assert span.trace_id.hex() == TRACE_ID and span.trace_state == "acme=7"
        if name != "sluice.request":
            assert span.parent_id == root.span_id, name
    ns = 1_000_000_000
    assert root.start_ns == int(arrival * ns)  # the record's timestamp
    assert by_name["queue wait"].end_ns == int((arrival + 0.010) * ns)
    assert by_name["admission"].end_ns == by_name["prefill"].start_ns
    # Steps before the first token are prefill's; the rest decode's.
    assert [step[2] for step in by_name["prefill"].steps] == [2, 1]
    assert [step[3] for step in by_name["decode"].steps] == [3, 3, 2]
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["sluice.outcome"] == "done" and root.attributes["sluice.committed"]
    assert root.end_ns == by_name["commit"].end_ns and root.error is None

    # On the wire: one OTLP request that a collector decodes to the same spans.
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    wire = ExportTraceServiceRequest.FromString(
        encode(collected.spans, {"service.name": "sluice-worker"}, "sluice"))
    resource_spans = wire.resource_spans[0]
    assert resource_spans.resource.attributes[0].value.string_value == "sluice-worker"
    decoded = {s.name: s for s in resource_spans.scope_spans[0].spans}
    assert decoded["decode"].parent_span_id == root.span_id
    assert [e.name for e in decoded["decode"].events] == ["step"] * 3
    first = {a.key: a.value for a in decoded["decode"].events[0].attributes}
    assert first["sluice.step.requests"].int_value == 3
    assert first["sluice.step.ms"].double_value == 10.0
    assert "sluice.step.tokens" not in first  # a decode step: one token
    chunk = {a.key: a.value for a in decoded["prefill"].events[0].attributes}
    assert chunk["sluice.step.tokens"].int_value == 2
    assert decoded["prefill"].events[0].time_unix_nano == int((arrival + 0.02) * 1e9)
    assert decoded["sluice.request"].kind == decoded["sluice.request"].SPAN_KIND_CONSUMER
    assert {a.key: a.value.int_value for a in decoded["sluice.request"].attributes}[
        "gen_ai.usage.output_tokens"] == 4


def test_a_failed_request_ends_with_an_error_and_a_revoked_one_uncommitted(exported) -> None:
    from worker.tracing import RequestTracer

    tracing, collected = exported
    tracker = OffsetTracker()
    tracer = RequestTracer(tracing, {})
    tracker.watch = tracer
    tracker.assign(TP, None)
    admitted, ctx = _admitted(9, 2_000.0, None)  # no producer context: a trace of its own
    tracer.begin(ctx, admitted)
    tracer.ending(ctx, bt.Failed("k", 0, ctx, ErrorCode.INTERNAL, "boom"))
    tracer.acked(TP, 9)
    tracker.revoke(TP)  # handed over before its commit
    by_name = _by_name(collected.spans)
    root = by_name["sluice.request"]
    assert root.parent_id == b"" and "internal: boom" in root.error
    assert root.attributes["sluice.committed"] is False and "commit" not in by_name
    assert "delivery" in by_name and "prefill" not in by_name


def test_a_request_handed_over_whole_counts_and_encodes_the_spans_it_makes() -> None:
    """The exporter's bound and count take a request's tuple as the spans the encoding
    process makes of it, at every stage a request can end in; `encode` makes them."""
    from array import array

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    root = Finished(b"t" * 16, b"r" * 8, b"", "", "sluice.request", 5, 1, 9, {}, (), (), None)
    two_steps = array("d", [1.5, 0.01, 3, 1, 2.5, 0.01, 1, 2])
    stages = [  # first token, steps, acked, committed
        Stages(1.0, 1.1, 1.1, None, None, 1.2, array("d"), 0.0, 0.0, None),  # cancelled
        Stages(1.0, 1.1, 1.1, None, None, 1.2, array("d"), 1.2, 1.3, None),  # failed, acked
        Stages(1.0, 1.1, 1.1, 1.5, None, 1.6, two_steps[:4], 1.6, 1.7, 1.8),  # prefill only
        Stages(1.0, 1.1, 1.1, 1.5, 2.0, 3.0, two_steps, 3.0, 3.1, 3.2),  # done, committed
        Stages(1.0, 1.1, 1.1, 1.5, 2.0, 3.0, two_steps, 3.0, 3.1, None),  # revoked
    ]
    names = {"sluice.request", "queue wait", "admission", "prefill", "decode", "delivery",
             "commit"}
    for st in stages:
        item = RequestSpans(root, st, 1)
        spans = item.spans()
        assert item.num_spans == len(spans) and {s.name for s in spans} <= names
        assert all(len(s.steps) <= 1 for s in spans)  # the event limit
        wire = ExportTraceServiceRequest.FromString(encode([item, root], {}, "sluice"))
        decoded = wire.resource_spans[0].scope_spans[0].spans
        assert [s.name for s in decoded] == [s.name for s in spans] + ["sluice.request"]
    done = {s.name: s for s in RequestSpans(root, stages[3], None).spans()}
    assert [step[2:] for step in done["prefill"].steps] == [(3, 1)]
    assert [step[2:] for step in done["decode"].steps] == [(1, 2)]
    assert done["commit"].end_ns == 3_200_000_000


class _Collector:
    """An OTLP/HTTP endpoint on 127.0.0.1 keeping each posted body."""

    def __init__(self) -> None:
        import http.server
        import threading

        bodies = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def span_names(self) -> list[list[str]]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        return [[s.name for s in ExportTraceServiceRequest.FromString(body)
                 .resource_spans[0].scope_spans[0].spans] for body in self.bodies]


def test_the_exporter_bounds_batches_and_queue_in_spans_and_drops_a_request_whole() -> None:
    """Through the real exporter and its encoding process: a worker's request counts as
    its seven spans against OTEL_BSP_MAX_QUEUE_SIZE and the batch size, is dropped
    whole when it does not fit, and arrives as its spans."""
    from array import array

    from common.otlp import Exporter

    root = Finished(b"t" * 16, b"r" * 8, b"", "", "sluice.request", 5, 1, 9, {}, (), (), None)
    steps = array("d", [1.5, 0.01, 3, 1, 2.5, 0.01, 1, 2])
    request = RequestSpans(root, Stages(1.0, 1.1, 1.1, 1.5, 2.0, 3.0, steps, 3.0, 3.1, 3.2),
                           None)
    assert request.num_spans == 7
    collector = _Collector()
    try:
        # Bound 20 spans, a batch of up to 100, never exported before the shutdown.
        exporter = Exporter({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url,
                             "OTEL_BSP_MAX_QUEUE_SIZE": "20",
                             "OTEL_BSP_SCHEDULE_DELAY": "600000"}, {}, "sluice")
        for item in (request, request, root, request):  # 7 + 7 + 1, then 7 over 20
            exporter.add(item)
        assert exporter.num_dropped == 7
        exporter.shutdown()
        assert exporter.num_exported == 15
        assert sorted(collector.span_names()[0]) == sorted(
            [s.name for s in request.spans()] * 2 + ["sluice.request"])
        # Batches of at most 10 spans: a request that would overflow one starts the next.
        collector.bodies.clear()
        exporter = Exporter({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url,
                             "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10"}, {}, "sluice")
        for item in (request, root, request, root, root, request):
            exporter.add(item)
        exporter.shutdown()
        sizes = [len(names) for names in collector.span_names()]
        assert exporter.num_exported == sum(sizes) == 24 and max(sizes) <= 10
    finally:
        collector.server.shutdown()


def test_an_unsampled_producer_trace_is_continued_but_not_recorded(exported) -> None:
    tracing, collected = exported
    unsampled = f"00-{TRACE_ID}-00f067aa0ba902b7-00"
    span = tracing.begin("sluice.request", [("traceparent", unsampled.encode())], 1.0)
    tracing.end(span, 3.0, stages=Stages(1.0, 2.0, 2.0, None, None, 2.5, [], 0.0, 0.0, None))
    tracing.end(span, 3.0)
    assert collected.spans == []
    assert parse_traceparent(span.headers[0][1]).flags == 0  # downstream keeps the choice


async def test_reply_records_carry_the_requests_trace_context() -> None:
    producer = FakeProducer(topics={"replies", "sluice.timeouts"})
    options = ResultsOptions(model="tiny", timeouts_topic="sluice.timeouts",
                             deadletter_topic="sluice.deadletter", producer_options={},
                             request_timeout_s=1.0)
    writer = ResultWriter(options, lambda _tp, _offset: None, producer=producer)
    headers = [("traceparent", PARENT.encode())]
    ctx = _admitted(3, 0.0, headers)[1]
    await writer.tokens(ctx, [5])
    await writer.done(ctx, finish_reason="stop", token_ids=[5], num_cached_prompt_tokens=0,
                      timing=Timing(queue_ms=1, ttft_ms=2, total_ms=3), adapter=None)
    await writer.refusal(tp=TP, offset=4, reply_topic="replies", request_id="r-4",
                         code=ErrorCode.UNAUTHORIZED, message="no", headers=headers)
    await asyncio.sleep(0)
    assert len(producer.acked) == 3
    assert producer.headers == [headers, headers, headers]


def test_step_events_written_as_bytes_decode_as_the_message_api_builds_them():
    """The `step` events are serialized by hand (a third of a traced request's encoding
    otherwise): at the varint edges (1-byte and multi-byte counts, a prompt chunk and a
    decode step), they decode to what protobuf's own API builds."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanMessage

    steps = [(1_765_000_000.123456, 0.0041234, 1, 1), (1_765_000_000.5, 0.25, 127, 128),
             (1_765_000_001.0, 12.5, 16_384, 300), (0.000001, 0.0, 2, 0),
             (1_765_000_002.0, 1e-7, 1, 2**31), (1_765_000_003.0, 1.0, -1, 2**63 - 1),
             (1_765_000_004.0, 2.0, -(2**63), -1)]
    span = Finished(b"t" * 16, b"s" * 8, b"p" * 8, "", "decode", 1, 1, 2, None, (), steps, None)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    got = ExportTraceServiceRequest.FromString(encode([span], {}, "sluice"))
    events = got.resource_spans[0].scope_spans[0].spans[0].events

    want = SpanMessage()
    for started, seconds, tokens, seqs in steps:
        event = want.events.add(time_unix_nano=int(started * 1e9), name="step")
        kv = event.attributes.add(key="sluice.step.requests")
        kv.value.int_value = seqs
        kv = event.attributes.add(key="sluice.step.ms")
        kv.value.double_value = round(seconds * 1000, 3)
        if tokens != 1:
            kv = event.attributes.add(key="sluice.step.tokens")
            kv.value.int_value = tokens
    assert list(events) == list(want.events)
    assert [e.SerializeToString() for e in events] == [
        e.SerializeToString() for e in want.events]


def _built_by_upb(spans: list[Finished], resource: dict, scope: str):
    """The reference: the ExportTraceServiceRequest protobuf's own API builds of `spans`."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    def put(attributes, key, value) -> None:
        kv = attributes.add(key=key)
        if isinstance(value, bool):
            kv.value.bool_value = value
        elif isinstance(value, int):
            kv.value.int_value = value
        elif isinstance(value, float):
            kv.value.double_value = value
        else:
            kv.value.string_value = str(value)

    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in resource.items():
        put(resource_spans.resource.attributes, key, value)
    scope_spans = resource_spans.scope_spans.add(scope=InstrumentationScope(name=scope))
    for s in spans:
        span = scope_spans.spans.add(
            trace_id=s.trace_id, span_id=s.span_id, parent_span_id=s.parent_id,
            trace_state=s.trace_state, name=s.name, kind=s.kind,
            start_time_unix_nano=s.start_ns, end_time_unix_nano=s.end_ns)
        for key, value in (s.attributes or {}).items():
            put(span.attributes, key, value)
        for name, at, attributes in s.events:
            event = span.events.add(time_unix_nano=at, name=name)
            for key, value in attributes.items():
                put(event.attributes, key, value)
        for started, seconds, tokens, seqs in s.steps:
            event = span.events.add(time_unix_nano=int(started * 1e9), name="step")
            put(event.attributes, "sluice.step.requests", seqs)
            put(event.attributes, "sluice.step.ms", round(seconds * 1000, 3))
            if tokens != 1:
                put(event.attributes, "sluice.step.tokens", tokens)
        if s.error is not None:
            span.status.code = Status.STATUS_CODE_ERROR
            span.status.message = s.error
    return request


def test_spans_written_as_bytes_are_what_the_protobuf_api_builds():
    """Spans are written in OTLP's wire format by hand: every field, attribute type and
    length edge (1- and 2-byte lengths, empty values and keys, negative and 64-bit ints,
    0.0 then -0.0, an unhashable value) gives the bytes protobuf's own API serializes,
    encoded twice (the second time from the encoder's caches); an int past int64's
    range is refused, as upb refuses it."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    long = "x" * 200
    attributes = {"s": "kafka", "empty": "", "long": long, "unicode": "zürich ☃",
                  "t": True, "f": False, "zero": 0, "one": 1, "edge": 127, "wide": 128,
                  "neg": -1, "min": -(2**63), "max": 2**63 - 1, "float": 0.25,
                  "nan_free": -1e300, "other": ErrorCode.INVALID_REQUEST, "list": [1, 2],
                  long: 3, "": "no key", "zero_float": 0.0}
    negative_zero = {"zero_float": -0.0}  # equal to 0.0, other bytes
    spans = [
        Finished(b"t" * 16, b"s" * 8, b"", "", "sluice.request", 5, 10**18, 10**18 + 5,
                 attributes, (), (), None),
        Finished(b"t" * 16, b"c" * 8, b"s" * 8, "vendor=1,other=2", "admission", 1, 3, 4,
                 None, [("submitted", 7, {}), ("", 0, {"k": "v", "n": 2})], (), ""),
        Finished(b"u" * 16, b"d" * 8, b"s" * 8, "", "decode", 0, 0, 0, {},
                 [("e", 1, attributes)], [(1.5, 0.01, 3, 64), (2.5, 0.002, 1, 64)],
                 "error: " + long),
        Finished(b"", b"", b"", "", "", 0, 0, 9, None, (), (), "x"),
        Finished(b"v" * 16, b"e" * 8, b"", "", "after", 1, 1, 2, negative_zero, (), (),
                 None),
    ]
    for resource, scope in (({"service.name": "sluice-worker", "n": 3}, "sluice"), ({}, "")):
        want = _built_by_upb(spans, resource, scope)
        for _ in range(2):
            wire = encode(spans, resource, scope)
            assert ExportTraceServiceRequest.FromString(wire) == want
            assert wire == want.SerializeToString()
    for number in (2**63, -(2**63) - 1, 2**64):  # as upb: refused (the batch is dropped)
        with pytest.raises(ValueError, match="int64"):
            encode([spans[0]._replace(attributes={"n": number})], {}, "sluice")
