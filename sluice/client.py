"""The SDK: `client = sluice.Client()`.

Control operations (`client.models`, `client.adapters`, `client.keys`) are
plain synchronous calls, run on a private event-loop thread so they work both
inside and outside async code. The data plane (`stream`, `complete`) is async
and runs on the caller's loop: it produces an `InferenceRequest` to the
model's request topic and reads the reply topic for that request's events.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer

from schemas import DoneEvent, ErrorEvent, InferenceRequest, ReplyEvent, TimeoutEvent, encode
from sluice.control_plane import ControlPlane
from sluice.errors import RequestError, RequestTimeoutError
from sluice.replies import ReplyReader, hide_attempts
from sluice.settings import Settings

T = TypeVar("T")


class _LoopThread:
    """A daemon thread running an event loop, for the synchronous control API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="sluice-sdk")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class _Section:
    def __init__(self, client: Client):
        self._client = client

    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._client._control_call(method, *args, **kwargs)


class Models(_Section):
    def register(self, *, model: str, path: str, partitions: int | None = None,
                 compute_config: dict[str, Any] | None = None,
                 placement: dict[str, Any] | None = None) -> Any:
        return self._run("register_model", model, path, partitions=partitions,
                         compute_config=compute_config, placement=placement)

    def update_compute_config(self, *, model: str, compute_config: dict[str, Any]) -> Any:
        return self._run("update_compute_config", model, compute_config)

    def update(self, *, model: str, placement: dict[str, Any]) -> Any:
        return self._run("update", model, placement)

    def show(self, *, model: str) -> Any:
        return self._run("get", model)

    def list(self) -> Any:
        return self._run("list_models")


class Adapters(_Section):
    def register(self, *, model: str, name: str, path: str) -> Any:
        return self._run("register_adapter", model, name, path)

    def remove(self, *, model: str, name: str) -> Any:
        return self._run("remove_adapter", model, name)

    def list(self, *, model: str) -> Any:
        return self._run("get", model).adapters


class Keys(_Section):
    def create(self, *, tenant: str, reply_topic_prefix: str | None = None) -> str:
        return self._run("create_key", tenant, reply_topic_prefix)

    def grant(self, key: str, *, model: str, adapter: str | None = None) -> None:
        self._run("grant", key, model, adapter)

    def revoke(self, key: str) -> None:
        self._run("revoke", key)


class Client:
    def __init__(self, settings: Settings | None = None, *, api_key: str | None = None,
                 **overrides: Any):
        self.settings = settings or Settings.load(**overrides)
        self.api_key = api_key
        self.models = Models(self)
        self.adapters = Adapters(self)
        self.keys = Keys(self)
        self._loop_thread: _LoopThread | None = None
        self._control: ControlPlane | None = None
        self._lock = threading.Lock()
        self._producer: AIOKafkaProducer | None = None
        self._readers: dict[str, ReplyReader] = {}
        self._data_lock: asyncio.Lock | None = None

    # -- control plane ------------------------------------------------------------------

    def _control_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from sluice.timeouts import operation

        with self._lock:
            if self._loop_thread is None:
                self._loop_thread = _LoopThread()
        thread = self._loop_thread

        async def call() -> Any:
            if self._control is None:
                self._control = await ControlPlane.connect(self.settings)
            return await getattr(self._control, method)(*args, **kwargs)

        return thread.run(operation(method, call(), self.settings.server.timeout_seconds))

    # -- data plane ---------------------------------------------------------------------

    async def _reader(self, topic: str) -> ReplyReader:
        if self._data_lock is None:
            self._data_lock = asyncio.Lock()
        async with self._data_lock:
            if self._producer is None:
                self._producer = AIOKafkaProducer(
                    bootstrap_servers=self.settings.kafka_bootstrap, enable_idempotence=True,
                    request_timeout_ms=int(self.settings.client.timeout_secs * 1000),
                )
                await self._producer.start()
            if topic not in self._readers:
                reader = ReplyReader(str(self.settings.kafka_bootstrap), topic)
                await reader.start()
                self._readers[topic] = reader
            return self._readers[topic]

    async def stream(self, *, model: str, api_key: str | None = None,
                     request_id: str | None = None, **fields: Any) -> AsyncIterator[ReplyEvent]:
        """Send one request and yield its events: tokens, then one terminal event."""
        key = api_key or self.api_key
        request = InferenceRequest(
            request_id=request_id or f"req-{uuid.uuid4().hex}", model=model,
            reply_topic=fields.pop("reply_topic", None) or self.settings.topic("results"),
            **fields,
        )
        reader = await self._reader(str(request.reply_topic))
        sub = reader.subscribe(request.request_id)
        try:
            headers = [("authorization", f"Bearer {key}".encode())] if key else []
            assert self._producer is not None
            await self._producer.send_and_wait(
                self.settings.requests_topic(model), encode(request),
                key=request.partition_key.encode(), headers=headers,
            )
            async for event in hide_attempts(sub):
                yield event
        finally:
            reader.unsubscribe(request.request_id)

    async def complete(self, *, model: str, **fields: Any) -> DoneEvent:
        """Send one request and return its `done` event; raises on `error` or `timeout`."""
        fields.setdefault("stream", False)
        async for event in self.stream(model=model, **fields):
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                raise RequestError(event.request_id, event.code.value, event.message)
            if isinstance(event, TimeoutEvent):
                raise RequestTimeoutError(event.request_id, event.waited_ms, event.max_ttft_ms)
        raise RuntimeError("the reply stream ended without a terminal event")

    async def aclose(self) -> None:
        for reader in self._readers.values():
            await reader.stop()
        self._readers.clear()
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        self.close()

    def close(self) -> None:
        if self._loop_thread is not None:
            if self._control is not None:
                self._loop_thread.run(self._control.close())
                self._control = None
            self._loop_thread.close()
            self._loop_thread = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
