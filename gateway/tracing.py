"""The gateway's part of a trace: an HTTP request's `traceparent` onto its request records.

With tracing on, `TraceRequests` gives every HTTP request a server span, a child
of the span its `traceparent` header names, and the request records the
gateway produces for it carry that span's context, so the worker's spans hang
under the gateway's. With tracing off, the HTTP request's own `traceparent` and
`tracestate` pass through onto its records unchanged (`trace_context`).
"""

from __future__ import annotations

import re
import time
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.tracing import TRACEPARENT, TRACESTATE, Tracing, trace_headers

_SCOPE_KEY = "sluice.trace_headers"  # an ASGI scope extension: the span's context
# Ids in paths, out of span names (a name is a kind of operation, not one instance).
_ID_SEGMENT = re.compile(r"^(/v1/(?:responses|models))/.+$")


def trace_context(request: Request) -> dict[str, Any]:
    """The W3C trace context of `request`'s records, as `Client.stream` takes it."""
    headers = request.scope.get(_SCOPE_KEY)
    if headers is None:
        return {"traceparent": request.headers.get(TRACEPARENT),
                "tracestate": request.headers.get(TRACESTATE)}
    found = {name: value.decode("latin-1") for name, value in headers}
    return {"traceparent": found.get(TRACEPARENT), "tracestate": found.get(TRACESTATE)}


class TraceRequests:
    """ASGI middleware: a server span per HTTP request, ended when its response is."""

    def __init__(self, app: ASGIApp, tracing: Tracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or [])
        parent = trace_headers(_text(given.get(b"traceparent")),
                               _text(given.get(b"tracestate")))
        method, path = scope["method"], scope["path"]
        route = _ID_SEGMENT.sub(r"\1/{id}", path)
        span = self.tracing.begin(
            f"{method} {route}", parent, time.time(), kind="server",
            attributes={"http.request.method": method, "url.path": path})
        scope[_SCOPE_KEY] = span.headers
        status = 500  # a handler that raises before it answers

        async def answering(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, answering)
        finally:
            self.tracing.end(span, time.time(),
                             attributes={"http.response.status_code": status},
                             error=f"HTTP {status}" if status >= 500 else None)


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None
