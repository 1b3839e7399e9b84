"""Traces: the W3C trace context through Kafka records, and OpenTelemetry spans.

A request record (or the gateway's HTTP request) may carry a W3C `traceparent`
header (and `tracestate`). sluice continues that trace: its spans are children
of the producer's span, and every record it writes in reply carries a
`traceparent` naming sluice's span of the request, so a consumer's trace goes
on from there. With tracing off, a request's own headers are passed through
onto its replies unchanged (a header, no spans), so the producer's trace still
reaches the consumer.

Tracing is off unless the standard OpenTelemetry variables ask for it:
`OTEL_TRACES_EXPORTER=otlp` (or `console`), or an OTLP endpoint
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) with no
exporter named; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it
off. Everything else (service name, resource attributes, sampler, batch
processor, endpoint, headers, timeout) is the SDK's own handling of its
`OTEL_*` variables; the service name defaults to the process's role
(`sluice-worker`, `sluice-gateway`). Export is OTLP over http/protobuf (the
lightest exporter; the `otel` extra installs it).

Off, nothing here imports opentelemetry and a `Tracing` is one falsy check;
asked for with the extra missing, it says so in one log line and stays off.
Spans are made with explicit start and end times: the request path records
plain timestamps, and its spans are built once it ends (`Tracing.span`), so
nothing but a list append happens per model step.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# A record's headers as aiokafka and confluent-kafka hand them over.
Headers = list[tuple[str, bytes]]
Attributes = Mapping[str, str | bool | int | float]
# (name, wall-clock seconds, attributes): an event of a span.
SpanEvent = tuple[str, float, Attributes]

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
    """The exporter the OTEL_* variables ask for ("otlp" or "console"), or None: off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    named = environ.get("OTEL_TRACES_EXPORTER")
    if named is None:
        return "otlp" if any(environ.get(name) for name in _OTLP_ENDPOINTS) else None
    wanted = [n.strip().lower() for n in named.split(",") if n.strip()]
    for name in wanted:
        if name in ("otlp", "console"):
            return name
    if any(name != "none" for name in wanted):
        log.warning("OTEL_TRACES_EXPORTER=%s: sluice exports traces only with otlp "
                    "(http/protobuf) or console; tracing is off", named)
    return None


class Span:
    """A span begun now and ended later (a request's own span): its context goes on the
    records written for it."""

    __slots__ = ("headers", "otel")

    def __init__(self, otel: Any, headers: Headers):
        self.otel = otel
        self.headers = headers  # traceparent (+ tracestate) naming this span


class Tracing:
    """The spans of one process: off (the default), or exported by a BatchSpanProcessor.

    Falsy when off; callers test it (`if tracing:`) before doing any work for a trace.
    """

    def __init__(self, provider: Any = None):
        self._provider = provider
        self._tracer: Any = None
        if provider is not None:
            from opentelemetry import trace
            from opentelemetry.sdk.trace import SpanLimits
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self._tracer = provider.get_tracer("sluice")
            self._api = trace  # imported once here, never on the request path
            self._propagator = TraceContextTextMapPropagator()
            # Events one span keeps (OTEL_SPAN_EVENT_COUNT_LIMIT); None: no limit.
            self.max_events: int | None = SpanLimits().max_events

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def from_env(cls, default_service: str,
                 environ: Mapping[str, str] | None = None) -> Tracing:
        """Tracing as the OTEL_* variables ask (read once, at start-up); off without them.
        The SDK reads its own variables from the process environment."""
        env = os.environ if environ is None else environ
        exporter = traces_wanted(env)
        if exporter is None:
            return cls.off()
        try:
            return cls._exporting(exporter, default_service, env)
        except ImportError as exc:
            log.warning("the OTEL_* settings ask for traces, but the OpenTelemetry packages "
                        "are not installed (%s): install sluice-engine[otel]; tracing is off",
                        exc.name or exc)
            return cls.off()

    @classmethod
    def _exporting(cls, exporter: str, default_service: str,
                   env: Mapping[str, str]) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": default_service}
        provider = TracerProvider(resource=Resource.create(attributes),
                                  shutdown_on_exit=False)
        if exporter == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            protocol = next((env[p] for p in _PROTOCOLS if env.get(p)), "http/protobuf")
            if protocol.strip() != "http/protobuf":
                log.warning("OTLP protocol %r asked for: sluice exports http/protobuf only "
                            "(its collector port, 4318 by default)", protocol)
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("tracing on: %s export as service %s", exporter,
                 provider.resource.attributes.get("service.name"))
        return cls(provider)

    def __bool__(self) -> bool:
        return self._tracer is not None

    # ---- spans ------------------------------------------------------------------------

    def begin(self, name: str, parent: Sequence[tuple[str, bytes]] | None, start: float,
              *, kind: str = "internal", attributes: Attributes | None = None) -> Span:
        """A span begun at `start` (wall-clock seconds), a child of the span that
        `parent` (a record's trace-context headers) names, else a new trace's root."""
        api = self._api
        context = None
        if parent:
            context = self._propagator.extract({k: v.decode("latin-1") for k, v in parent})
        otel = self._tracer.start_span(name, context, kind=api.SpanKind[kind.upper()],
                                       attributes=attributes, start_time=_ns(start))
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, api.set_span_in_context(otel))
        return Span(otel, [(k, v.encode()) for k, v in carrier.items()])

    def span(self, parent: Span, name: str, start: float, end: float, *,
             attributes: Attributes | None = None, events: Sequence[SpanEvent] = (),
             error: str | None = None) -> None:
        """A finished child span of `parent`, from `start` to `end` (wall seconds)."""
        otel = self._tracer.start_span(name, self._api.set_span_in_context(parent.otel),
                                       attributes=attributes, start_time=_ns(start))
        for event_name, at, event_attributes in events:
            otel.add_event(event_name, event_attributes, _ns(at))
        if error is not None:
            self._set_error(otel, error)
        otel.end(_ns(max(start, end)))

    def end(self, span: Span, end: float, *, attributes: Attributes | None = None,
            error: str | None = None) -> None:
        if attributes:
            span.otel.set_attributes(attributes)
        if error is not None:
            self._set_error(span.otel, error)
        span.otel.end(_ns(end))

    def _set_error(self, otel: Any, description: str) -> None:
        otel.set_status(self._api.Status(self._api.StatusCode.ERROR, description))

    def shutdown(self) -> None:
        """Export what is still queued and stop (blocking: call it off the event loop)."""
        if self._provider is not None:
            self._provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
