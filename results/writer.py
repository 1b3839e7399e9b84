"""Events to the reply topic; timeouts also to `sluice.timeouts`; dead letters.

An idempotent producer (acks=all) writes every event, keyed by request id.
Tokens are not awaited one by one; a terminal event is, and only once the
broker has acknowledged it is the request's offset marked finished — the
commit point never passes a request whose terminal event could still be lost.
While the broker is away the producer keeps retrying a sent record (it does
not fail it after its request timeout once the partition's leader is known),
so a terminal event sent during an outage is delivered when the broker returns
(tested in tests/integration/test_faults.py). A terminal event the reply topic
refuses for good (authorization, record size, invalid topic), or whose reply
topic the broker says was deleted, dead-letters the request with the reason
instead, so no offset is stuck behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, KafkaTimeoutError

from batcher import types as bt
from results.context import InFlight
from schemas import (
    DeadLetterRecord,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    TimeoutEvent,
    TimeoutRecord,
    Timing,
    TokenEvent,
    Usage,
    encode,
)
from sluice.metrics import WorkerMetrics
from sluice.settings import Settings
from sluice.topics import partitions_of

log = logging.getLogger(__name__)

# A terminal event the producer will not take (its reply topic has no metadata:
# the broker away, say) is tried this many times, RESEND_BACKOFF_S apart and each
# try waiting up to the request timeout, before the request is dead-lettered
# instead. A reply topic the broker says is gone (deleted mid-request) is not
# waited for: twice absent from the broker's metadata, GONE_RECHECK_S apart, and
# the request is dead-lettered at once.
TERMINAL_SEND_TRIES = 10
RESEND_BACKOFF_S = 1.0
GONE_RECHECK_S = 1.0
# Events are written one after another, so no send waits inline longer than this for
# a topic's metadata (a deleted reply topic would otherwise hold up every request's
# events for a request timeout): token events to such a topic are dropped (the
# terminal event carries every token), its terminal event is retried in the background.
METADATA_WAIT_S = 2.0
UNREADY_FOR_S = 5.0  # after such a wait fails, the topic's events skip waiting this long

OnFinished = Callable[[object, int], None]


class ResultWriter:
    def __init__(self, settings: Settings, on_finished: OnFinished, model: str,
                 metrics: WorkerMetrics | None = None):
        self.settings = settings
        self.model = model
        self.metrics = metrics
        self._last_token_at: dict[str, float] = {}
        self._on_finished = on_finished
        self._producer = AIOKafkaProducer(
            **settings.producer_options(), enable_idempotence=True, acks="all",
            linger_ms=1, request_timeout_ms=int(settings.client.timeout_secs * 1000),
            max_request_size=8 * 1024 * 1024,
        )
        self._pending: set[asyncio.Future[object]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._unready_until: dict[str, float] = {}  # topic -> monotonic time
        self._closing = False
        self.num_terminal = 0

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        self._closing = True  # terminal events still being retried stop at their next try
        await self.flush()
        await self._producer.stop()

    async def flush(self) -> None:
        """Wait until every record sent so far is acknowledged or has failed (and any
        dead-lettering that a failure started)."""
        while self._pending or self._background:
            await asyncio.wait([*self._pending, *self._background])

    async def write(self, event: bt.Event) -> None:
        """One engine event to the wire; `event.origin` is the request's `InFlight`.

        If building a terminal event fails (a detokenizer error, say), the request
        still ends: with `error` `internal` saying why."""
        try:
            await self._write_event(event)
        except KafkaError:
            raise
        except Exception as exc:
            if isinstance(event, bt.TokenEvent):
                log.exception("a token event could not be built; the done event carries "
                              "every token")
                return
            log.exception("a terminal event could not be built")
            await self.error(event.origin, ErrorCode.INTERNAL,
                             f"the reply could not be built: {type(exc).__name__}: {exc}")

    async def _write_event(self, event: bt.Event) -> None:
        ctx: InFlight = event.origin
        if isinstance(event, bt.TokenEvent):
            await self.tokens(ctx, list(event.token_ids))
        elif isinstance(event, bt.DoneEvent):
            t = event.timing
            await self.done(
                ctx, finish_reason=event.finish_reason, token_ids=list(event.token_ids),
                num_cached_prompt_tokens=event.usage.num_cached_prompt_tokens,
                timing=Timing(queue_ms=max(0.0, t.queue_ms), ttft_ms=max(0.0, t.ttft_ms),
                              total_ms=max(0.0, t.total_ms)),
                adapter=event.adapter_key,
            )
        elif isinstance(event, bt.ErrorEvent):
            try:
                code = ErrorCode(event.code)
            except ValueError:
                code = ErrorCode.INTERNAL
            await self.error(ctx, code, event.message)
        elif isinstance(event, bt.TimeoutEvent):
            reason = ("predicted to miss max_ttft_ms" if event.early
                      else "max_ttft_ms passed before the first token")
            await self.timeout(ctx, event.waited_ms, reason)
        # Cancelled: no terminal event; the offset stays unfinished and is served again.

    async def tokens(self, ctx: InFlight, token_ids: list[int]) -> None:
        text = ctx.decoder.push(token_ids)
        if self.metrics is not None and token_ids:
            self.metrics.add_generated_tokens(len(token_ids))
            now = time.monotonic()
            previous = self._last_token_at.get(ctx.request.request_id)
            if previous is not None:
                for _ in token_ids:
                    self.metrics.observe_inter_token((now - previous) / len(token_ids))
            self._last_token_at[ctx.request.request_id] = now
        if ctx.request.stream:
            await self._token_event(ctx, token_ids, text)

    async def _token_event(self, ctx: InFlight, token_ids: list[int], text: str) -> None:
        event = TokenEvent(request_id=ctx.request.request_id, attempt=ctx.attempt,
                           seq=ctx.next_seq, token_ids=token_ids, text=text)
        ctx.next_seq += 1
        await self._send(ctx.reply_topic, event.request_id, encode(event))

    async def done(self, ctx: InFlight, *, finish_reason: str, token_ids: list[int],
                   num_cached_prompt_tokens: int, timing: Timing, adapter: str | None) -> None:
        # Tokens not yet seen by the decoder.
        seen = len(ctx.decoder.ids)
        if len(token_ids) > seen:
            ctx.decoder.push(token_ids[seen:])
        if ctx.request.stream:
            # Text held back (an incomplete UTF-8 tail) goes out as a last, token-less
            # event: the token events' text always adds up to the done event's.
            tail = ctx.decoder.flush()
            if tail:
                await self._token_event(ctx, [], tail)
            text = ctx.decoder.emitted
        else:
            text = ctx.decoder.text()
        event = DoneEvent(
            request_id=ctx.request.request_id, attempt=ctx.attempt,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            text=text, token_ids=list(token_ids),
            usage=Usage(prompt_tokens=ctx.num_prompt_tokens,
                        cached_prompt_tokens=num_cached_prompt_tokens,
                        completion_tokens=len(token_ids)),
            timing=timing, model=self.model, adapter=adapter,
        )
        if self.metrics is not None:
            self.metrics.observe_ttft(timing.ttft_ms / 1000)
            self.metrics.observe_prompt(ctx.num_prompt_tokens, num_cached_prompt_tokens)
        self._observe_end(ctx.request.request_id, "done")
        await self._terminal(ctx, encode(event))

    async def error(self, ctx: InFlight, code: ErrorCode, message: str) -> None:
        event = ErrorEvent(request_id=ctx.request.request_id, attempt=ctx.attempt, code=code,
                           message=message)
        self._observe_end(ctx.request.request_id, "error", code.value)
        await self._terminal(ctx, encode(event))

    async def timeout(self, ctx: InFlight, waited_ms: float, reason: str) -> None:
        event = TimeoutEvent(request_id=ctx.request.request_id, attempt=ctx.attempt,
                             waited_ms=waited_ms, max_ttft_ms=ctx.max_ttft_ms)
        record = TimeoutRecord(
            request_id=ctx.request.request_id, model=self.model, attempt=ctx.attempt,
            reason=reason, waited_ms=waited_ms, max_ttft_ms=ctx.max_ttft_ms,
            request=ctx.request.model_dump(mode="json"),
        )
        await self._send(self.settings.topic("timeouts"), event.request_id, encode(record))
        self._observe_end(ctx.request.request_id, "timeout")
        await self._terminal(ctx, encode(event))

    async def error_without_context(self, *, tp: object, offset: int, reply_topic: str,
                                    request_id: str, code: ErrorCode, message: str) -> None:
        """An error for a record that never became an in-flight request."""
        event = ErrorEvent(request_id=request_id, code=code, message=message)
        self._observe_end(request_id, "error", code.value)
        future = await self._producer.send(reply_topic, encode(event), key=request_id.encode())
        self._track(future, tp, offset)

    async def dead_letter(self, *, tp: object, offset: int, topic: str, partition: int,
                          key: bytes | None, value: bytes, reason: str) -> None:
        record = DeadLetterRecord.of(reason=reason, topic=topic, partition=partition,
                                     offset=offset, key=key, value=value)
        if self.metrics is not None:
            self.metrics.observe_dead_letter()
        future = await self._producer.send(self.settings.topic("deadletter"), encode(record),
                                           key=key)
        self._track(future, tp, offset)

    def _observe_end(self, request_id: str, kind: str, code: str | None = None) -> None:
        self._last_token_at.pop(request_id, None)
        level = logging.DEBUG if kind == "done" else logging.INFO
        log.log(level, "request ended: %s%s", kind, f" ({code})" if code else "",
                extra={"request_id": request_id})
        if self.metrics is not None:
            self.metrics.observe_terminal(kind, code)

    async def _terminal(self, ctx: InFlight, value: bytes) -> None:
        self.num_terminal += 1
        await self._send_terminal(ctx, value, TERMINAL_SEND_TRIES)

    async def _send_terminal(self, ctx: InFlight, value: bytes, tries_left: int,
                             in_background: bool = False) -> None:
        """Inline (the writer's own loop) a send waits for the reply topic's metadata at
        most METADATA_WAIT_S; in the background, as long as the producer does (its
        request timeout), so an outage is waited out as before."""
        try:
            if not in_background and not await self._topic_ready(ctx.reply_topic):
                raise KafkaTimeoutError(f"no metadata for {ctx.reply_topic!r} yet")
            future = await self._producer.send(ctx.reply_topic, value,
                                               key=ctx.request.request_id.encode())
        except KafkaError as exc:  # the producer would not take it (no topic metadata, ...)
            if self._closing:
                log.error("terminal event for offset %s of %s not sent (%s); it stays "
                          "unfinished", ctx.offset, ctx.topic_partition, exc)
            elif _retriable(exc):
                # In the background: one request's unavailable reply topic never holds
                # up others.
                self._in_background(self._retry_terminal(ctx, value, tries_left, exc))
            else:
                await self._undeliverable(ctx, exc)
            return
        self._track(future, ctx.topic_partition, ctx.offset, fallback=ctx)

    async def _retry_terminal(self, ctx: InFlight, value: bytes, tries_left: int,
                              exc: KafkaError) -> None:
        if await self._reply_topic_gone(ctx.reply_topic):
            await self._undeliverable(ctx, exc, gone=True)
        elif tries_left > 1:
            log.warning("terminal event to %s not sent yet (%s); trying again",
                        ctx.reply_topic, exc, extra={"request_id": ctx.request.request_id})
            await asyncio.sleep(RESEND_BACKOFF_S)
            await self._send_terminal(ctx, value, tries_left - 1, in_background=True)
        else:
            await self._undeliverable(ctx, exc)

    async def _topic_ready(self, topic: str) -> bool:
        """Whether the producer knows `topic`'s partitions, waiting for them at most
        METADATA_WAIT_S (milliseconds for a topic that exists)."""
        if self._producer.client.cluster.partitions_for_topic(topic):
            return True  # known: the common case, no task to wait on
        if time.monotonic() < self._unready_until.get(topic, 0.0):
            return False
        try:
            await asyncio.wait_for(self._producer.partitions_for(topic), METADATA_WAIT_S)
        except (TimeoutError, KafkaError):
            now = time.monotonic()
            self._unready_until = {t: until for t, until in self._unready_until.items()
                                   if until > now}  # forget topics that expired
            self._unready_until[topic] = now + UNREADY_FOR_S
            return False
        self._unready_until.pop(topic, None)
        return True

    def _in_background(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reply_topic_gone(self, topic: str) -> bool:
        """True only when the broker answers, twice, that `topic` does not exist (it was
        deleted); False while it exists or while no broker can be asked (an outage
        passes with time, a deletion does not)."""
        for check in range(2):
            if check:
                await asyncio.sleep(GONE_RECHECK_S)
            try:
                if await partitions_of(self._producer, topic):
                    return False
            except (TimeoutError, KafkaError, OSError):
                return False
        return True

    async def _ack_failed(self, ctx: InFlight, exc: BaseException) -> None:
        if not _retriable(exc) or await self._reply_topic_gone(ctx.reply_topic):
            await self._undeliverable(ctx, exc, gone=_retriable(exc))
            return
        # Not acknowledged: leave the offset unfinished so it is served again.
        log.error("terminal event for offset %s of %s not acknowledged: %s", ctx.offset,
                  ctx.topic_partition, exc)

    async def _undeliverable(self, ctx: InFlight, exc: BaseException, gone: bool = False) -> None:
        """The reply topic refuses the terminal event for good (authorization, size,
        invalid topic) or no longer exists: the request goes to the dead-letter topic with
        the reason, and its offset is finished once that is acknowledged — never silently
        stuck."""
        why = "the topic no longer exists" if gone else f"{type(exc).__name__}: {exc}"
        reason = (f"the request's terminal event could not be written to its reply topic "
                  f"{ctx.reply_topic!r}: {why}")
        log.error("%s; dead-lettering the request", reason,
                  extra={"request_id": ctx.request.request_id})
        tp = ctx.topic_partition
        key = ctx.request.partition_key.encode()  # the request record's own key
        record = DeadLetterRecord.of(reason=reason, topic=tp.topic, partition=tp.partition,
                                     offset=ctx.offset, key=key, value=encode(ctx.request))
        if self.metrics is not None:
            self.metrics.observe_dead_letter()
        try:
            future = await self._producer.send(self.settings.topic("deadletter"),
                                               encode(record), key=key)
        except KafkaError as dlq_exc:
            log.error("dead-lettering offset %s of %s failed too (%s); it stays unfinished",
                      ctx.offset, tp, dlq_exc)
            return
        self._track(future, tp, ctx.offset)

    async def _send(self, topic: str, key: str, value: bytes) -> None:
        """A record that finishes nothing (tokens, the timeouts log): a failure is
        logged and never keeps the request's terminal event from being sent."""
        try:
            if not await self._topic_ready(topic):
                raise KafkaTimeoutError(f"no metadata for {topic!r} within {METADATA_WAIT_S} s")
            future = await self._producer.send(topic, value, key=key.encode())
        except Exception as exc:
            log.warning("a record to %s could not be sent: %s", topic, exc)
            return
        self._pending.add(future)

        def sent(fut: asyncio.Future[object]) -> None:
            self._pending.discard(fut)
            if not fut.cancelled() and fut.exception() is not None:
                log.warning("a record to %s was not acknowledged: %s", topic, fut.exception())

        future.add_done_callback(sent)

    def _track(self, future: asyncio.Future[object], tp: object, offset: int,
               fallback: InFlight | None = None) -> None:
        """Finish `offset` once `future` is acknowledged. A terminal event refused for
        good, or whose reply topic is gone, goes to the dead-letter topic instead
        (`fallback`: its request)."""
        self._pending.add(future)

        def acked(fut: asyncio.Future[object]) -> None:
            self._pending.discard(fut)
            exc = None if fut.cancelled() else fut.exception()
            if exc is None and not fut.cancelled():
                self._on_finished(tp, offset)
                return
            if fallback is not None and exc is not None:
                self._in_background(self._ack_failed(fallback, exc))
                return
            # Not acknowledged: leave the offset unfinished so it is served again.
            log.error("record finishing offset %s of %s not acknowledged: %s", offset, tp, exc)

        future.add_done_callback(acked)


def _retriable(exc: BaseException) -> bool:
    """Errors that pass with time (the broker away, leadership moving)."""
    return isinstance(exc, KafkaTimeoutError) or bool(getattr(exc, "retriable", False))
