"""Traces: the W3C trace context through Kafka records, and OpenTelemetry spans.

A request record (or the gateway's HTTP request) may carry a W3C `traceparent`
header (and `tracestate`). sluice continues that trace: its spans are children
of the producer's span, and every record it writes in reply carries a
`traceparent` naming sluice's span of the request, so a consumer's trace goes
on from there. With tracing off, a request's own headers are passed through
onto its replies unchanged (a header, no spans), so the producer's trace still
reaches the consumer.

Tracing is off unless the standard OpenTelemetry variables ask for it:
`OTEL_TRACES_EXPORTER=otlp`, or an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) with no exporter named;
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it off. The service
name, resource attributes and sampler are the SDK's own reading of its
`OTEL_*` variables (the service name defaults to the process's role:
`sluice-worker`, `sluice-gateway`); export is OTLP over http/protobuf
(`common.otlp`, which says why it does not use the SDK's span objects).

Off, nothing here imports opentelemetry and a `Tracing` is one falsy check;
asked for with the `otel` extra missing, it says so in one log line and stays
off. Spans carry explicit start and end times: the request path records plain
timestamps (a model step: four numbers appended to an array), and a finished
span is a tuple queued for the export thread (`Tracing.end`). A
worker's request goes to the exporter once it ends as one tuple, its span and
its stages' moments (`RequestSpans`): its child spans are made by the encoding
process.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# A record's headers as aiokafka and confluent-kafka hand them over.
Headers = list[tuple[str, bytes]]
Attributes = Mapping[str, str | bool | int | float]
# A model step a request rode in: (started, seconds, its tokens, requests in the step).
Step = tuple[float, float, int, int]

# W3C trace context, level 1: version-traceid-parentid-flags; a later version may append.
_TRACEPARENT_RE = re.compile(
    rb"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^ \t]*)?[ \t]*$")
_OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A parsed `traceparent`: the trace, the parent span, its flags."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def parse_traceparent(value: bytes | str) -> TraceParent | None:
    """A `traceparent` value, or None when it is not a valid one (W3C: an all-zero id
    or version ff is invalid; a later version's extra fields are ignored)."""
    raw = value.encode() if isinstance(value, str) else value
    match = _TRACEPARENT_RE.match(raw)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == b"ff" or (version == b"00" and rest) or trace_id == b"0" * 32 or (
            span_id == b"0" * 16):
        return None
    return TraceParent(trace_id.decode(), span_id.decode(), int(flags, 16))


def context_headers(headers: Iterable[tuple[str, bytes | None]]) -> Headers | None:
    """A record's trace context: its valid `traceparent` header and the `tracestate`
    beside it, as headers to pass on; None without a valid one (header names are
    matched case-insensitively, as in HTTP)."""
    parent: bytes | None = None
    state: bytes | None = None
    for name, value in headers:
        if value is None or len(name) not in (10, 11):
            continue  # the common case, an authorization header: no lower() needed
        lowered = name.lower()
        if lowered == TRACEPARENT:
            if parent is not None:
                return None  # two parents: neither can be trusted
            parent = value
        elif lowered == TRACESTATE:
            state = value
    if parent is None or parse_traceparent(parent) is None:
        return None
    out: Headers = [(TRACEPARENT, parent.strip())]
    if state:
        out.append((TRACESTATE, state))
    return out


def trace_headers(traceparent: str | None, tracestate: str | None = None) -> Headers:
    """The headers of a W3C trace context given as strings (an HTTP request's, say);
    none when `traceparent` is missing or invalid (W3C: then the trace starts anew)."""
    if not traceparent or parse_traceparent(traceparent) is None:
        return []
    out: Headers = [(TRACEPARENT, traceparent.strip().encode())]
    if tracestate:
        out.append((TRACESTATE, tracestate.encode()))
    return out


def traces_wanted(environ: Mapping[str, str]) -> str | None:
    """The exporter the OTEL_* variables ask for ("otlp"), or None: off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    named = environ.get("OTEL_TRACES_EXPORTER")
    if named is None:
        return "otlp" if any(environ.get(name) for name in _OTLP_ENDPOINTS) else None
    wanted = [n.strip().lower() for n in named.split(",") if n.strip()]
    for name in wanted:
        if name == "otlp":
            return name
    if any(name != "none" for name in wanted):
        log.warning("OTEL_TRACES_EXPORTER=%s: sluice exports traces only with otlp "
                    "(http/protobuf); tracing is off", named)
    return None


class Span:
    """A span begun now and ended later (a request's own span): its context goes on the
    records written for it (`headers`)."""

    __slots__ = ("attributes", "headers", "kind", "name", "parent_id", "sampled", "span_id",
                 "start_ns", "trace_id", "trace_state")

    def __init__(self, trace_id: bytes, span_id: bytes, parent_id: bytes, trace_state: str,
                 sampled: bool, name: str, kind: int, start_ns: int,
                 attributes: dict[str, Any] | None):
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.trace_state = trace_state
        self.sampled = sampled
        self.name = name
        self.kind = kind
        self.start_ns = start_ns
        self.attributes = attributes
        flags = "01" if sampled else "00"
        headers: Headers = [(TRACEPARENT,
                             f"00-{trace_id.hex()}-{span_id.hex()}-{flags}".encode())]
        if trace_state:
            headers.append((TRACESTATE, trace_state.encode()))
        self.headers = headers  # traceparent (+ tracestate) naming this span


class Stages(NamedTuple):
    """The moments of a worker's request (wall-clock seconds), as `worker.tracing`
    records them: the stages its child spans cover."""

    arrival: float  # the record's broker timestamp
    read: float  # by this worker
    submitted: float  # to the batcher, after the checks
    first_scheduled: float | None
    first_token: float | None
    ended: float  # the engine's terminal event
    # Four numbers a model step it rode in: started, seconds, its tokens, requests in it
    # (an `array('d')`: one object however many steps, nothing for the collector to walk).
    steps: Sequence[float]
    sent: float  # its terminal event handed to the producer (0: never)
    acked: float  # ... and acknowledged (0: never)
    committed: float | None  # its offset committed (None: never)


class RequestSpans(NamedTuple):
    """A worker's request as the exporter is handed it: its own span, ended, and its
    stages. The child spans are made from them in the encoding process (`spans`): the
    serving process queues and pickles one tuple instead of seven spans, and the ~35 us
    a request of making them (measured on the tiny model's bulk load) is spent off its
    GIL."""

    root: Any  # common.otlp.Finished
    stages: Stages
    max_events: int | None  # step events a span keeps (OTEL_SPAN_EVENT_COUNT_LIMIT)

    @property
    def num_spans(self) -> int:
        """How many spans `spans` makes (for the export queue's bound)."""
        st = self.stages
        token = st.first_token is not None
        acked = bool(st.acked)
        return (3 + (token or bool(st.steps)) + token + acked
                + (acked and st.committed is not None))

    def spans(self) -> list[Any]:
        """The request's span and its children::

            queue wait   record timestamp -> read
            admission    read -> first scheduled (event "submitted")
            prefill      first scheduled -> first token; a `step` event per step
            decode       first token -> last token; a `step` event per step
            delivery     terminal event sent -> acknowledged
            commit       acknowledged -> offset committed
        """
        from common.otlp import INTERNAL, Finished

        root, st, limit = self.root, self.stages, self.max_events
        out = [root]
        bits = random.getrandbits

        def child(name: str, start: float, end: float, attributes: Attributes | None = None,
                  events: Sequence[tuple[str, int, Attributes]] = (),
                  steps: Sequence[Step] = ()) -> None:
            start_ns = _ns(start)
            if limit is not None and len(steps) > limit:
                steps = steps[:limit]
            out.append(Finished(root.trace_id, bits(64).to_bytes(8, "big"), root.span_id,
                                root.trace_state, name, INTERNAL, start_ns,
                                max(start_ns, _ns(end)), attributes, events, steps, None))

        s = st.steps
        steps = [(s[i], s[i + 1], int(s[i + 2]), int(s[i + 3])) for i in range(0, len(s), 4)]
        child("queue wait", st.arrival, st.read)
        started = st.first_scheduled or (steps[0][0] if steps else st.ended)
        child("admission", st.read, started, events=[("submitted", _ns(st.submitted), {})])
        if steps or st.first_token is not None:
            first_token = st.first_token or st.ended
            prefill = [step for step in steps if step[0] < first_token]
            decode = steps[len(prefill):]
            child("prefill", started, first_token, {"sluice.steps": len(prefill)},
                  steps=prefill)
            if st.first_token is not None:
                child("decode", first_token, st.ended, {"sluice.steps": len(decode)},
                      steps=decode)
        if st.acked:
            child("delivery", st.sent, st.acked)
            if st.committed is not None:
                child("commit", st.acked, st.committed)
        return out


class Tracing:
    """The spans of one process: off (the default), or exported over OTLP (`common.otlp`).

    Falsy when off; callers test it (`if tracing:`) before doing any work for a trace.
    """

    def __init__(self, exporter: Any = None, sampler: Any = None,
                 max_events: int | None = None):
        self._exporter = exporter
        self._sampler = sampler  # the SDK's (OTEL_TRACES_SAMPLER); None: parent's choice
        # Events one span keeps (OTEL_SPAN_EVENT_COUNT_LIMIT); None: no limit.
        self.max_events = max_events
        self._random = random.Random()
        if exporter is not None:  # imported once here, never on the request path
            from common import otlp

            self._otlp = otlp
        if sampler is not None:
            from opentelemetry import trace

            self._api = trace

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def from_env(cls, default_service: str,
                 environ: Mapping[str, str] | None = None) -> Tracing:
        """Tracing as the OTEL_* variables ask (read once, at start-up); off without them."""
        env = os.environ if environ is None else environ
        if traces_wanted(env) is None:
            return cls.off()
        try:
            return cls._exporting(default_service, env)
        except ImportError as exc:
            log.warning("the OTEL_* settings ask for traces, but the OpenTelemetry packages "
                        "are not installed (%s): install sluice-engine[otel]; tracing is off",
                        exc.name or exc)
            return cls.off()

    @classmethod
    def _exporting(cls, default_service: str, env: Mapping[str, str]) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

        from common.otlp import Exporter

        protocol = next((env[p] for p in _PROTOCOLS if env.get(p)), "http/protobuf")
        if protocol.strip() != "http/protobuf":
            log.warning("OTLP protocol %r asked for: sluice exports http/protobuf only "
                        "(a collector's port 4318 by default)", protocol)
        # The SDK's own reading of OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES and
        # OTEL_TRACES_SAMPLER (its default: parent-based, always on).
        attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": default_service}
        resource = Resource.create(attributes)
        sampler = TracerProvider(resource=resource, shutdown_on_exit=False).sampler
        if sampler.get_description() == ParentBased(ALWAYS_ON).get_description():
            sampler = None  # the default: the same choice without a call per request
        exporter = Exporter(env, resource.attributes, "sluice")
        log.info("tracing on: OTLP to %s as service %s", exporter.endpoint,
                 resource.attributes.get("service.name"))
        return cls(exporter, sampler, SpanLimits().max_events)

    def __bool__(self) -> bool:
        return self._exporter is not None

    # ---- spans ------------------------------------------------------------------------

    def begin(self, name: str, parent: Sequence[tuple[str, bytes]] | None, start: float,
              *, kind: str = "internal", attributes: dict[str, Any] | None = None) -> Span:
        """A span begun at `start` (wall-clock seconds), a child of the span that
        `parent` (a record's trace-context headers) names, else a new trace's root."""
        found = dict(parent) if parent else {}
        context = parse_traceparent(found[TRACEPARENT]) if TRACEPARENT in found else None
        state = found[TRACESTATE].decode("latin-1") if TRACESTATE in found else ""
        bits = self._random.getrandbits
        if context is not None:
            trace_id, parent_id = bytes.fromhex(context.trace_id), bytes.fromhex(context.span_id)
        else:
            trace_id, parent_id, state = bits(128).to_bytes(16, "big"), b"", ""
        sampled = self._sample(context, trace_id, name, kind, state)
        return Span(trace_id, bits(64).to_bytes(8, "big"), parent_id, state, sampled, name,
                    self._otlp.KINDS[kind], _ns(start), attributes)

    def _sample(self, context: TraceParent | None, trace_id: bytes, name: str, kind: str,
                state: str) -> bool:
        if self._sampler is None:
            return context.sampled if context is not None else True
        trace = self._api
        parent = None
        if context is not None:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
                int(context.trace_id, 16), int(context.span_id, 16), is_remote=True,
                trace_flags=trace.TraceFlags(context.flags),
                trace_state=trace.TraceState.from_header([state]) if state else None)))
        decision = self._sampler.should_sample(parent, int.from_bytes(trace_id, "big"), name,
                                               trace.SpanKind[kind.upper()])
        return bool(decision.decision.is_sampled())

    def end(self, span: Span, end: float, *, attributes: Attributes | None = None,
            error: str | None = None, stages: Stages | None = None) -> None:
        """End a span begun with `begin`; with `stages`, a worker's request span whose
        children the encoding process makes (`RequestSpans`)."""
        if not span.sampled:
            return
        merged = {**(span.attributes or {}), **(attributes or {})}
        root = self._otlp.Finished(span.trace_id, span.span_id, span.parent_id,
                                   span.trace_state, span.name, span.kind, span.start_ns,
                                   max(span.start_ns, _ns(end)), merged, (), (), error)
        self._exporter.add(root if stages is None
                           else RequestSpans(root, stages, self.max_events))

    @property
    def exporter(self) -> Any:
        """The OTLP exporter (`common.otlp.Exporter`); None when tracing is off."""
        return self._exporter

    def shutdown(self) -> None:
        """Export what is still queued and stop (blocking: call it off the event loop)."""
        if self._exporter is not None:
            self._exporter.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
