"""The SDK: `client = sluice.Client()`.

Control operations (`client.models`, `client.adapters`, `client.keys`) are
plain synchronous calls, run on a private event-loop thread so they work both
inside and outside async code. The data plane (`stream`, `complete`) is async
and runs on the caller's loop: it produces an `InferenceRequest` to the
model's request topic and reads the reply topic for that request's events.

Every data-plane call has a deadline (`timeout=`, default
SLUICE_CLIENT__REQUEST_TIMEOUT_SECS): no terminal event by then raises
`RequestTimeoutError`, unless an earlier attempt already answered while a
newer one still runs: the call then ends with that answer (by
`schemas.Outcome`, an answer of any attempt is the request's outcome, and a
re-served attempt's `timeout` never replaces it). A model without a request topic raises
`UnknownModelError` before anything is sent; a request that does not validate
raises `InvalidRequestError`. A call that ends without a terminal event —
the stream closed early, its task cancelled, its deadline passed — sends a
cancel record, so the worker stops generating (`client.cancel` does it for a
request sent elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import pydantic
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, KafkaTimeoutError, OutOfOrderSequenceNumber
from aiokafka.structs import RecordMetadata

from common.broker_loss import let_go_of_fenced_brokers
from common.errors import KafkaAccessError
from common.kafka_connect import connect, until_available
from common.kafka_security import explain
from common.producer_renewal import retire, retired, say_renewed
from common.settings import Settings, produce_timeout_ms
from common.timeouts import dependency_call
from common.topics import partitions_of
from common.tracing import trace_headers
from schemas import (
    CancelRequest,
    DoneEvent,
    ErrorEvent,
    InferenceRequest,
    Outcome,
    ReplyEvent,
    TimeoutEvent,
    encode,
)
from sluice.control_plane import ControlPlane
from sluice.errors import (
    InvalidRequestError,
    RequestError,
    RequestTimeoutError,
    UnknownModelError,
)
from sluice.placements import GRACE_S, Placements
from sluice.replies import ReplyReader, hide_attempts

TERMINAL_EVENTS = (DoneEvent, ErrorEvent, TimeoutEvent)

# A model's request topic, once seen, is trusted this long before it is looked up again.
TOPIC_KNOWN_FOR_S = 60.0
# A record the producer could not take yet is offered again after this pause.
REOFFER_AFTER_S = 0.1

T = TypeVar("T")

log = logging.getLogger(__name__)


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

    def remove(self, *, model: str, keep_topic: bool = False) -> None:
        """Remove a model, its adapters and grants, and (unless `keep_topic`) its request
        topic; its workers leave the consumer group until it is registered again."""
        self._run("remove_model", model, keep_topic=keep_topic)

    def list(self) -> Any:
        return self._run("list_models")


class Adapters(_Section):
    def register(self, *, model: str, name: str, path: str) -> Any:
        return self._run("register_adapter", model, name, path)

    def remove(self, *, model: str, name: str) -> Any:
        return self._run("remove_adapter", model, name)

    def list(self, *, model: str) -> Any:
        return self._run("get", model).adapters


class Workers(_Section):
    def list(self, *, model: str | None = None, pools: list[str] | None = None) -> Any:
        """Workers by their heartbeats (`live`: seen within the last minute)."""
        return self._run("list_workers", model, pools)


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
        self.workers = Workers(self)
        self._loop_thread: _LoopThread | None = None
        self._control: ControlPlane | None = None
        self._lock = threading.Lock()
        self._producer: AIOKafkaProducer | None = None
        self._readers: dict[str, ReplyReader] = {}
        self._data_lock: asyncio.Lock | None = None
        self._producer_lock: asyncio.Lock | None = None
        self._topic_seen: dict[str, float] = {}  # request topic -> monotonic time
        self._placements = Placements(self.settings)
        self._cancels: set[asyncio.Task[Any]] = set()  # cancel records being sent

    # -- control plane ------------------------------------------------------------------

    def _control_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from common.timeouts import operation

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

    async def _start_producer(self) -> AIOKafkaProducer:
        if self._producer is not None:
            return self._producer
        if self._producer_lock is None:
            self._producer_lock = asyncio.Lock()
        async with self._producer_lock:  # many first calls at once start one producer
            return await self._make_producer()

    async def _make_producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            producer = AIOKafkaProducer(
                **self.settings.producer_options(), enable_idempotence=True,
                request_timeout_ms=produce_timeout_ms(self.settings.client.timeout_secs),
            )
            let_go_of_fenced_brokers(producer.client, "the SDK's producer")
            try:
                await connect(producer.start(), self.settings, "the SDK's producer")
            except BaseException:
                await producer.stop()  # a failed start closes what it opened
                raise
            self._producer = producer
        return self._producer

    async def _renew_producer(self, broken: AIOKafkaProducer, exc: BaseException) -> None:
        """Replace a producer the broker refuses for its sequence numbers (see
        `common.producer_renewal`); once, however many sends found it broken."""
        assert self._producer_lock is not None  # made by the first _start_producer
        async with self._producer_lock:
            if self._producer is broken:
                say_renewed("the SDK's producer", exc)
                self._producer = None
                retire(broken, "the SDK")
                await self._make_producer()

    async def _send(self, topic: str, value: bytes, key: bytes,
                    headers: list[tuple[str, bytes]], until: float | None = None
                    ) -> RecordMetadata:
        """One record, acknowledged. A record the producer could not take within its
        request timeout (it waits behind a batch whose leader is away: a broker killed
        or cut off) was never added, so it is offered again until `until` (monotonic;
        default SLUICE_CLIENT__TIMEOUT_SECS from now). A record refused for the
        producer's sequence numbers goes again through a new producer."""
        if until is None:
            until = time.monotonic() + self.settings.client.timeout_secs
        renewed = False
        while True:
            producer = await self._start_producer()
            try:
                future = await producer.send(topic, value, key=key, headers=headers)
            except KafkaTimeoutError:
                if time.monotonic() >= until:
                    raise
                await asyncio.sleep(REOFFER_AFTER_S)
                continue
            try:
                return await future
            except OutOfOrderSequenceNumber as exc:
                if renewed:
                    raise
                renewed = True
                await self._renew_producer(producer, exc)

    async def _reader(self, topic: str) -> ReplyReader:
        if self._data_lock is None:
            self._data_lock = asyncio.Lock()
        async with self._data_lock:
            await self._start_producer()
            reader = self._readers.get(topic)
            if reader is not None and reader.failure is not None:
                await reader.stop()  # failed for good: start over
                reader = None
            if reader is None:
                reader = ReplyReader(self.settings, topic)
                try:
                    await connect(reader.start(), self.settings, f"reading reply topic {topic}")
                except BaseException:
                    await reader.stop()
                    raise
                self._readers[topic] = reader
            return reader

    async def check_model(self, model: str) -> str:
        """The model's request topic, or UnknownModelError when it does not exist (a
        send to a missing topic would retry for its whole timeout)."""
        topic = self.settings.requests_topic(model)
        seen = self._topic_seen.get(topic)
        if seen is not None and time.monotonic() - seen < TOPIC_KNOWN_FOR_S:
            return topic
        producer = await self._start_producer()
        try:
            # Asked again while no broker answers for a reason that passes: the SDK's
            # broker-loss handler closes the connections to a fenced broker at once, and
            # a lookup then failed on every broker in that instant (3 requests of a
            # leader-isolation fault run failed before they were sent).
            what = "looking up the model's request topic"
            partitions = await dependency_call(
                what, until_available(lambda: partitions_of(producer, topic), self.settings,
                                      what), self.settings.client.timeout_secs)
        except KafkaError as exc:
            denied = explain(exc, self.settings.kafka, f"looking up model {model!r}")
            if denied is None:
                raise
            raise KafkaAccessError(denied) from None
        if not partitions:
            self._topic_seen.pop(topic, None)
            raise UnknownModelError(model, topic, secured=self.settings.kafka.security_protocol
                                    != "PLAINTEXT")
        self._topic_seen[topic] = time.monotonic()
        return topic

    def _request(self, model: str, request_id: str | None,
                 fields: dict[str, Any]) -> InferenceRequest:
        try:
            return InferenceRequest(
                request_id=request_id or f"req-{uuid.uuid4().hex}", model=model,
                reply_topic=fields.pop("reply_topic", None) or self.settings.topic("results"),
                **fields,
            )
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
                for err in exc.errors(include_url=False, include_input=False))
            raise InvalidRequestError(f"invalid request: {problems}") from None

    async def stream(self, *, model: str, api_key: str | None = None,
                     request_id: str | None = None, timeout: float | None = None,
                     traceparent: str | None = None, tracestate: str | None = None,
                     **fields: Any) -> AsyncIterator[ReplyEvent]:
        """Send one request and yield its events: tokens, then one terminal event, the
        request's outcome over all its attempts (`schemas.Outcome`).

        `timeout` (seconds; default SLUICE_CLIENT__REQUEST_TIMEOUT_SECS) bounds the
        whole call: without a terminal event by then, RequestTimeoutError (or the answer
        of a superseded attempt, when one came). `traceparent` (and `tracestate`), W3C
        trace context, go on the request record as headers: the worker continues that
        trace."""
        limit = self.settings.client.request_timeout_secs if timeout is None else timeout
        deadline = time.monotonic() + limit
        key = api_key or self.api_key
        request = self._request(model, request_id, fields)
        topic = await self.check_model(model)
        reader = await self._reader(str(request.reply_topic))
        max_ttft_ms = await self._max_ttft_ms(model, request.max_ttft_ms)
        sub = reader.subscribe(request.request_id)
        sent = ended = False
        waiting: asyncio.Future[ReplyEvent] | None = None
        headers = [("authorization", f"Bearer {key}".encode())] if key else []
        sent_headers = [*headers, *trace_headers(traceparent, tracestate)]
        try:
            try:
                where = await self._send(topic, encode(request),
                                         request.partition_key.encode(), sent_headers,
                                         until=deadline)
                sent = True
            except KafkaError as exc:
                denied = explain(exc, self.settings.kafka, f"sending to {topic}")
                if denied is not None:
                    raise KafkaAccessError(denied) from None
                self._topic_seen.pop(topic, None)
                await self.check_model(model)  # removed meanwhile: say so
                raise
            sent_at = time.monotonic()
            # The first event is due within max_ttft_ms (+ grace) — else, unless a worker
            # has started the request, none will come (see `sluice.placements`).
            started_by = (None if max_ttft_ms is None
                          else sent_at + max_ttft_ms / 1000 + GRACE_S)
            outcome = Outcome()
            events = hide_attempts(sub, outcome)
            while True:
                until = deadline if started_by is None else min(deadline, started_by)
                # A wait that times out leaves the next event's future running (cancelling
                # it would close the event generator mid-stream).
                if waiting is None:
                    waiting = asyncio.ensure_future(anext(events))
                await asyncio.wait({waiting}, timeout=max(0.0, until - time.monotonic()))
                if not waiting.done():
                    if until == deadline and outcome.answer is not None:
                        # An earlier attempt answered; the newer one is late. No cancel:
                        # its `done` (cancelled) would outrank this answer for other readers.
                        ended = True
                        yield outcome.answer
                        return
                    if until == deadline:
                        raise RequestTimeoutError.no_terminal_event(
                            request.request_id, model, limit)
                    assert max_ttft_ms is not None
                    producer = await self._start_producer()
                    if await self._placements.started(producer, model, where.partition,
                                                      where.offset) is not False:
                        started_by = None  # started (or unknown): its answer is coming
                        continue
                    raise RequestTimeoutError.not_started(
                        request.request_id, model, max_ttft_ms, time.monotonic() - sent_at)
                try:
                    event = waiting.result()
                except StopAsyncIteration:
                    ended = True
                    return
                waiting = None
                started_by = None
                ended = isinstance(event, TERMINAL_EVENTS)
                yield event
        finally:
            if waiting is not None and not waiting.done():
                waiting.cancel()
            reader.unsubscribe(request.request_id)
            if sent and not ended:
                # Closed early, cancelled, or out of time: the worker stops it (a cancel
                # record is durable, so whoever holds the request honours it).
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(self._send_cancel(topic, request, headers))

    async def _max_ttft_ms(self, model: str, requested: int | None) -> int | None:
        """The longest the first event may take: the model's max_ttft_ms, tightened by the
        request's own; None when the model's cannot be read (the client's own timeout)."""
        own = await self._placements.max_ttft_ms(model)
        if own is None:
            return None
        return min(own, requested) if requested is not None else own

    async def cancel(self, *, model: str, request_id: str, session_id: str | None = None,
                     api_key: str | None = None) -> None:
        """Stop a request sent earlier (by any client): a cancel record on the model's
        request topic, with the request's own key (`session_id`, if it had one) and an
        API key of the same tenant. The request ends with `done`, finish_reason
        "cancelled", unless it ended already."""
        topic = await self.check_model(model)
        key = api_key or self.api_key
        headers = [("authorization", f"Bearer {key}".encode())] if key else []
        request = InferenceRequest(request_id=request_id, session_id=session_id, model=model,
                                   prompt="-")  # only its id and partition key are used
        await self._send_cancel(topic, request, headers, wait=True)

    async def _send_cancel(self, topic: str, request: InferenceRequest,
                           headers: list[tuple[str, bytes]], wait: bool = False) -> None:
        record = encode(CancelRequest(request_id=request.request_id))
        sending = self._send(topic, record, request.partition_key.encode(), headers)
        if wait:
            await sending
            return
        # The caller goes on at once; the cancel is still acknowledged (or renewed and
        # resent) in the background, its failure logged.
        task = asyncio.get_running_loop().create_task(sending)
        self._cancels.add(task)
        task.add_done_callback(self._cancel_sent)

    def _cancel_sent(self, task: asyncio.Task[Any]) -> None:
        self._cancels.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a cancel record was not sent: %s: %s",
                        type(task.exception()).__name__, task.exception())

    async def complete(self, *, model: str, **fields: Any) -> DoneEvent:
        """Send one request and return its `done` event; raises on `error` or `timeout`
        (and, like `stream`, after `timeout` seconds without an answer). A `timeout` of a
        re-served attempt never hides an answer an earlier attempt gave (see `stream`)."""
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
        """Close the Kafka clients the data plane opened (and the control plane's)."""
        if self._cancels:  # cancel records still on their way go out first
            await asyncio.gather(*self._cancels, return_exceptions=True)
        for reader in self._readers.values():
            await reader.stop()
        self._readers.clear()
        await self._placements.close()
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        await retired()  # producers replaced on the way
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

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
