"""Prometheus metrics of one worker, served over HTTP for scraping and probes.

`WorkerMetrics` owns a private `CollectorRegistry` (never the library's
global one), so two workers in one process — or one test per metric — never
share counters. Every series carries `model` and `pool`; a few add one more
label (`type`, `code`, `partition`, `outcome`, `status`).

The worker calls small typed methods at its events; rates (tokens/s, cache
hit ratio) are left to PromQL, e.g.

    rate(sluice_generated_tokens_total[1m])
    rate(sluice_cached_prompt_tokens_total[5m]) / rate(sluice_prompt_tokens_total[5m])

`serve(port)` exposes the registry with prometheus_client's own WSGI app and
adds two probe paths: `/healthz` (the process answers) and `/readyz` (503
until `set_ready(True)`, i.e. the model is loaded and the worker consumes).
The library's `start_http_server` cannot serve a readiness state, hence the
thin server here; everything else on the port is the library's exposition.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
)

from schemas import ErrorCode

log = logging.getLogger(__name__)

TerminalKind = Literal["done", "error", "timeout"]
TERMINAL_KINDS: tuple[TerminalKind, ...] = ("done", "error", "timeout")

# 1 ms .. 60 s, roughly 1-2.5-5 per decade: TTFT is bounded by max_ttft (60 s
# by default); inter-token latency lives at the low end.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SEQS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKENS_PER_STEP_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

_BASE = ("model", "pool")

# `sluice_worker_status`: the heartbeat's statuses (`sluice workers`), one series each.
# "waiting (why)" is exported as "waiting": the why is free text, not a label value.
WORKER_STATUSES = ("warming", "waiting", "serving", "serving (compiling)", "serving (compiled)",
                   "idle", "stopping", "stopped")


class WorkerMetrics:
    """All of a worker's series, bound to its model and pool."""

    def __init__(self, model: str, pool: str) -> None:
        self.model = model
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=True)
        self._ready = threading.Event()
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _BASE, registry=r).labels(model, pool)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _BASE, registry=r).labels(model, pool)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, _BASE, buckets=tuple(buckets), registry=r).labels(
                model, pool)

        self._waiting = gauge("sluice_requests_waiting",
                              "Requests admitted by the worker, not yet scheduled (queue depth).")
        self._running = gauge("sluice_requests_running", "Requests holding KV blocks.")
        self._kv_used = gauge("sluice_kv_blocks_used", "KV-cache blocks in use.")
        self._kv_free = gauge("sluice_kv_blocks_free", "KV-cache blocks free or evictable.")
        self._seqs_per_step = histogram("sluice_batch_sequences",
                                        "Sequences in one model step.", SEQS_PER_STEP_BUCKETS)
        self._tokens_per_step = histogram("sluice_batch_tokens",
                                          "Tokens scheduled in one model step.",
                                          TOKENS_PER_STEP_BUCKETS)
        self._step_seconds = histogram("sluice_step_seconds", "Wall time of one model step.",
                                       STEP_SECONDS_BUCKETS)
        self._generated = counter("sluice_generated_tokens", "Tokens generated (sampled).")
        self._ttft = histogram("sluice_ttft_seconds",
                               "Time to first token, broker timestamp to first token.",
                               LATENCY_BUCKETS)
        self._end_to_end = histogram("sluice_request_seconds",
                                     "End to end, broker timestamp to the done event.",
                                     LATENCY_BUCKETS)
        # Labelled once known (the deployment's placement): never a misleading 0.
        self._max_ttft = Gauge("sluice_max_ttft_seconds",
                               "The model's max_ttft (placement): a request without its "
                               "first token by then times out.", _BASE, registry=r)
        self._weights = Gauge("sluice_model_weights",
                              "1 for the weights the worker serves: a GGUF file's formats "
                              "as held (\"GGUF 211 Q8_0\"), else the dtype.",
                              [*_BASE, "format"], registry=r)
        self._itl = histogram("sluice_inter_token_seconds",
                              "Time between consecutive tokens of one request.",
                              LATENCY_BUCKETS)
        self._prompt = counter("sluice_prompt_tokens", "Prompt tokens of served requests.")
        self._cached = counter("sluice_cached_prompt_tokens",
                               "Prompt tokens found in the KV cache (not recomputed).")
        self._adapter_swaps = counter("sluice_adapter_swaps",
                                      "LoRA adapters loaded into a slot.")
        self._adapters_loaded = gauge("sluice_adapters_loaded",
                                      "LoRA adapters this replica serves (in host memory).")
        self._adapter_slots_used = gauge("sluice_adapter_slots_used",
                                         "Adapter slots holding an adapter (device memory).")
        self._adapter_slots = gauge("sluice_adapter_slots",
                                    "Adapter slots of the runtime (max_adapters).")
        self._timeouts = counter("sluice_request_timeouts",
                                 "Requests sent to the timeout topic.")
        self._dead_letters = counter("sluice_dead_lettered_records",
                                     "Records written to the dead-letter topic.")
        self._misrouted = counter("sluice_misrouted_requests",
                                  "Requests whose key was not on its murmur2 partition (a "
                                  "producer partitions differently and splits sessions).")
        self._terminals = Counter("sluice_requests", "Terminal events by type.",
                                  (*_BASE, "type"), registry=r)
        self._errors = Counter("sluice_request_errors", "Error events by code.",
                               (*_BASE, "code"), registry=r)
        self._cancels = Counter(
            "sluice_cancels", "Cancel records by outcome: cancelled (a held request "
            "stopped), ignored (not held: finished, or never here), refused (another "
            "tenant's key).", (*_BASE, "outcome"), registry=r)
        self._transactions = Counter(
            "sluice_transactions", "Kafka transactions committed (exactly-once delivery).",
            _BASE, registry=r).labels(model, pool)
        self._lag = Gauge("sluice_consumer_lag",
                          "Records of an assigned request partition not yet committed.",
                          (*_BASE, "partition"), registry=r)
        self._statuses = dict.fromkeys(WORKER_STATUSES)  # ordered; grows, never shrinks
        self._status = Gauge("sluice_worker_status",
                             "1 for the worker's status now, 0 for the others.",
                             (*_BASE, "status"), registry=r)
        # Zero-valued series from the start, so rate() and absent() behave.
        for kind in TERMINAL_KINDS:
            self._terminals.labels(model, pool, kind)
        for code in ErrorCode:
            self._errors.labels(model, pool, code.value)
        self.set_status("warming")

    # ---- scheduler and runtime ---------------------------------------------------------

    def set_queue(self, num_waiting: int, num_running: int) -> None:
        self._waiting.set(num_waiting)
        self._running.set(num_running)

    def set_kv(self, num_used_blocks: int, num_free_blocks: int) -> None:
        self._kv_used.set(num_used_blocks)
        self._kv_free.set(num_free_blocks)

    def observe_step(self, num_seqs: int, num_tokens: int, seconds: float | None = None) -> None:
        """One executed model step: its batch size and, if measured, its duration."""
        self._seqs_per_step.observe(num_seqs)
        self._tokens_per_step.observe(num_tokens)
        if seconds is not None:
            self._step_seconds.observe(seconds)

    def add_generated_tokens(self, num_tokens: int) -> None:
        self._generated.inc(num_tokens)

    def add_adapter_swaps(self, num_swaps: int = 1) -> None:
        self._adapter_swaps.inc(num_swaps)

    def set_adapters(self, num_loaded: int, num_slots_used: int, num_slots: int) -> None:
        self._adapters_loaded.set(num_loaded)
        self._adapter_slots_used.set(num_slots_used)
        self._adapter_slots.set(num_slots)

    # ---- the worker --------------------------------------------------------------------

    def set_status(self, status: str) -> None:
        """The heartbeat's status: its series is 1, every other status's 0."""
        now = status if status in self._statuses else status.partition(" (")[0]
        self._statuses.setdefault(now, None)  # a status added later gets a series too
        for known in self._statuses:
            self._status.labels(self.model, self.pool, known).set(1 if known == now else 0)

    def set_max_ttft(self, seconds: float) -> None:
        self._max_ttft.labels(self.model, self.pool).set(seconds)

    def set_weights_format(self, weights: str) -> None:
        """1 for the weights as loaded (a GGUF file's quantization, or the dtype), the
        format before a reload removed."""
        self._weights.clear()
        self._weights.labels(self.model, self.pool, weights).set(1)

    # ---- requests ----------------------------------------------------------------------

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(max(0.0, seconds))

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(max(0.0, seconds))

    def observe_end_to_end(self, seconds: float) -> None:
        self._end_to_end.observe(max(0.0, seconds))

    def observe_prompt(self, num_prompt_tokens: int, num_cached_prompt_tokens: int) -> None:
        """A served request's prompt: the cache hit ratio is cached / prompt."""
        self._prompt.inc(num_prompt_tokens)
        self._cached.inc(num_cached_prompt_tokens)

    def observe_terminal(self, kind: TerminalKind, code: str | None = None) -> None:
        """The one terminal event of a request attempt; `code` for errors."""
        if kind not in TERMINAL_KINDS:
            raise ValueError(f"unknown terminal event type {kind!r}")
        self._terminals.labels(self.model, self.pool, kind).inc()
        if kind == "error":
            self._errors.labels(self.model, self.pool, code or ErrorCode.INTERNAL.value).inc()
        elif kind == "timeout":
            self._timeouts.inc()

    def observe_dead_letter(self) -> None:
        self._dead_letters.inc()

    def observe_misrouted_key(self) -> None:
        self._misrouted.inc()

    def observe_cancel(self, outcome: str) -> None:
        self._cancels.labels(self.model, self.pool, outcome).inc()

    def observe_transaction(self) -> None:
        self._transactions.inc()

    # ---- Kafka -------------------------------------------------------------------------

    def set_lag(self, partition: int, lag: int) -> None:
        self._lag.labels(self.model, self.pool, str(partition)).set(max(0, lag))

    def forget_partition(self, partition: int) -> None:
        """A partition was revoked: its lag is another worker's to report."""
        with contextlib.suppress(KeyError):
            self._lag.remove(self.model, self.pool, str(partition))

    # ---- exposition ----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def set_ready(self, ready: bool) -> None:
        if ready:
            self._ready.set()
        else:
            self._ready.clear()

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "0.0.0.0") -> MetricsServer:
        return start_http_server(self, port, host)

    def serve_or_log(self, port: int) -> MetricsServer | None:
        """The endpoint, or None (logged): serving matters more than being scraped."""
        try:
            server = self.serve(port)
        except OSError as exc:
            log.error("metrics endpoint not started on port %d: %s", port, exc)
            return None
        log.info("metrics on port %d", server.port)
        return server


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes and probes every few seconds would flood the worker's log."""


_StartResponse = Callable[[str, list[tuple[str, str]]], object]


def _probe_app(metrics: WorkerMetrics) -> Callable[[dict[str, object], _StartResponse],
                                                   Iterable[bytes]]:
    exposition = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, object], start_response: _StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO")
        if path == "/healthz":
            status, body = "200 OK", b"ok\n"
        elif path == "/readyz":
            status, body = ("200 OK", b"ready\n") if metrics.ready else (
                "503 Service Unavailable", b"not ready\n")
        else:
            return exposition(environ, start_response)
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    return app


class MetricsServer:
    """A running exposition server; `close()` stops it and frees the port."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_http_server(metrics: WorkerMetrics, port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serve `/metrics` (any other path too), `/healthz` and `/readyz` on a daemon
    thread; `port=0` picks a free port (see `MetricsServer.port`)."""
    server = make_server(host, port, _probe_app(metrics), _ThreadingServer,
                         handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="sluice-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
