"""The gateway's Prometheus metrics: every HTTP request by route and status code, and how
long it took as its client saw it (a streamed answer until its last chunk).

`GatewayMetrics` owns a private registry (two gateways in one process never share
counters) and is an ASGI middleware: it times each request from its arrival to the end
of its response body. The route label is the matched route's path template
(`/v1/responses/{response_id}`), `unmatched` for any other path, so a client cannot
grow the label set. `GET /metrics` renders the registry (`render`); it is not counted.

Per model figures (TTFT, end to end from the broker timestamp, tokens) are the
workers'; these say what the clients of this gateway got.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# 5 ms .. 10 min: from a refused request to a long generation streamed to its end.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
METRICS_PATH = "/metrics"
UNMATCHED = "unmatched"


class GatewayMetrics:
    def __init__(self, routes: Iterable[str] = ()) -> None:
        """`routes`: path templates whose duration series exist (zero) from the start, so
        a route's first requests are a rise Prometheus sees, not where its series begins."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter("sluice_gateway_requests", "HTTP requests by route and "
                                 "status code.", ("route", "code"), registry=r)
        self._seconds = Histogram("sluice_gateway_request_seconds", "HTTP request to the "
                                  "end of its response (a stream's last chunk).", ("route",),
                                  buckets=SECONDS_BUCKETS, registry=r)
        self.in_flight = Gauge("sluice_gateway_requests_in_flight",
                               "HTTP requests not yet answered to their end.", registry=r)
        for route in routes:
            if route != METRICS_PATH:
                self._seconds.labels(route)

    def observe(self, route: str, code: int, seconds: float) -> None:
        self._requests.labels(route, str(code)).inc()
        self._seconds.labels(route).observe(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ObservedRequests:
    """ASGI middleware (starlette's `Middleware(ObservedRequests, metrics=..., routes=...)`):
    each HTTP request counted and timed into `metrics`, by the route it matches."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: Sequence[BaseRoute]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") == METRICS_PATH:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        code = 500  # the app raised before it answered
        self.metrics.in_flight.inc()

        async def watched(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.observe(route_of(self.routes, scope), code, time.monotonic() - started)


def route_of(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The path template of the route `scope` matches, or UNMATCHED."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return str(getattr(route, "path", UNMATCHED))
        if match is Match.PARTIAL and partial is None:  # the path, another method
            partial = str(getattr(route, "path", UNMATCHED))
    return partial or UNMATCHED
