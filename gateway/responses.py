"""The gateway's Responses API routes: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}` (translation in `gateway.responses_api`, storage in
`gateway.responses_store`).

A response continues its `previous_response_id`'s conversation on the same Kafka
session key, so the turn reaches the worker that holds the conversation's KV cache
(`usage.input_tokens_details.cached_tokens` shows it). Streamed, the answer goes out
as the API's typed server-sent events, calls as `function_call` items with their
arguments in `response.function_call_arguments.delta` pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import openai_api as oai
from gateway import openai_errors as errs
from gateway import responses_api as rapi
from gateway.openai_stream import ToolCallStream
from gateway.responses_store import EXPIRE_EVERY_S, ResponseStore
from gateway.tracing import trace_context
from schemas import DoneEvent, ReplyEvent, TokenEvent
from sluice.errors import RequestTimeoutError

log = logging.getLogger(__name__)
T = TypeVar("T")


class ResponsesRoutes:
    """Mixed into `Gateway` (which gives `client`, `reply_topic`, `_checker`, `_pool` and
    the helpers `_api_key`, `_first`, `_done`, `_unless_disconnected`)."""

    client: Any
    reply_topic: str
    _checker: Any
    _pool: Any
    store: ResponseStore | None = None

    def start_responses(self) -> asyncio.Task[None]:
        self.store = ResponseStore(self._pool)
        return asyncio.create_task(self._expire_responses(), name="expire responses")

    async def _expire_responses(self) -> None:
        while True:
            try:
                assert self.store is not None
                removed = await self.store.expire()
                if removed:
                    log.info("%d stored responses expired", removed)
            except Exception as exc:  # the database away: next time
                log.warning("expiring stored responses failed: %s", exc)
            await asyncio.sleep(EXPIRE_EVERY_S)

    async def _tenant(self, request: Request) -> tuple[str, str]:
        key = self._api_key(request)  # type: ignore[attr-defined]
        tenant = await self._checker.tenant_of(f"Bearer {key}")
        if tenant is None:
            raise oai.OpenAIError(401, "unknown or revoked API key", "authentication_error",
                                  "unauthorized")
        return key, tenant

    async def responses(self, request: Request) -> Response:
        try:
            key, tenant = await self._tenant(request)
            body = oai.parse_body(rapi.ResponsesBody, await request.body())
            body.unserved()
            earlier: list[dict[str, Any]] = []
            session = request.headers.get("x-session-id")
            if body.previous_response_id is not None:
                assert self.store is not None
                stored = await self.store.get(body.previous_response_id, tenant)
                if stored is None:
                    raise oai.OpenAIError(404, f"previous response "
                                          f"{body.previous_response_id!r} not found (never "
                                          "stored, expired, or another tenant's)",
                                          param="previous_response_id",
                                          code="previous_response_not_found")
                earlier, session = stored.conversation, session or stored.session_key
            fields = body.fields(earlier)
            asked = errs.asked_of("responses", fields)
            model, adapter = oai.split_model(body.model)
            session = oai.session_key(body.model, fields, session)
            response_id = rapi.new_id("resp")
            events = self.client.stream(model=model, adapter=adapter, api_key=key,
                                        request_id=response_id, session_id=session,
                                        reply_topic=self.reply_topic, stream=body.stream,
                                        **trace_context(request), **fields)
            created = rapi.now()
            keep = _Keeper(self.store if body.store else None, response_id, tenant,
                           body, fields["messages"], session)
            if body.stream:
                return StreamingResponse(self._response_events(request, response_id, body,
                                                               created, events, keep, asked),
                                         media_type="text/event-stream",
                                         headers={"cache-control": "no-cache"})
            try:
                first = await self._unless_disconnected(  # type: ignore[attr-defined]
                    request, self._first(events, asked))  # type: ignore[attr-defined]
                if first is None:
                    return Response(status_code=499)
                done = await self._unless_disconnected(  # type: ignore[attr-defined]
                    request, self._done(first, events, asked))  # type: ignore[attr-defined]
            finally:
                await events.aclose()
            if done is None:
                return Response(status_code=499)
            answer = rapi.response_object(response_id, body, created, done)
            await keep.put(answer, done)
            return oai_json(answer)
        except oai.OpenAIError as exc:
            return oai_json(exc.body(), exc.status)

    async def _response_events(self, request: Request, response_id: str,
                               body: rapi.ResponsesBody, created: int,
                               events: AsyncIterator[ReplyEvent], keep: _Keeper,
                               asked: errs.Asked) -> AsyncIterator[bytes]:
        out = rapi.ResponseEvents(response_id, body, created)
        calls = ToolCallStream() if body.tools and body.tool_choice != "none" else None
        try:
            for chunk in out.started():
                yield chunk
            event = await self._first(events, asked)  # type: ignore[attr-defined]
            while not isinstance(event, DoneEvent):
                if isinstance(event, TokenEvent):
                    text = calls.push(event.text) if calls else event.text
                    for chunk in out.text_delta(text):
                        yield chunk
                else:
                    self._raise_if_failed(event, asked)  # type: ignore[attr-defined]
                event = await anext(events)
            for chunk in out.finished(event):
                yield chunk
            await keep.put(rapi.response_object(response_id, body, created, event,
                                                with_message=out.message_open), event)
        except oai.OpenAIError as exc:
            for chunk in out.failed(exc):
                yield chunk
        except RequestTimeoutError as exc:
            for chunk in out.failed(oai.OpenAIError(504, str(exc), "timeout_error", "timeout")):
                yield chunk
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]

    async def get_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = await self._with_tenant(request, lambda store, tenant: store.get(response_id,
                                                                                 tenant))
        if isinstance(stored, Response):
            return stored
        return oai_json(stored.response) if stored is not None else _not_found(response_id)

    async def delete_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        deleted = await self._with_tenant(request, lambda store, tenant: store.delete(
            response_id, tenant))
        if isinstance(deleted, Response):
            return deleted
        if not deleted:
            return _not_found(response_id)
        return oai_json({"id": response_id, "object": "response", "deleted": True})

    async def _with_tenant(self, request: Request,
                           act: Callable[[ResponseStore, str], Awaitable[T]]) -> T | Response:
        """`act` on the store for the caller's tenant, or the error response of a caller
        without one."""
        try:
            _key, tenant = await self._tenant(request)
            assert self.store is not None
            return await act(self.store, tenant)
        except oai.OpenAIError as exc:
            return oai_json(exc.body(), exc.status)


class _Keeper:
    """Stores a finished response (unless `store` is false: then nothing is kept)."""

    def __init__(self, store: ResponseStore | None, response_id: str, tenant: str,
                 body: rapi.ResponsesBody, messages: list[dict[str, Any]], session: str):
        self._store = store
        self._response_id = response_id
        self._tenant = tenant
        self._body = body
        self._messages = messages
        self._session = session

    async def put(self, response: dict[str, Any], done: DoneEvent) -> None:
        if self._store is None:
            return
        try:
            await self._store.put(
                response_id=self._response_id, tenant=self._tenant, model=self._body.model,
                session_key=self._session, response=response,
                conversation=rapi.conversation_after(self._messages, done))
        except Exception as exc:  # the answer is given; say it could not be kept
            log.error("response %s could not be stored: %s", self._response_id, exc)


def _not_found(response_id: str) -> Response:
    error = oai.OpenAIError(404, f"response {response_id!r} not found", "invalid_request_error",
                            "not_found")
    return oai_json(error.body(), 404)


def oai_json(content: Any, status: int = 200) -> Response:
    import orjson

    return Response(orjson.dumps(content), status_code=status, media_type="application/json")
