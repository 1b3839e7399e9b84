"""`sluice gateway`: an OpenAI-compatible HTTP API onto the topics.

`POST /v1/chat/completions` and `POST /v1/completions` become requests on the
model's request topic (`MODEL` or `MODEL:ADAPTER` as the model id); their
events come back on this gateway's own reply topic (`<prefix>.gateway.<id>`,
made at start) and go out as OpenAI's JSON or server-sent event chunks.
`GET /v1/models` lists the models and adapters the caller's key is granted;
`GET /health` says the gateway is up; `GET /metrics` serves Prometheus metrics
(`gateway.metrics`). The bearer token is the sluice API key: the workers check
it, as for any request. The Kafka key is the `x-session-id`
header, else a digest of the model and the conversation's opening, so every
turn of a conversation reaches the worker holding its KV cache. A client that
disconnects cancels its request (a cancel record: the worker stops it). A
choice's answer or failure is the one terminal event of its SDK stream, the
request's outcome by `schemas.Outcome` (a re-served attempt's `timeout` never
hides an earlier attempt's answer), so the gateway answers as every reader does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import KafkaAccessError
from common.settings import Settings
from common.topics import TopicAdmin, TopicSpec
from common.tracing import Tracing
from gateway import openai_api as oai
from gateway import openai_errors as errs
from gateway.metrics import METRICS_PATH, GatewayMetrics, ObservedRequests
from gateway.openai_stream import ToolCallStream
from gateway.readiness import registered_at, serving_workers
from gateway.responses import ResponsesRoutes
from gateway.tracing import TraceRequests, trace_context
from schemas import DoneEvent, ErrorEvent, ReplyEvent, TimeoutEvent, TokenEvent
from sluice.client import Client
from sluice.errors import InvalidRequestError, RequestTimeoutError, UnknownModelError

log = logging.getLogger(__name__)

T = TypeVar("T")
REPLY_RETENTION_MS = 3_600_000  # a gateway's replies are read at once; an hour is plenty
DISCONNECT_POLL_S = 0.25
MAX_N = 8  # choices per request


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _error(exc: oai.OpenAIError) -> Response:
    return _JSON(exc.body(), status_code=exc.status)


class Gateway(ResponsesRoutes):
    def __init__(self, settings: Settings, instance_id: str | None = None,
                 tracing: Tracing | None = None):
        self.settings = settings
        # A span per HTTP request, as the OTEL_* variables ask (default: off).
        self.tracing = tracing if tracing is not None else Tracing.from_env("sluice-gateway")
        self.instance_id = instance_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.reply_topic = settings.topic(f"gateway.{self.instance_id}")
        self.client = Client(settings)
        self._checker: Any = None
        self._pool: Any = None
        self._expiry: asyncio.Task[None] | None = None
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route(METRICS_PATH, self.prometheus, methods=["GET"]),
        ]
        self.metrics = GatewayMetrics(route.path for route in routes)
        self.app = Starlette(routes=routes, lifespan=self._lifespan, middleware=[
            Middleware(ObservedRequests, metrics=self.metrics, routes=routes),
            Middleware(_RequestIds), *(
                [Middleware(TraceRequests, tracing=self.tracing)] if self.tracing else [])],
            exception_handlers={HTTPException: _http_error})

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        from common.db import create_pool, notify_channel
        from ingest.permissions import PermissionChecker

        async with TopicAdmin(self.settings) as admin:
            await admin.ensure([TopicSpec(self.reply_topic, 1,
                                          {"retention.ms": str(REPLY_RETENTION_MS)})])
        self._pool = await create_pool(self.settings, max_size=2)
        self._checker = PermissionChecker(self._pool, notify_channel(self.settings.db_schema),
                                          call_timeout_s=self.settings.client.timeout_secs)
        self._expiry = self.start_responses()
        log.info("gateway %s replies on %s", self.instance_id, self.reply_topic)

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        await self.client.aclose()
        if self._pool is not None:
            await self._pool.close()
        await asyncio.to_thread(self.tracing.shutdown)  # the last spans exported

    # ---- routes --------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat", oai.ChatCompletionBody)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion", oai.CompletionBody)

    async def embeddings(self, _request: Request) -> Response:
        return _error(oai.OpenAIError(
            404, "sluice serves text generation (chat completions, completions, responses), "
            "not embeddings", "invalid_request_error", "unsupported_endpoint"))

    async def health(self, _request: Request) -> Response:
        """Liveness: the gateway answers (whatever its models' workers do)."""
        return _JSON({"status": "ok", "reply_topic": self.reply_topic})

    async def ready(self, request: Request) -> Response:
        """Readiness: 200 when a live worker serves (`?model=M`: serves model M, else any
        registered model), 503 otherwise; the body says it per model."""
        try:
            serving = await serving_workers(self._pool)
            registered = [d.model for d in await asyncio.to_thread(self.client.models.list)]
        except Exception as exc:  # the database away: not ready, and why
            return _JSON({"status": "not_ready", "reason": f"{type(exc).__name__}: {exc}"},
                         status_code=503)
        wanted = request.query_params.get("model")
        models = {m: {"ready": m in serving, "serving_workers": serving.get(m, 0)}
                  for m in registered if wanted in (None, m)}
        ok = any(m["ready"] for m in models.values())
        return _JSON({"status": "ready" if ok else "not_ready", "models": models},
                     status_code=200 if ok else 503)

    async def prometheus(self, _request: Request) -> Response:
        """Prometheus metrics of this gateway (`gateway.metrics`)."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        try:
            return _JSON({"object": "list", "data": await self._granted_models(request)})
        except oai.OpenAIError as exc:
            return _error(exc)

    async def model(self, request: Request) -> Response:
        wanted = request.path_params["model_id"]
        try:
            found = [m for m in await self._granted_models(request) if m["id"] == wanted]
        except oai.OpenAIError as exc:
            return _error(exc)
        if not found:
            return _error(oai.OpenAIError(404, f"model {wanted!r} does not exist or this key "
                                          "is not granted it", "not_found_error",
                                          "model_not_found"))
        return _JSON(found[0])

    # ---- helpers -------------------------------------------------------------------------

    def _api_key(self, request: Request) -> str:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise oai.OpenAIError(401, "missing `Authorization: Bearer <sluice API key>`",
                                  "authentication_error", "unauthorized")
        return key.strip()

    async def _granted_models(self, request: Request) -> list[dict[str, Any]]:
        key = self._api_key(request)
        auth = f"Bearer {key}"
        if await self._checker.tenant_of(auth) is None:
            raise oai.OpenAIError(401, "unknown or revoked API key", "authentication_error",
                                  "unauthorized")
        deployments = await asyncio.to_thread(self.client.models.list)
        serving = await serving_workers(self._pool)
        created_at = await registered_at(self._pool)
        out = []
        for dep in deployments:
            created = created_at.get(dep.model, 0)
            for adapter in [None, *(a.name for a in dep.adapters)]:
                if (await self._checker.check(auth, dep.model, adapter)).allowed:
                    out.append({"id": dep.model if adapter is None else f"{dep.model}:{adapter}",
                                "object": "model", "created": created, "owned_by": "sluice",
                                "root": dep.model, "parent": None if adapter is None
                                else dep.model, "ready": dep.model in serving})
        return out

    async def _generate(self, request: Request, kind: oai.Kind,
                        body_type: type[oai.ChatCompletionBody] | type[oai.CompletionBody]
                        ) -> Response:
        streams: list[AsyncIterator[ReplyEvent]] = []
        try:
            key = self._api_key(request)
            body = oai.parse_body(body_type, await request.body())
            body.unserved(max_n=MAX_N)
            fields = body.fields()
            asked = errs.asked_of(kind, fields)
            model, adapter = oai.split_model(body.model)
            session = oai.session_key(body.model, fields, request.headers.get("x-session-id"))
            request_id, n = f"oai-{uuid.uuid4().hex}", body.n

            def open_choice(i: int) -> AsyncIterator[ReplyEvent]:
                choice = dict(fields)
                if n > 1 and "seed" in choice:
                    choice["seed"] += i  # n samples, not n copies of one
                events = self.client.stream(
                    model=model, adapter=adapter, api_key=key,
                    request_id=request_id if n == 1 else f"{request_id}-{i}",
                    session_id=session, reply_topic=self.reply_topic,
                    stream=body.stream or n > 1, **trace_context(request), **choice)
                streams.append(events)
                return events

            first = await self._unless_disconnected(request, self._first(open_choice(0), asked))
            if first is None:  # the client left; the stream's close sent the cancel
                return Response(status_code=499)
            firsts = [first]
            if n > 1:
                # The other choices go once the first has its first token: its prompt is
                # then in the KV cache, and the same session key takes them to the same
                # worker, so they share its prompt blocks instead of computing them again.
                rest = await self._unless_disconnected(request, self._firsts(
                    [open_choice(i) for i in range(1, n)], asked))
                if rest is None:
                    return Response(status_code=499)
                firsts += rest
            created = oai.now()
            if not body.stream:
                dones = await self._unless_disconnected(request, asyncio.gather(
                    *(self._done(f, s, asked) for f, s in zip(firsts, streams, strict=True))))
                await _close_all(streams)
                if dones is None:
                    return Response(status_code=499)
                build = oai.chat_completion if kind == "chat" else oai.text_completion
                return _JSON(build(dones, body.model, created, request_id))
        except oai.OpenAIError as exc:
            await _close_all(streams)
            return _error(exc)
        except BaseException:
            await _close_all(streams)
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        tools = bool(fields.get("tools")) and fields.get("tool_choice") != "none"
        return StreamingResponse(
            self._chunks(kind, request_id, firsts, streams, body.model, created, include_usage,
                         tools),
            media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def _firsts(self, streams: list[AsyncIterator[ReplyEvent]],
                      asked: errs.Asked) -> list[ReplyEvent]:
        results = await asyncio.gather(*(self._first(s, asked) for s in streams),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    async def _done(self, first: ReplyEvent, events: AsyncIterator[ReplyEvent],
                    asked: errs.Asked = errs.CHAT_ASKED) -> DoneEvent:
        """The choice's `done` event (a failure raised as an OpenAI error, in the terms of
        what the request `asked`)."""
        event: ReplyEvent = first
        while not isinstance(event, DoneEvent):
            self._raise_if_failed(event, asked)
            try:
                event = await anext(events)
            except StopAsyncIteration:
                raise oai.OpenAIError(500, "the reply stream ended without an answer",
                                      "server_error") from None
            except RequestTimeoutError as exc:
                raise oai.OpenAIError(504, str(exc), "timeout_error", "timeout") from None
        return event

    async def _first(self, events: AsyncIterator[ReplyEvent],
                     asked: errs.Asked = errs.CHAT_ASKED) -> ReplyEvent:
        """The first event, or the request's failure as an OpenAI error (in the terms of
        what the request `asked`: a context overflow names its prompt's field)."""
        try:
            event = await anext(events)
        except UnknownModelError as exc:
            raise oai.OpenAIError(404, str(exc), "not_found_error", "model_not_found") from None
        except InvalidRequestError as exc:
            raise oai.OpenAIError(400, str(exc)) from None
        except RequestTimeoutError as exc:
            raise oai.OpenAIError(504, str(exc), "timeout_error", "timeout") from None
        except KafkaAccessError as exc:
            raise oai.OpenAIError(503, str(exc), "server_error", "unavailable") from None
        except StopAsyncIteration:
            raise oai.OpenAIError(500, "the reply stream ended without an event",
                                  "server_error") from None
        self._raise_if_failed(event, asked)
        return event

    @staticmethod
    def _raise_if_failed(event: ReplyEvent, asked: errs.Asked = errs.CHAT_ASKED) -> None:
        if isinstance(event, ErrorEvent):
            raise errs.error_of(event.code.value, event.message, asked)
        if isinstance(event, TimeoutEvent):
            raise oai.OpenAIError(504, f"no first token within max_ttft_ms "
                                  f"({event.max_ttft_ms} ms; waited {event.waited_ms:.0f} ms)",
                                  "timeout_error", "timeout")

    async def _unless_disconnected(self, request: Request, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None (work cancelled) if the client disconnects first."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    return None
        finally:
            if not task.done():
                task.cancel()

    async def _chunks(self, kind: oai.Kind, request_id: str, firsts: list[ReplyEvent],
                      streams: list[AsyncIterator[ReplyEvent]], model_id: str, created: int,
                      include_usage: bool, tools: bool = False) -> AsyncIterator[bytes]:
        """Server-sent events of every choice, as their events come. Closing this early
        (a disconnect) closes the streams, whose close sends the cancel records. With
        tools, text that may be a call is held back and calls go out as tool_calls
        deltas (`openai_stream`); with include_usage every chunk but the last has
        `usage: null`, as OpenAI's do."""
        def sse(payload: dict[str, Any]) -> bytes:
            if include_usage and "usage" not in payload and "error" not in payload:
                payload["usage"] = None
            return b"data: " + orjson.dumps(payload) + b"\n\n"

        calls = [ToolCallStream() for _ in firsts] if tools and kind == "chat" else None

        queue: asyncio.Queue[tuple[int, ReplyEvent | Exception | None]] = asyncio.Queue()

        async def follow(index: int) -> None:
            event: ReplyEvent | None = firsts[index]
            try:
                while event is not None:
                    await queue.put((index, event))
                    if not isinstance(event, TokenEvent):
                        break
                    try:
                        event = await anext(streams[index])
                    except StopAsyncIteration:
                        event = None
            except RequestTimeoutError as exc:
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        followers = [asyncio.create_task(follow(i)) for i in range(len(firsts))]
        dones: list[DoneEvent] = []
        offsets = [0] * len(firsts)  # of each choice's next token text (text_offset)
        try:
            if kind == "chat":
                for i in range(len(firsts)):
                    yield sse(oai.chunk(kind, request_id, model_id, created, text="",
                                        role=True, index=i))
            running = len(firsts)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, TokenEvent):
                    text = calls[index].push(item.text) if calls else item.text
                    if text or item.logprobs:
                        yield sse(oai.chunk(kind, request_id, model_id, created,
                                            text=text, logprobs=item.logprobs,
                                            offset=offsets[index], index=index))
                    offsets[index] += len(item.text)
                elif isinstance(item, DoneEvent):
                    dones.append(item)
                    if calls:
                        rest, pieces = calls[index].finish(item)
                        if rest:
                            yield sse(oai.chunk(kind, request_id, model_id, created, text=rest,
                                                index=index))
                        for call in pieces:
                            for piece in call:
                                yield sse(oai.chunk(kind, request_id, model_id, created,
                                                    tool_call=piece, index=index))
                    yield sse(oai.chunk(kind, request_id, model_id, created,
                                        finish=oai.finish_reason(item), index=index))
                elif isinstance(item, RequestTimeoutError):
                    yield sse(oai.OpenAIError(504, str(item), "timeout_error",
                                              "timeout").body())
                else:
                    try:
                        self._raise_if_failed(item)  # type: ignore[arg-type]
                    except oai.OpenAIError as exc:
                        yield sse(exc.body())
            if include_usage and len(dones) == len(firsts):
                yield sse(oai.usage_chunk(kind, dones, request_id, model_id, created))
            yield b"data: [DONE]\n\n"
        finally:
            for task in followers:
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)
            await _close_all(streams)


async def _close_all(streams: list[AsyncIterator[ReplyEvent]]) -> None:
    """Close every choice's stream; one that had not ended sends its cancel record."""
    for events in streams:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]


async def serve(settings: Settings, host: str, port: int, instance_id: str | None = None,
                ready: asyncio.Event | None = None, tracing: Tracing | None = None) -> None:
    """Run the gateway until cancelled (or a signal, under `sluice gateway`)."""
    import uvicorn

    gateway = Gateway(settings, instance_id, tracing)
    config = uvicorn.Config(gateway.app, host=host, port=port, loop="none", http="httptools",
                            log_level="warning", lifespan="on", access_log=False,
                            timeout_graceful_shutdown=5)  # streams still open end then
    server = uvicorn.Server(config)
    if ready is None:
        await server.serve()
        return
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                await task
                raise RuntimeError("the gateway stopped before it started")
            await asyncio.sleep(0.05)
        ready.set()
        await asyncio.shield(task)
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await task


class _RequestIds:
    """An `x-request-id` on every response: the caller's own when it sent one, else a
    new one (quoted in errors, for support)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given if given and len(given) <= 128 else f"req_{uuid.uuid4().hex}".encode()

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, with_id)


async def _http_error(_request: Request, exc: Exception) -> Response:
    """Unknown routes and methods as OpenAI's JSON error bodies (not plain text)."""
    status = getattr(exc, "status_code", 500)
    what = {404: "unknown route", 405: "method not allowed on this route"}.get(status,
                                                                              str(exc))
    return _error(oai.OpenAIError(status, f"{what}: {_request.method} {_request.url.path}",
                                  "invalid_request_error", "not_found" if status == 404
                                  else "method_not_allowed"))
