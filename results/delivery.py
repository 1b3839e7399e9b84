"""Delivery: writing the records of `results.translate`, and finishing offsets.

Three kinds of records:

- best effort (token events, the timeouts log): never awaited one by one, a
  failure is logged and never holds anything up;
- finishing (an error for a record that never became in flight, a dead
  letter): its request offset is finished once the broker acknowledged it;
- terminal (done, error, timeout of an in-flight request): the same, and if
  the reply topic refuses it for good (authorization, record size, invalid
  topic) or the broker says that topic is gone (deleted mid-request), the
  request is dead-lettered with the reason instead, so no offset is stuck
  behind it. While the broker is away the producer keeps retrying a sent
  record (it does not fail it after its request timeout once the partition's
  leader is known), so a terminal event sent during an outage is delivered
  when the broker returns (tests/integration/test_faults.py).

Records are written one after another, so no send waits inline longer than
METADATA_WAIT_S for a topic's metadata: a best-effort record to such a topic
is dropped (the done event carries every token) and the topic is skipped for
UNREADY_FOR_S; a terminal record is retried in the background, where one
request's unavailable reply topic holds up nobody else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka.errors import KafkaError, KafkaTimeoutError

from common.timeouts import within
from results.inflight import InFlight
from results.producer import ProducerPort, TransactionsFailed
from results.transactions import PartitionTransactions
from results.translate import WireRecord

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
METADATA_WAIT_S = 2.0
UNREADY_FOR_S = 5.0  # after such a wait fails, the topic's records skip waiting this long

OnFinished = Callable[[Any, int], None]
# The dead letter that replaces an undeliverable terminal event: (request, why).
Undeliverable = Callable[[InFlight, str], WireRecord]


class Delivery:
    def __init__(self, producer: ProducerPort, on_finished: OnFinished,
                 undeliverable: Undeliverable,
                 on_dead_letter: Callable[[], None] | None = None):
        # Token events always, and the records that end requests in at-least-once mode.
        self._producer = producer
        # Exactly-once: the records that end a request go into its partition's
        # transaction (`results.transactions`); tokens never wait for one.
        self._transactions: PartitionTransactions | None = None
        self._on_finished = on_finished
        self._undeliverable_record = undeliverable
        self._on_dead_letter = on_dead_letter
        self._pending: set[asyncio.Future[Any]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._unready_until: dict[str, float] = {}  # topic -> monotonic time
        self._closing = False

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        self._closing = True  # terminal events still being retried stop at their next try
        await self.flush()
        await self._producer.stop()

    async def use_transactions(self, transactions: PartitionTransactions | None) -> None:
        """Exactly-once (the partitions' transactions) or at-least-once (None) from now
        on. Only between requests: after a drain, everything flushed and committed."""
        await self.flush()
        self._transactions = transactions

    @property
    def transactions(self) -> PartitionTransactions | None:
        return self._transactions

    def _ending(self, tp: Any) -> ProducerPort:
        """The producer of the records that end a request read from `tp`; raises
        PartitionNotHeld (exactly-once) when this worker no longer owns `tp`."""
        if self._transactions is None:
            return self._producer
        return self._transactions.port(tp)

    async def flush(self) -> None:
        """Wait until every record sent so far is acknowledged or has failed (and any
        dead-lettering that a failure started)."""
        while self._pending or self._background:
            await asyncio.wait([*self._pending, *self._background])

    @property
    def idle(self) -> bool:
        return not (self._pending or self._background)

    # ---- the three kinds ----------------------------------------------------------------

    async def best_effort(self, record: WireRecord, *, tp: Any = None) -> None:
        """A record nothing waits for: a token event, or (with `tp`, the partition of the
        request it is about) a log record that goes with the terminal events, in their
        transaction if any."""
        try:
            producer = self._producer if tp is None else self._ending(tp)
            if not await self._topic_ready(record.topic, producer):
                raise KafkaTimeoutError(
                    f"no metadata for {record.topic!r} within {METADATA_WAIT_S} s")
            future = await producer.send(record.topic, record.value, record.key, record.headers)
        except Exception as exc:
            log.warning("a record to %s could not be sent: %s", record.topic, exc)
            return
        self._pending.add(future)

        def sent(fut: asyncio.Future[Any]) -> None:
            self._pending.discard(fut)
            if not fut.cancelled() and fut.exception() is not None:
                log.warning("a record to %s was not acknowledged: %s", record.topic,
                            fut.exception())

        future.add_done_callback(sent)

    async def finishing(self, record: WireRecord, tp: Any, offset: int,
                        tries_left: int = TERMINAL_SEND_TRIES) -> None:
        """Write `record`; finish `offset` of `tp` once it is acknowledged. A record the
        producer will not take yet is tried again in the background."""
        try:
            future = await self._ending(tp).send(record.topic, record.value, record.key,
                                                 record.headers)
        except KafkaError as exc:
            if self._closing or tries_left <= 1 or not retriable(exc) or isinstance(
                    exc, TransactionsFailed):
                log.error("the record finishing offset %s of %s was not sent (%s); it stays "
                          "unfinished and is read again after a restart", offset, tp, exc)
                return
            self._in_background(self._retry_finishing(record, tp, offset, tries_left - 1))
            return
        self._track(future, tp, offset)

    async def _retry_finishing(self, record: WireRecord, tp: Any, offset: int,
                               tries_left: int) -> None:
        await asyncio.sleep(RESEND_BACKOFF_S)
        await self.finishing(record, tp, offset, tries_left)

    async def terminal(self, record: WireRecord, ctx: InFlight) -> None:
        """The request's terminal event; finishes its offset once acknowledged."""
        await self._send_terminal(record, ctx, TERMINAL_SEND_TRIES)

    # ---- terminal events: retries and dead letters ------------------------------------

    async def _send_terminal(self, record: WireRecord, ctx: InFlight, tries_left: int,
                             in_background: bool = False) -> None:
        """Inline a send waits for the reply topic's metadata at most METADATA_WAIT_S;
        in the background, as long as the producer does (its request timeout), so an
        outage is waited out."""
        try:
            producer = self._ending(ctx.topic_partition)
            if not in_background and not await self._topic_ready(record.topic, producer):
                raise KafkaTimeoutError(f"no metadata for {record.topic!r} yet")
            future = await producer.send(record.topic, record.value, record.key, record.headers)
        except KafkaError as exc:  # the producer would not take it (no topic metadata, ...)
            if self._closing or isinstance(exc, TransactionsFailed):
                log.error("terminal event for offset %s of %s not sent (%s); it stays "
                          "unfinished", ctx.offset, ctx.topic_partition, exc)
            elif retriable(exc):
                self._in_background(self._retry_terminal(record, ctx, tries_left, exc))
            else:
                await self._dead_letter(ctx, exc)
            return
        self._track(future, ctx.topic_partition, ctx.offset, fallback=ctx)

    async def _retry_terminal(self, record: WireRecord, ctx: InFlight, tries_left: int,
                              exc: KafkaError) -> None:
        if await self._topic_gone(record.topic):
            await self._dead_letter(ctx, exc, gone=True)
        elif tries_left > 1:
            log.warning("terminal event to %s not sent yet (%s); trying again", record.topic,
                        exc, extra={"request_id": ctx.request_id})
            await asyncio.sleep(RESEND_BACKOFF_S)
            await self._send_terminal(record, ctx, tries_left - 1, in_background=True)
        else:
            await self._dead_letter(ctx, exc)

    async def _ack_failed(self, ctx: InFlight, exc: BaseException) -> None:
        if isinstance(exc, TransactionsFailed):
            # Its partition's transaction failed (fenced, or taken over anew): the
            # partition is dropped here and its requests served again from its commit
            # point; a dead letter could not go into that transaction either.
            log.warning("terminal event for offset %s of %s not committed (%s); served "
                        "again", ctx.offset, ctx.topic_partition, exc)
            return
        if not retriable(exc) or await self._topic_gone(ctx.reply_topic):
            await self._dead_letter(ctx, exc, gone=retriable(exc))
            return
        # Not acknowledged: leave the offset unfinished so it is served again.
        log.error("terminal event for offset %s of %s not acknowledged: %s", ctx.offset,
                  ctx.topic_partition, exc)

    async def _dead_letter(self, ctx: InFlight, exc: BaseException, gone: bool = False) -> None:
        """The reply topic refuses the terminal event for good or no longer exists: the
        request goes to the dead-letter topic with the reason, and its offset is finished
        once that is acknowledged — never silently stuck."""
        why = "the topic no longer exists" if gone else f"{type(exc).__name__}: {exc}"
        record = self._undeliverable_record(ctx, why)
        log.error("the terminal event of the request could not be written to %s (%s); "
                  "dead-lettering it", ctx.reply_topic, why,
                  extra={"request_id": ctx.request_id})
        if self._on_dead_letter is not None:
            self._on_dead_letter()
        try:
            future = await self._ending(ctx.topic_partition).send(record.topic, record.value,
                                                                   record.key)
        except KafkaError as dlq_exc:
            log.error("dead-lettering offset %s of %s failed too (%s); it stays unfinished",
                      ctx.offset, ctx.topic_partition, dlq_exc)
            return
        self._track(future, ctx.topic_partition, ctx.offset)

    # ---- helpers -----------------------------------------------------------------------

    async def _topic_ready(self, topic: str, producer: ProducerPort | None = None) -> bool:
        """Whether the producer knows `topic`'s partitions, waiting for them at most
        METADATA_WAIT_S (milliseconds for a topic that exists)."""
        producer = producer or self._producer
        if producer.knows(topic):
            return True  # the common case: no task to wait on
        if time.monotonic() < self._unready_until.get(topic, 0.0):
            return False
        try:
            await within(METADATA_WAIT_S, producer.learn(topic))
        except (TimeoutError, KafkaError):
            now = time.monotonic()
            self._unready_until = {t: until for t, until in self._unready_until.items()
                                   if until > now}  # forget topics that expired
            self._unready_until[topic] = now + UNREADY_FOR_S
            return False
        self._unready_until.pop(topic, None)
        return True

    async def _topic_gone(self, topic: str) -> bool:
        """True only when the broker answers, twice, that `topic` does not exist (it was
        deleted); False while it exists or while no broker can be asked (an outage
        passes with time, a deletion does not)."""
        for check in range(2):
            if check:
                await asyncio.sleep(GONE_RECHECK_S)
            try:
                if await self._producer.exists(topic):
                    return False
            except (TimeoutError, KafkaError, OSError):
                return False
        return True

    def _in_background(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _track(self, future: asyncio.Future[Any], tp: Any, offset: int,
               fallback: InFlight | None = None) -> None:
        """Finish `offset` once `future` is acknowledged. A terminal event refused for
        good, or whose reply topic is gone, dead-letters `fallback` (its request)."""
        self._pending.add(future)

        def acked(fut: asyncio.Future[Any]) -> None:
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


def retriable(exc: BaseException) -> bool:
    """Errors that pass with time (the broker away, leadership moving)."""
    return isinstance(exc, KafkaTimeoutError) or bool(getattr(exc, "retriable", False))
