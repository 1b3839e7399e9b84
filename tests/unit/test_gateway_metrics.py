"""The gateway's metrics middleware: every request counted by route template and status
code and timed to the end of its body (a stream's last chunk), /metrics left out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.metrics import METRICS_PATH, GatewayMetrics, ObservedRequests

STREAM_S = 0.3


def app_of(metrics: GatewayMetrics) -> Starlette:
    async def item(request: Request) -> Response:
        return PlainTextResponse(request.path_params["item_id"])

    async def teapot(_request: Request) -> Response:
        return PlainTextResponse("no", status_code=418)

    async def stream(_request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first"
            await asyncio.sleep(STREAM_S)
            yield b"last"
        return StreamingResponse(chunks())

    async def broken(_request: Request) -> Response:
        raise RuntimeError("a bug")

    async def exposition(_request: Request) -> Response:
        return Response(metrics.render())

    routes = [Route("/items/{item_id}", item, methods=["GET"]),
              Route("/teapot", teapot, methods=["POST"]),
              Route("/stream", stream), Route("/broken", broken),
              Route(METRICS_PATH, exposition)]
    return Starlette(routes=routes, middleware=[
        Middleware(ObservedRequests, metrics=metrics, routes=routes)])


def samples(metrics: GatewayMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples}


def test_requests_by_route_template_and_code() -> None:
    metrics = GatewayMetrics()
    with TestClient(app_of(metrics), raise_server_exceptions=False) as client:
        assert client.get("/items/a").status_code == 200
        assert client.get("/items/b").status_code == 200
        assert client.post("/teapot").status_code == 418
        assert client.get("/teapot").status_code == 405  # the route, another method
        assert client.get("/no/such/path").status_code == 404
        assert client.get("/broken").status_code == 500
        assert client.get(METRICS_PATH).status_code == 200
    got = samples(metrics)

    def count(route: str, code: str) -> float | None:
        return got.get(("sluice_gateway_requests_total",
                        frozenset({("route", route), ("code", code)})))

    assert count("/items/{item_id}", "200") == 2  # one series, whatever the id
    assert count("/teapot", "418") == 1
    assert count("/teapot", "405") == 1
    assert count("unmatched", "404") == 1
    assert count("/broken", "500") == 1
    assert not any(dict(labels).get("route") == METRICS_PATH for _, labels in got)
    assert got[("sluice_gateway_requests_in_flight", frozenset())] == 0


def test_routes_named_at_start_have_series_from_the_start() -> None:
    got = samples(GatewayMetrics(["/v1/chat/completions", METRICS_PATH]))
    route = frozenset({("route", "/v1/chat/completions")})
    assert got[("sluice_gateway_request_seconds_count", route)] == 0
    assert not any(dict(labels).get("route") == METRICS_PATH for _, labels in got)


def test_a_stream_is_timed_to_its_last_chunk() -> None:
    metrics = GatewayMetrics()
    with TestClient(app_of(metrics)) as client:
        assert client.get("/stream").text == "firstlast"
    got = samples(metrics)
    route = frozenset({("route", "/stream")})
    assert got[("sluice_gateway_request_seconds_count", route)] == 1
    assert got[("sluice_gateway_request_seconds_sum", route)] >= STREAM_S
    assert got[("sluice_gateway_request_seconds_bucket", route | {("le", "0.25")})] == 0
