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

Transactions are group commits: the first record opens one; `TransactionCommitter`
closes it every COMMIT_INTERVAL_S (or when asked: a revocation, a drain), so one
transaction covers every request that ended meanwhile and a transaction stays
open only milliseconds — a `read_committed` reader's view of a reply partition
(its last stable offset) is held back only that long. Any failure of a
transaction (fenced by a newer replica, a record refused) is fatal to the
worker: it stops (exit code 3) without committing, and whatever the failed
transaction held is served again by the next owner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata

from common.topics import partitions_of
from results.producer import TransactionsFailed

log = logging.getLogger(__name__)

COMMIT_INTERVAL_S = 0.02
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

    async def start(self) -> None:
        # Registers the transactional id: the broker aborts what an earlier holder of
        # it left open, and fences that producer for good.
        await self.producer.start()

    async def stop(self) -> None:
        await self.producer.stop()

    async def send(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        async with self.gate:
            if self.failure is not None:
                raise TransactionsFailed(f"transactions failed: {self.failure}")
            await self.open()
            future = await self.producer.send(topic, value, key=key)
            self.sent.append(future)
            return future

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
    """Closes the open transaction with the consumer offsets it finishes: every
    COMMIT_INTERVAL_S in `run`, and whenever `commit` is called."""

    def __init__(self, port: TransactionalProducerPort, group_id: str,
                 pending: PendingOffsets, committed: Committed,
                 on_commit: Callable[[], None] = lambda: None,
                 interval_s: float = COMMIT_INTERVAL_S):
        self._port = port
        self._group_id = group_id
        self._pending = pending  # commit points that changed, per partition
        self._committed = committed
        self._on_commit = on_commit
        self._interval_s = interval_s
        self._closed = False
        self.num_commits = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
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
            except Exception as exc:
                port.failure = exc
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
        await port.open()
        if offsets:
            await port.producer.send_offsets_to_transaction(
                {tp: OffsetAndMetadata(offset, meta) for tp, (offset, meta) in offsets.items()},
                self._group_id)
        await port.producer.commit_transaction()
        port.in_transaction = False
        port.sent.clear()
        self._committed(offsets)
        self.num_commits += 1
        self._on_commit()
