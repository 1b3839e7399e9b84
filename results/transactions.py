"""Exactly-once delivery: terminal events and consumer offsets in Kafka transactions.

With a model's `delivery: exactly_once`, a worker writes every record that
ends a request — `done`, `error`, `timeout`, dead letters, the timeouts log —
through one transactional producer, and commits its request offsets only in
those transactions (consume–process–produce). A `read_committed` reader of a
reply topic then sees each request's terminal event once: a worker killed
mid-transaction leaves an open transaction that the broker aborts (at once
when the replica restarts under its stable transactional id, which also fences
the dead one's producer; else after TRANSACTION_TIMEOUT_MS), and its requests,
uncommitted, are served again. Token events go through a plain producer,
outside any transaction, so streaming stays live.

Transactions are group commits: the first record opens one, and
`TransactionCommitter` closes it 2-10 ms later (LINGER_*) (or when asked: a revocation, a
drain) with every record sent meanwhile — and under load, every request that
ended while the previous commit was in flight — so a transaction stays open
only milliseconds and a `read_committed` reader's view of a reply partition
(its last stable offset) is held back only that long. Commit points that moved
without a record (a cancel, records started) are committed every
OFFSETS_INTERVAL_S. Any failure of a
transaction (fenced by a newer replica, a record refused) is fatal to the
worker: it stops (exit code 3) without committing, and whatever the failed
transaction held is served again by the next owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata

from common.timeouts import within
from common.topics import partitions_of
from results.producer import TransactionsFailed

log = logging.getLogger(__name__)

# After a transaction's first record, before it is committed: short when commits
# are rare (one request's answer waits little), longer when they follow each other
# (fewer, larger transactions: measured 0.75x -> 0.87x of at-least-once bulk
# throughput on 2 cores, `sluice bench kafka`).
LINGER_IDLE_S = 0.002
LINGER_BUSY_S = 0.010
BUSY_WITHIN_S = 0.02  # a commit of records this recent means load
OFFSETS_INTERVAL_S = 0.1
# An open transaction lives milliseconds; one older than this was left by a worker
# that died (or stalled), and the broker aborts it so reply partitions move on.
TRANSACTION_TIMEOUT_MS = 15_000

PendingOffsets = Callable[[], dict[Any, tuple[int, str]]]
Committed = Callable[[dict[Any, tuple[int, str]]], None]


class TransactionalProducerPort:
    """A `ProducerPort` whose every record goes into the open transaction (opening
    one if none is)."""

    def __init__(self, options: Mapping[str, Any], request_timeout_s: float,
                 transactional_id: str):
        self.transactional_id = transactional_id
        self.producer = AIOKafkaProducer(
            **options, transactional_id=transactional_id, enable_idempotence=True,
            acks="all", linger_ms=1, request_timeout_ms=int(request_timeout_s * 1000),
            max_request_size=8 * 1024 * 1024, transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
        )
        # Held while a transaction is being committed: no record may slip into it then.
        self.gate = asyncio.Lock()
        self.in_transaction = False
        self.sent: list[asyncio.Future[Any]] = []  # the records of the open transaction
        self.failure: BaseException | None = None
        self.has_records = asyncio.Event()  # the open transaction holds a record
        # Records sent while a commit held the gate: (topic, value, key, their future).
        self.waiting: list[tuple[str, bytes, bytes | None, asyncio.Future[Any]]] = []

    async def start(self) -> None:
        # Registers the transactional id: the broker aborts what an earlier holder of
        # it left open, and fences that producer for good.
        await self.producer.start()

    async def stop(self) -> None:
        await self.producer.stop()

    async def send(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        if self.failure is not None:
            raise TransactionsFailed(f"transactions failed: {self.failure}")
        if self.gate.locked():
            # A commit is under way: the record waits for the next transaction, and the
            # caller (the event pump) goes on at once instead of waiting for the commit.
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.waiting.append((topic, value, key, future))
            return future
        async with self.gate:
            await self.open()
            future = await self.producer.send(topic, value, key=key)
            self.sent.append(future)
            self.has_records.set()
            return future

    async def send_waiting(self) -> None:
        """Records that came during a commit: into the next transaction (under `gate`)."""
        waiting, self.waiting = self.waiting, []
        if not waiting:
            return
        await self.open()
        for topic, value, key, future in waiting:
            try:
                sent = await self.producer.send(topic, value, key=key)
            except Exception as exc:
                future.set_exception(exc)
                raise
            sent.add_done_callback(functools.partial(_settle, future))
            self.sent.append(future)
        self.has_records.set()

    async def open(self) -> None:
        if not self.in_transaction:
            await self.producer.begin_transaction()
            self.in_transaction = True

    def knows(self, topic: str) -> bool:
        return bool(self.producer.client.cluster.partitions_for_topic(topic))

    async def learn(self, topic: str) -> None:
        await self.producer.partitions_for(topic)

    async def exists(self, topic: str) -> bool:
        return bool(await partitions_of(self.producer, topic))


class TransactionCommitter:
    """Closes the open transaction with the consumer offsets it finishes: a linger
    after its first record, every OFFSETS_INTERVAL_S for moved commit points alone,
    and whenever `commit` is called."""

    def __init__(self, port: TransactionalProducerPort, group_id: str,
                 pending: PendingOffsets, committed: Committed,
                 on_commit: Callable[[], None] = lambda: None,
                 interval_s: float = OFFSETS_INTERVAL_S):
        self._port = port
        self._group_id = group_id
        self._pending = pending  # commit points that changed, per partition
        self._committed = committed
        self._on_commit = on_commit
        self._interval_s = interval_s
        self._last_commit = 0.0  # monotonic
        self._closed = False
        self.num_commits = 0

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await within(self._interval_s, self._port.has_records.wait())
            if self._port.has_records.is_set():
                busy = time.monotonic() - self._last_commit < BUSY_WITHIN_S
                await asyncio.sleep(LINGER_BUSY_S if busy else LINGER_IDLE_S)
            await self.commit()

    def close(self) -> None:
        """No more commits (the producer is about to stop)."""
        self._closed = True

    async def commit(self) -> None:
        """Commit the open transaction, or a transaction of offsets alone if only the
        commit points moved; raises TransactionsFailed (for good) if it fails."""
        port = self._port
        async with port.gate:
            if self._closed:
                return
            if port.failure is not None:
                raise TransactionsFailed(f"transactions failed: {port.failure}")
            try:
                await self._commit(port)
                await port.send_waiting()
            except Exception as exc:
                port.failure = exc
                for *_record, future in port.waiting:  # never sent: their senders learn it
                    if not future.done():
                        future.set_exception(TransactionsFailed(f"transaction failed: {exc}"))
                port.waiting.clear()
                log.error("a transaction failed (%s: %s); nothing it held is committed, "
                          "and it is served again by the partition's next owner",
                          type(exc).__name__, exc)
                raise TransactionsFailed(f"transaction failed: {exc}") from exc

    async def _commit(self, port: TransactionalProducerPort) -> None:
        if port.sent:
            # Every record acknowledged (or one failed): their offsets are finished by
            # delivery's callbacks, which run before this wait returns.
            results = await asyncio.gather(*port.sent, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
        offsets = self._pending()
        if not port.in_transaction and not offsets:
            return
        had_records = bool(port.sent)
        await port.open()
        if offsets:
            await port.producer.send_offsets_to_transaction(
                {tp: OffsetAndMetadata(offset, meta) for tp, (offset, meta) in offsets.items()},
                self._group_id)
        await port.producer.commit_transaction()
        port.in_transaction = False
        port.sent.clear()
        port.has_records.clear()
        self._committed(offsets)
        self.num_commits += 1
        if had_records:
            self._last_commit = time.monotonic()
        self._on_commit()


def _settle(proxy: asyncio.Future[Any], sent: asyncio.Future[Any]) -> None:
    """Pass a waiting record's real outcome to the future its sender holds."""
    if proxy.done():
        return
    if sent.cancelled():
        proxy.cancel()
    elif sent.exception() is not None:
        proxy.set_exception(sent.exception())  # type: ignore[arg-type]
    else:
        proxy.set_result(sent.result())
