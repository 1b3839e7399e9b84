"""OTLP over HTTP (protobuf) for sluice's spans: encoded and sent in a process of its own.

Why not the SDK's span objects and exporter: measured on the tiny model's bulk
load (2 cores), the SDK spent ~450 us making a request's seven spans
(`Tracer.start_span`, attribute cleaning, locks) and ~300 us encoding them —
about a fifth of the worker's throughput. Here a finished span is one tuple
appended to a deque on the request path (a worker's request, one tuple of its
stages for all seven, `common.tracing.RequestSpans`, queued, exported or dropped
whole); this module's thread hands batches to a process of its own (`python -m
common.otlp`), which makes the request's spans, writes them in OTLP's protobuf
wire format by hand (~55 us a request; upb's message objects took ~100) and posts
them. What the SDK does
well is still the SDK's: the resource (OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES), the sampler (OTEL_TRACES_SAMPLER), the event limit
(OTEL_SPAN_EVENT_COUNT_LIMIT), the header syntax (OTEL_EXPORTER_OTLP_HEADERS).

The exporter variables read here, as the SDK reads them: the endpoint
(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is, else OTEL_EXPORTER_OTLP_ENDPOINT +
/v1/traces, else localhost:4318), headers, timeout (seconds, default 10),
compression (gzip), certificate and client certificate/key (the _TRACES_
variant first); the batch processor's OTEL_BSP_SCHEDULE_DELAY,
OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_MAX_EXPORT_BATCH_SIZE. Spans beyond the queue
are dropped and counted in a log line, never waited for.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import requests
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.util.re import parse_env_headers

log = logging.getLogger(__name__)

KINDS = {"internal": Span.SPAN_KIND_INTERNAL, "server": Span.SPAN_KIND_SERVER,
         "client": Span.SPAN_KIND_CLIENT, "producer": Span.SPAN_KIND_PRODUCER,
         "consumer": Span.SPAN_KIND_CONSUMER}
INTERNAL = Span.SPAN_KIND_INTERNAL
_RETRY_STATUS = {429, 502, 503, 504}


class Finished(NamedTuple):
    """A finished span, as the request path leaves it for the export thread (a tuple:
    cheap to make)."""

    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    trace_state: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] | None
    # (name, time ns, attributes) of each event
    events: Sequence[tuple[str, int, Mapping[str, Any]]]
    # Model steps, each a `step` event: (started s, seconds, its tokens, requests in it).
    steps: Sequence[tuple[float, float, int, int]]
    error: str | None


# Encoded by hand, straight into protobuf's wire format: building upb's messages field
# by field cost ~100 us a traced request (the tiny model's bulk load, 7 spans and 16
# steps), ~2 % of the worker's tokens/s from this process's share of the 2 cores; these
# bytes ~55 us. The field numbers are OTLP's (opentelemetry/proto/trace/v1/trace.proto);
# `tests/unit/test_tracing.py` checks the bytes decode to what upb's API builds.
_SMALL = [bytes((n,)) for n in range(128)]
_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_TIMES = struct.Struct("<BQBQ")  # Span.start_time_unix_nano (7), end_time_unix_nano (8)
# Encoded attributes, names and steps kept for reuse (a batch's requests share their
# steps, their attribute keys and most values), each bounded: emptied when full.
_CACHE_BOUND = 8192


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, data: bytes) -> bytes:
    """A length-delimited field (`tag`: its one-byte key) holding `data`."""
    n = len(data)
    return _SMALL[tag] + (_SMALL[n] if n < 128 else _varint(n)) + data


def _any_value(value: Any) -> bytes:
    """An AnyValue: bool (2), int64 (3, two's complement), double (4), else the
    string (1) of it."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        number = int(value)
        if not -(1 << 63) <= number < 1 << 63:  # as upb refuses it: the batch is dropped
            raise ValueError(f"{number} is out of an int64's range")
        return b"\x18" + _varint(number if number >= 0 else number + (1 << 64))
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    return _field(0x0A, str(value).encode())


_ATTRIBUTES: dict[tuple[int, str, type, Any], bytes] = {}
# Values whose equality is their encoding's (not floats: -0.0 == 0.0; not objects
# whose text may change): the others are encoded each time.
_CACHED = frozenset({str, int, bool})


def _attributes(tag: int, attributes: Mapping[str, Any]) -> bytes:
    """KeyValues (key 1, value 2) as the repeated field `tag` of their message."""
    cache = _ATTRIBUTES
    parts = []
    for key, value in attributes.items():
        kind = type(value)
        cache_key = (tag, key, kind, value) if kind in _CACHED else None
        found = None if cache_key is None else cache.get(cache_key)
        if found is None:
            found = _field(tag, (_field(0x0A, key.encode()) if key else b"")
                           + _field(0x12, _any_value(value)))
            if cache_key is not None:
                if len(cache) >= _CACHE_BOUND:
                    cache.clear()
                cache[cache_key] = found
        parts.append(found)
    return b"".join(parts)


_STRINGS: dict[tuple[int, str], bytes] = {}


def _string(tag: int, value: str) -> bytes:
    found = _STRINGS.get((tag, value))
    if found is None:
        found = _field(tag, value.encode())
        if len(_STRINGS) >= _CACHE_BOUND:
            _STRINGS.clear()
        _STRINGS[tag, value] = found
    return found


_STEPS: dict[tuple[float, float, int, int], bytes] = {}


def _event(name: str, at: int, attributes: Mapping[str, Any] | None) -> bytes:
    """An Event (time 1, name 2, attributes 3) as a span's `events` field (11)."""
    event = ((b"\x09" + _FIXED64.pack(at) if at else b"")
             + (_string(0x12, name) if name else b""))
    if attributes:
        event += _attributes(0x1A, attributes)
    return _field(0x5A, event)


def _step_event(step: tuple[float, float, int, int]) -> bytes:
    """A `step` event: sluice.step.requests, sluice.step.ms and, for a prompt chunk,
    sluice.step.tokens."""
    started, seconds, num_tokens, num_seqs = step
    attributes: dict[str, Any] = {"sluice.step.requests": num_seqs,
                                  "sluice.step.ms": round(seconds * 1000, 3)}
    if num_tokens != 1:  # a prompt chunk; a decode step computes one token
        attributes["sluice.step.tokens"] = num_tokens
    return _event("step", int(started * 1e9), attributes)


def _step_events(steps: Sequence[tuple[float, float, int, int]]) -> bytes:
    """The `step` events of a span (each step's bytes made once: the requests of a
    batch rode in the same steps)."""
    cache = _STEPS
    parts = []
    for step in steps:
        found = cache.get(step)
        if found is None:
            found = _step_event(step)
            if len(cache) >= _CACHE_BOUND:
                cache.clear()
            cache[step] = found
        parts.append(found)
    return b"".join(parts)


def _span(s: Finished) -> bytes:
    """A Span as ScopeSpans' `spans` field (2), its fields in their numbers' order."""
    parts = [_field(0x0A, s.trace_id) if s.trace_id else b"",
             _field(0x12, s.span_id) if s.span_id else b"",
             _string(0x1A, s.trace_state) if s.trace_state else b"",
             _field(0x22, s.parent_id) if s.parent_id else b"",
             _string(0x2A, s.name) if s.name else b"",
             b"\x30" + _varint(s.kind) if s.kind else b""]
    if s.start_ns and s.end_ns:
        parts.append(_TIMES.pack(0x39, s.start_ns, 0x41, s.end_ns))
    else:
        if s.start_ns:
            parts.append(b"\x39" + _FIXED64.pack(s.start_ns))
        if s.end_ns:
            parts.append(b"\x41" + _FIXED64.pack(s.end_ns))
    if s.attributes:
        parts.append(_attributes(0x4A, s.attributes))  # attributes (9)
    for name, at, event_attributes in s.events:  # events (11)
        parts.append(_event(name, at, event_attributes))
    if s.steps:
        parts.append(_step_events(s.steps))
    if s.error is not None:  # status (15): message (2), code (3) ERROR
        status = (_field(0x12, s.error.encode()) if s.error else b"") + b"\x18\x02"
        parts.append(_field(0x7A, status))
    return _field(0x12, b"".join(parts))


def encode(spans: Sequence[Any], resource: Mapping[str, Any], scope: str) -> bytes:
    """One ExportTraceServiceRequest of `spans` (each a `Finished`, or a worker's
    request, `common.tracing.RequestSpans`, whose spans are made here), serialized."""
    out = []
    for item in spans:
        if type(item) is Finished:
            out.append(_span(item))
        else:
            out.extend(map(_span, item.spans()))
    scope_spans = (_field(0x0A, _field(0x0A, scope.encode()) if scope else b"")  # scope
                   + b"".join(out))
    resource_spans = ((_field(0x0A, _attributes(0x0A, resource)) if resource else b"")
                      + _field(0x12, scope_spans))
    return _field(0x0A, resource_spans)


def _num_spans(item: Any) -> int:
    return 1 if type(item) is Finished else item.num_spans


def _env(env: Mapping[str, str], name: str, default: str = "") -> str:
    """OTEL_EXPORTER_OTLP_TRACES_<name>, else OTEL_EXPORTER_OTLP_<name>."""
    return (env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}")
            or default)


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(env.get(name) or default)
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, env.get(name), default)
        return default


@dataclass(frozen=True, slots=True)
class PostOptions:
    """How batches are posted (plain values: they go to the encoding process)."""

    endpoint: str
    headers: Mapping[str, str]
    gzip: bool
    timeout_s: float
    verify: bool | str
    cert: tuple[str, str] | str | None
    resource: Mapping[str, Any]
    scope: str


class Poster:
    """Encodes batches and posts them, retrying what a collector asks to have again."""

    def __init__(self, options: PostOptions):
        self.options = options
        session = self._session = requests.Session()
        session.verify = options.verify
        if options.cert:
            session.cert = options.cert
        # What requests takes from the environment (proxies, a CA bundle, .netrc), read
        # once: read on every post it was ~40 % of a post's CPU (0.7 of 1.7 ms).
        # (A certificate of OTEL_EXPORTER_OTLP_CERTIFICATE wins over REQUESTS_CA_BUNDLE,
        # as in the SDK's exporter.)
        found = session.merge_environment_settings(options.endpoint, {}, None,
                                                   options.verify, None)
        session.proxies, session.verify = found["proxies"], found["verify"]
        session.auth = requests.utils.get_netrc_auth(options.endpoint)
        session.trust_env = False

    def post(self, batch: list[Any], retry: bool) -> str | None:
        """Export `batch` (as `encode` takes it); None when done, else why it was not."""
        o = self.options
        count = sum(_num_spans(item) for item in batch)
        try:
            data = encode(batch, o.resource, o.scope)
        except Exception as exc:
            return f"{count} spans could not be encoded; dropped ({exc!r})"
        if o.gzip:
            data = gzip.compress(data)
        backoff = 0.5
        deadline = time.monotonic() + o.timeout_s
        while True:
            try:
                resp = self._session.post(o.endpoint, data=data, headers=dict(o.headers),
                                          timeout=o.timeout_s)
                if resp.ok:
                    return None
                why = f"HTTP {resp.status_code}"
                again = resp.status_code in _RETRY_STATUS
            except requests.RequestException as exc:
                why, again = f"{type(exc).__name__}: {exc}", True
            if not (retry and again) or time.monotonic() + backoff > deadline:
                return f"{count} spans not exported to {o.endpoint}: {why}"
            time.sleep(backoff)
            backoff *= 2

    def close(self) -> None:
        self._session.close()


class _EncodingProcess:
    """`python -m common.otlp`: a Poster in a process of its own, fed over a pipe.

    Encoding is a Python loop over every attribute and event (~60-85 us a request); in a
    thread of the worker it held the GIL in 5 ms slices, and each time the serving thread
    gave the GIL up meanwhile (a socket call, a model step's native call) it waited for
    one to end: traced bulk runs lost 20-45 % of their tokens/s to it (`sluice bench
    kafka`, tracing section). Here the worker's side only pickles a batch (C, ~2 us a
    span) and waits on the pipe."""

    def __init__(self, options: PostOptions):
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "common.otlp"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, close_fds=True)
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        # The connections own copies of the pipes' ends (they close them when collected).
        self._to = Connection(os.dup(stdin.fileno()), readable=False)
        self._from = Connection(os.dup(stdout.fileno()), writable=False)
        stdin.close()
        stdout.close()
        self._to.send(options)

    def post(self, batch: list[Any], retry: bool) -> str | None:
        self._to.send_bytes(pickle.dumps((batch, retry), pickle.HIGHEST_PROTOCOL))
        return self._from.recv()

    def close(self, timeout_s: float = 10.0) -> None:
        """End the process: the closed pipe is its signal to finish."""
        with contextlib.suppress(OSError):
            self._to.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        with contextlib.suppress(OSError):
            self._from.close()


def _serve_pipe() -> None:
    """The encoding process: options first, then (batch, retry) pairs until the pipe
    closes; each answered with None or why the batch was not exported."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the worker; EOF ends this
    # Background work: on a loaded host the worker's threads come first (a span batch
    # waits; the queue's bound drops what overflows, as the SDK's processor does).
    os.nice(10)
    out_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the answers
    inbox, outbox = Connection(0, writable=False), Connection(out_fd, readable=False)
    poster = Poster(inbox.recv())
    try:
        while True:
            try:
                batch, retry = inbox.recv()
            except EOFError:
                return
            outbox.send(poster.post(batch, retry))
    finally:
        poster.close()


class Exporter:
    """Batches finished spans and has them posted to the OTLP/HTTP endpoint: a thread
    of its own hands them to the encoding process (`_EncodingProcess`)."""

    def __init__(self, env: Mapping[str, str], resource: Mapping[str, Any], scope: str):
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").rstrip("/")
        self.endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                         or (f"{base}/v1/traces" if base else "http://localhost:4318/v1/traces"))
        headers = {"Content-Type": "application/x-protobuf",
                   **parse_env_headers(_env(env, "HEADERS"), liberal=True)}
        compress = _env(env, "COMPRESSION").strip().lower() == "gzip"
        if compress:
            headers["Content-Encoding"] = "gzip"
        client_cert, client_key = _env(env, "CLIENT_CERTIFICATE"), _env(env, "CLIENT_KEY")
        self.options = PostOptions(
            endpoint=self.endpoint, headers=headers, gzip=compress,
            timeout_s=_number(env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                              _number(env, "OTEL_EXPORTER_OTLP_TIMEOUT", 10.0)),
            verify=_env(env, "CERTIFICATE") or True,
            cert=((client_cert, client_key) if client_key else client_cert) or None,
            resource=dict(resource), scope=scope)
        self._delay_s = _number(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self._max_queue = int(_number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048))
        self._max_batch = max(1, int(_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)))
        # (a Finished span or a worker's RequestSpans, how many spans it is), whole: a
        # request's spans are queued, exported or dropped together.
        self._queue: collections.deque[tuple[Any, int]] = collections.deque()
        # Spans queued: added (the request path's count) less taken (the export thread's),
        # each written by one thread only.
        self._added = 0
        self._taken = 0
        self._wake = threading.Event()
        self._exporting = False
        self._stopping = False
        self._poster: _EncodingProcess | None = None
        self.num_dropped = 0
        self.num_exported = 0
        self._warned_at = 0.0
        self._thread = threading.Thread(target=self._run, name="sluice-otlp", daemon=True)
        self._thread.start()

    def add(self, item: Any) -> None:
        """Queue a finished span, or a worker's request (`common.tracing.RequestSpans`):
        the request path's append, never a wait."""
        count = _num_spans(item)
        queued = self._added - self._taken
        if queued + count > self._max_queue:
            self.num_dropped += count
            return
        self._queue.append((item, count))
        self._added += count
        if queued < self._max_batch <= queued + count:
            self._wake.set()

    def export_now(self) -> None:
        """Export what is queued without waiting for the schedule delay."""
        self._wake.set()

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being exported."""
        return not self._queue and not self._exporting

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Send what is queued, then stop the thread and the encoding process."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(self._delay_s)
                self._wake.clear()
                stopping = self._stopping
                self._exporting = True
                while self._queue:
                    batch, count = [], 0
                    # Up to the batch size (a request's spans over it go in the next).
                    while self._queue and (not batch
                                           or count + self._queue[0][1] <= self._max_batch):
                        item, n = self._queue.popleft()
                        batch.append(item)
                        count += n
                    self._taken += count
                    self._export(batch, count, retry=not stopping)
                self._exporting = False
                if self.num_dropped:
                    self._warn(f"{self.num_dropped} spans dropped: the export queue "
                               f"(OTEL_BSP_MAX_QUEUE_SIZE={self._max_queue}) was full")
                    self.num_dropped = 0
                if stopping:
                    return
        finally:
            self._exporting = False
            if self._poster is not None:
                self._poster.close()

    def _export(self, batch: list[Any], count: int, retry: bool) -> None:
        try:
            if self._poster is None:
                self._poster = _EncodingProcess(self.options)
            why = self._poster.post(batch, retry)
        except (OSError, EOFError, pickle.PicklingError) as exc:
            # The encoding process is gone (killed, say): the next batch starts another.
            if self._poster is not None:
                self._poster.close(timeout_s=1)
            self._poster = None
            why = f"{count} spans not exported: the encoding process failed ({exc!r})"
        if why is None:
            self.num_exported += count
        else:
            self._warn(why)

    def _warn(self, message: str) -> None:
        """At most one warning a minute: a collector that is away is said once."""
        now = time.monotonic()
        if now - self._warned_at >= 60:
            self._warned_at = now
            log.warning("%s", message)


if __name__ == "__main__":
    # As the module, not __main__: the spans unpickled here are common.otlp's classes.
    from common.otlp import _serve_pipe as serve

    serve()
