"""Exactly-once delivery: terminal events and consumer offsets in Kafka transactions.

With a model's `delivery: exactly_once`, a worker writes every record that
ends a request — `done`, `error`, `timeout`, dead letters, the timeouts log —
through a transactional producer, and commits its request offsets only in
those transactions (consume–process–produce). A `read_committed` reader of a
reply topic then sees each request's terminal event once. Token events go
through a plain producer, outside any transaction, so streaming stays live.

**Zombies are fenced by the broker: one transactional id per input partition**
(`<group>.partition-<n>`, the scheme Kafka Streams used before KIP-447). When
a partition is assigned, its new owner initializes that id *before* it reads
the partition's committed offsets: the transaction coordinator aborts whatever
an earlier holder left open — a dead owner, or a paused one the group gave up
on — and bumps the id's epoch, so that holder's later sends, offset commits
and transaction commits all fail (ProducerFenced): a woken zombie can neither
commit a duplicate answer nor move the partition's committed offset backwards
(aiokafka sends TxnOffsetCommit v0, which carries no group generation, so the
group coordinator cannot refuse a stale one; the producer epoch can). After
that, no transaction of that id is pending, so the offsets the new owner reads
are stable. Each transaction holds one partition's answers and offsets.

Why this scheme and not KIP-447 (one producer per worker, fenced by the
consumer group's generation): that needs TxnOffsetCommit v3 and OffsetFetch v7
with `require_stable`, neither of which aiokafka speaks. The cost, measured in
`sluice bench kafka`: a producer per assigned partition, and a transaction per
active partition per commit (README, "What exactly-once costs").

Transactions are group commits: the first record opens one, and
`TransactionCommitter` closes every partition's open transaction 2-10 ms later
(LINGER_*), concurrently (or when asked: a revocation, a drain). Commit points
that moved without a record are committed every OFFSETS_INTERVAL_S. A fenced
partition is reported (`on_lost`) as soon as a send or a commit learns of it: the
worker drops it — its new owner serves its requests — and goes on with the others.
Any other failure of a transaction (a coordinator cut off from its followers
answering InvalidTxnState, say) is reported too (`on_failed`): the worker drops
that partition and takes it over anew — a new producer of its id aborts what the
old one left open, and the partition is served again from its commit point, as
after a restart. Without `on_failed`, such a failure stops the worker (exit code 3)
without committing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import IllegalOperation, InvalidProducerEpoch, ProducerFenced
from aiokafka.structs import OffsetAndMetadata

from common.broker_loss import forget_coordinators_on, let_go_of_fenced_brokers
from common.settings import produce_timeout_ms
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
# that died, stalled or was cut off, and the broker aborts it so reply partitions move
# on: until then a `read_committed` reader of every reply partition it wrote to sees
# nothing past its first record — every request's answer waits, not only the stalled
# worker's (`sluice bench chaos`: 15 s, and the broker's 10 s check, stalled all
# answers ~25 s after a worker was cut off). Long enough for a commit to outlast a
# leader's election (~6 s on a three-node cluster); one that does not is fenced, and
# its partition taken over again (`worker.delivery`).
TRANSACTION_TIMEOUT_MS = 6_000
# A commit still unanswered this long after it began can no longer succeed (the
# coordinator aborted its transaction at TRANSACTION_TIMEOUT_MS): its partition is
# dropped and taken over anew instead of its commits waiting on, possibly forever.
COMMIT_WITHIN_S = TRANSACTION_TIMEOUT_MS / 1000 + 5.0
# The background commits go on in rounds (a round's transactions batch what came while
# the last one committed); one partition's commit slower than this holds back no
# other's: the next round starts without it.
ROUND_WAIT_S = 1.0
FENCED = (ProducerFenced, InvalidProducerEpoch)

PendingOffsets = Callable[[], dict[Any, tuple[int, str]]]
Committed = Callable[[dict[Any, tuple[int, str]]], None]
# (partition, why): another worker took the partition's transactional id over.
OnLost = Callable[[Any, str], None]
# (partition, why): a transaction of the partition failed otherwise (a coordinator cut
# off refusing its state, say); None: such a failure stops the worker.
OnFailed = Callable[[Any, str], None] | None


class PartitionFenced(TransactionsFailed):
    """The partition's transactional id was taken over: another worker owns it now."""


class PartitionNotHeld(TransactionsFailed):
    """No transaction is open for the record's partition: this worker no longer owns it."""


class CommitUnanswered(TransactionsFailed):
    """A commit had no answer within COMMIT_WITHIN_S: its transaction was aborted meanwhile
    by the coordinator, or will be."""


class TransactionalProducerPort:
    """A `ProducerPort` whose every record goes into the open transaction (opening
    one if none is)."""

    def __init__(self, options: Mapping[str, Any], request_timeout_s: float,
                 transactional_id: str, has_records: asyncio.Event | None = None):
        self.transactional_id = transactional_id
        self.producer = AIOKafkaProducer(
            **options, transactional_id=transactional_id, enable_idempotence=True,
            acks="all", linger_ms=1, request_timeout_ms=produce_timeout_ms(request_timeout_s),
            max_request_size=8 * 1024 * 1024, transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
        )
        let_go_of_fenced_brokers(self.producer.client, f"producer {transactional_id}",
                                 also=forget_coordinators_on(self.producer))
        self._request_timeout_s = request_timeout_s
        # Held while a transaction is being committed: no record may slip into it then.
        self.gate = asyncio.Lock()
        self.in_transaction = False
        self.sent: list[asyncio.Future[Any]] = []  # the records of the open transaction
        self.failure: BaseException | None = None
        # Let go of (handed over, or lost with the group membership): never committed
        # from here again, whatever commit was under way. Set with `let_go`, which also
        # ends that commit's waits: a stopped producer leaves them unanswered forever.
        self.released = False
        self.let_go = asyncio.Event()
        self.commits_waiting = 0  # commits queued for the gate
        self.committing = False  # a commit holds the gate
        # Its failure was reported (`TransactionCommitter`: on_lost, on_failed).
        self.reported = False
        # Told of a failure that a send learnt of (its record's fence, or the producer's
        # fatal state): the committer reports it at once instead of at its next commit
        # of this port.
        self.on_failure: Callable[[TransactionalProducerPort, BaseException], None] | None
        self.on_failure = None
        # Set when the open transaction holds a record (shared by a worker's ports).
        self.has_records = has_records or asyncio.Event()
        self.num_records = 0  # in the open transaction
        # Records sent while a commit held the gate: (topic, value, key, headers, their
        # future).
        self.waiting: list[tuple[str, bytes, bytes | None, Sequence[tuple[str, bytes]] | None,
                                 asyncio.Future[Any]]] = []

    async def start(self) -> None:
        """Register the transactional id, and wait until the broker has: it aborts what
        an earlier holder of the id left open, and fences that producer for good.
        (aiokafka's `start` returns before the id is registered.)"""
        await self.producer.start()
        try:
            await within(self._request_timeout_s,
                         self.producer._txn_manager.wait_for_pid())  # type: ignore[union-attr]
        except BaseException:
            await self.producer.stop()
            raise

    async def stop(self) -> None:
        try:
            await self.producer.stop()
        finally:
            _settle_fenced(self.producer)  # a fatal error nobody else awaits

    async def send(self, topic: str, value: bytes, key: bytes | None,
                   headers: Sequence[tuple[str, bytes]] | None = None) -> asyncio.Future[Any]:
        if self.failure is not None:
            raise TransactionsFailed(f"transactions failed: {self.failure}")
        if self.released:
            raise PartitionNotHeld("the partition was handed over")
        if self.committing or self.commits_waiting:
            # A commit is under way (or about to take the gate, which it gets before
            # this send would): the record waits for the next transaction — that
            # commit sends it — and the caller (the event pump) goes on at once
            # instead of waiting for the commit.
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.waiting.append((topic, value, key, headers, future))
            return future
        async with self.gate:
            try:
                await self.open()
                future = await self.producer.send(topic, value, key=key, headers=headers)
            except IllegalOperation as exc:  # its transaction ended under it (fenced, failed)
                self._learnt_of_failure()
                raise TransactionsFailed(f"transactions failed: {exc}") from exc
            except FENCED as exc:
                self._failed(exc)
                raise
            future.add_done_callback(self._record_done)
            self.sent.append(future)
            self.num_records += 1
            self.has_records.set()
            return future

    async def send_waiting(self) -> None:
        """Records that came during a commit: into the next transaction (under `gate`)."""
        waiting, self.waiting = self.waiting, []
        if not waiting:
            return
        num_sent = 0
        try:
            await self.open()
            for topic, value, key, headers, future in waiting:
                sent = await self.producer.send(topic, value, key=key, headers=headers)
                num_sent += 1
                sent.add_done_callback(functools.partial(_settle, future))
                sent.add_done_callback(self._record_done)
                self.sent.append(future)
                self.num_records += 1
        except BaseException as exc:
            # Its senders wait on these futures (a flush, a drain): each one learns why.
            why = exc if isinstance(exc, Exception) else TransactionsFailed(
                "the commit that was to send it was cancelled")
            for *_record, future in waiting[num_sent:]:
                if not future.done():
                    future.set_exception(why)
            raise
        finally:
            if num_sent:
                self.has_records.set()

    def _record_done(self, future: asyncio.Future[Any]) -> None:
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, FENCED):
            self._failed(exc)

    def _learnt_of_failure(self) -> None:
        """A send was refused: if the producer is in aiokafka's fatal state (fenced, say),
        which refuses every later send — each answer would stay unfinished until a
        commit of this port noticed (`sluice bench chaos`: 34 s, that commit waiting on
        a coordinator) — report its error now."""
        manager = self.producer._txn_manager  # type: ignore[union-attr]
        if manager is not None and manager.is_fatal_error():
            waiter = manager.wait_for_transaction_end()
            exc = (waiter.exception() if waiter is not None and waiter.done()
                   and not waiter.cancelled() else None)
            self._failed(exc or TransactionsFailed("the producer is in a fatal state"))

    def _failed(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        if self.on_failure is not None and not (self.released or self.reported):
            # Soon, not inside this send (the report drops the partition and its port).
            asyncio.get_running_loop().call_soon(self.on_failure, self, self.failure)

    def fail_waiting(self, exc: BaseException) -> None:
        """Records never sent: their senders learn why."""
        for *_record, future in self.waiting:
            if not future.done():
                future.set_exception(exc)
        self.waiting.clear()

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


class PartitionTransactions:
    """A worker's transactional producers, one per input partition it owns."""

    def __init__(self, options: Mapping[str, Any], request_timeout_s: float, group_id: str):
        self._options = options
        self._request_timeout_s = request_timeout_s
        self.group_id = group_id
        self._ports: dict[Any, TransactionalProducerPort] = {}
        self._opening: dict[Any, asyncio.Lock] = {}  # one take-over of a partition at a time
        self.has_records = asyncio.Event()  # some partition's open transaction holds one
        # (partition, its port, the error): a send learnt that the port failed (set by
        # the `TransactionCommitter`).
        self.on_failure: Callable[[Any, TransactionalProducerPort, BaseException], None] | None
        self.on_failure = None

    def transactional_id(self, tp: Any) -> str:
        return f"{self.group_id}.partition-{tp.partition}"

    async def open(self, tps: list[Any],
                   wanted: Callable[[Any], bool] = lambda _tp: True) -> None:
        """Take over `tps`' transactional ids (fencing their earlier holders), all at
        once; before the partitions' committed offsets are read.

        One take-over of a partition at a time, in this worker: two rebalances in quick
        succession start a second take-over of a partition while the first still waits
        for its id (a coordinator away), and two producers of one id fence each other —
        the worker then drops, as taken over by another worker, a partition the group
        gave it (found by `sluice bench chaos`: a partition nobody served). A take-over
        that finds a port already open keeps it; one whose partition is no longer
        `wanted` (revoked meanwhile) when its id is taken stops its producer instead."""
        results = await asyncio.gather(*(self._open_one(tp, wanted) for tp in tps),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def _open_one(self, tp: Any, wanted: Callable[[Any], bool]) -> None:
        async with self._opening.setdefault(tp, asyncio.Lock()):
            if tp in self._ports:
                return
            port = TransactionalProducerPort(self._options, self._request_timeout_s,
                                             self.transactional_id(tp), self.has_records)
            port.on_failure = functools.partial(self._port_failed, tp)
            await port.start()
            if wanted(tp):
                self._ports[tp] = port
            else:  # let go of while its id was being taken: a later take-over opens anew
                await port.stop()

    def _port_failed(self, tp: Any, port: TransactionalProducerPort,
                     exc: BaseException) -> None:
        if self.on_failure is not None and self._ports.get(tp) is port:
            self.on_failure(tp, port, exc)

    def port(self, tp: Any) -> TransactionalProducerPort:
        port = self._ports.get(tp)
        if port is None:
            raise PartitionNotHeld(f"no transaction of partition {tp}: not owned here now")
        return port

    def ports(self) -> dict[Any, TransactionalProducerPort]:
        return dict(self._ports)

    def release(self, tps: list[Any]) -> Coroutine[Any, Any, None]:
        """Let go of `tps` (after their last commit, or once they were fenced): nothing
        more goes into their transactions from now on; the returned coroutine stops
        their producers (a rebalance listener hands it to a task: it must not wait)."""
        ports = [self._ports.pop(tp) for tp in tps if tp in self._ports]
        for port in ports:
            port.released = True
            port.let_go.set()
            port.fail_waiting(PartitionNotHeld("the partition was handed over"))
        return _stop_all(ports)

    async def close_all(self) -> None:
        await self.release(list(self._ports))


class TransactionCommitter:
    """Closes the open transactions with the consumer offsets they finish: a linger
    after a transaction's first record, every OFFSETS_INTERVAL_S for moved commit points
    alone, and whenever `commit` is called. Each partition's transaction is committed on
    its own producer, all at once."""

    def __init__(self, transactions: PartitionTransactions, pending: PendingOffsets,
                 committed: Committed, on_lost: OnLost = lambda _tp, _why: None,
                 on_failed: OnFailed = None,
                 on_commit: Callable[[], None] = lambda: None,
                 interval_s: float = OFFSETS_INTERVAL_S,
                 commit_within_s: float = COMMIT_WITHIN_S):
        self._transactions = transactions
        self._pending = pending  # commit points that changed, per partition
        self._committed = committed
        self._on_lost = on_lost
        self._on_failed = on_failed
        self._on_commit = on_commit
        self._interval_s = interval_s
        self._commit_within_s = commit_within_s
        self._last_commit = 0.0  # monotonic
        self._closed = False
        self.num_commits = 0
        # `run`'s commits under way, a task per port, and the first that failed for good.
        self._running: dict[TransactionalProducerPort, asyncio.Task[None]] = {}
        self._failure: BaseException | None = None
        transactions.on_failure = self._failed_while_sending

    async def run(self) -> None:
        """Commit in the background, in rounds: every partition's commit at once, the
        next round once they all ended — or ROUND_WAIT_S later without those still
        waiting on their coordinator, which are left to end on their own (all of a
        worker's transactions waited for one such before, outlived
        TRANSACTION_TIMEOUT_MS and were aborted)."""
        has_records = self._transactions.has_records
        # Cancelled, this leaves the commits under way to end (each is bounded, and ends
        # at once when its port is let go of): cancelling them lost a drain's last
        # transactions.
        while True:
            with contextlib.suppress(TimeoutError):
                await within(self._interval_s, has_records.wait())
            if has_records.is_set():
                busy = time.monotonic() - self._last_commit < BUSY_WITHIN_S
                await asyncio.sleep(LINGER_BUSY_S if busy else LINGER_IDLE_S)
            if self._failure is not None:
                raise self._failure
            started = self._start_commits()
            if started:
                await asyncio.wait(started, timeout=ROUND_WAIT_S)

    def _start_commits(self) -> list[asyncio.Task[None]]:
        if self._closed:
            return []
        self._transactions.has_records.clear()
        started = []
        for tp, port in self._work():
            if port in self._running:
                continue  # what came meanwhile is committed once it ends
            task = asyncio.create_task(self._commit_one(tp, port))
            self._running[port] = task
            task.add_done_callback(functools.partial(self._commit_ended, port))
            started.append(task)
        return started

    def _commit_ended(self, port: TransactionalProducerPort, task: asyncio.Task[None]) -> None:
        if self._running.get(port) is task:
            del self._running[port]
        if task.cancelled() or task.exception() is None:
            return
        if self._failure is None:
            self._failure = task.exception()
        self._transactions.has_records.set()  # `run` raises it

    def _work(self) -> list[tuple[Any, TransactionalProducerPort]]:
        """The ports with a transaction to commit, or a commit point that moved."""
        moved = self._pending()
        return [(tp, port) for tp, port in self._transactions.ports().items()
                if port.in_transaction or port.sent or port.waiting or tp in moved]

    def close(self) -> None:
        """No more commits (the producers are about to stop)."""
        self._closed = True

    async def commit(self) -> None:
        """Commit every partition's open transaction (or a transaction of offsets alone
        where only the commit point moved); raises TransactionsFailed (for good) if one
        fails other than by being fenced."""
        if self._closed:
            return
        self._transactions.has_records.clear()
        commits = [asyncio.ensure_future(self._commit_one(tp, port))
                   for tp, port in self._work()]
        if not commits:
            return
        # Shielded: a caller cancelled (a handover's time limit, a shutdown) leaves
        # each commit to end on its own — bounded, and at once when its port is let go
        # of — instead of abandoning it inside aiokafka's commit, where the next commit
        # of that port would fail.
        results = await asyncio.shield(asyncio.gather(*commits, return_exceptions=True))
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]

    async def _commit_one(self, tp: Any, port: TransactionalProducerPort) -> None:
        port.commits_waiting += 1
        try:
            await port.gate.acquire()
        finally:
            port.commits_waiting -= 1
        port.committing = True
        try:
            await self._commit_holding_gate(tp, port)
        finally:
            port.committing = False
            port.gate.release()

    async def _commit_holding_gate(self, tp: Any, port: TransactionalProducerPort) -> None:
        if self._closed:
            return
        if port.released or port.reported or isinstance(port.failure, FENCED) or (
                port.failure is not None and self._on_failed is not None):
            # Let go of, or reported lost or failed already (by a send, or a commit
            # that held the gate first): nothing of it is committed from here; the
            # rest go on.
            return
        if port.failure is not None:
            raise TransactionsFailed(f"transactions failed: {port.failure}")
        try:
            await self._answered(port, self._commit_and_send_waiting(tp, port))
        except FENCED as exc:
            port.failure = exc
            self._report_fenced(tp, port)
        except Exception as exc:
            port.failure = exc
            if self._on_failed is None:
                port.fail_waiting(TransactionsFailed(f"transaction failed: {exc}"))
                log.error("a transaction of partition %s failed (%s: %s); nothing it "
                          "held is committed", tp.partition, type(exc).__name__, exc)
                raise TransactionsFailed(f"transaction failed: {exc}") from exc
            self._report_failed(tp, port, exc)

    def _failed_while_sending(self, tp: Any, port: TransactionalProducerPort,
                              exc: BaseException) -> None:
        """A send learnt of its port's failure (`TransactionalProducerPort.on_failure`)."""
        if self._closed or port.released or port.reported:
            return
        if isinstance(exc, FENCED):
            self._report_fenced(tp, port)
        elif self._on_failed is not None:
            self._report_failed(tp, port, exc)
        # else: the next commit of the port raises it (and stops the worker)

    def _report_fenced(self, tp: Any, port: TransactionalProducerPort) -> None:
        _settle_fenced(port.producer)
        if port.reported or port.released:
            # A released port's fence is its successor's (or its new owner's) doing.
            return
        port.reported = True
        why = (f"partition {tp.partition}'s transactional id "
               f"{port.transactional_id} was taken over by another worker")
        port.fail_waiting(PartitionFenced(why))
        self._on_lost(tp, why)

    def _report_failed(self, tp: Any, port: TransactionalProducerPort,
                       exc: BaseException) -> None:
        """A failure other than a fence: the partition alone is dropped and taken over
        anew (a new producer of its id aborts what this one left open), as a restart
        would."""
        if port.reported or port.released:
            return
        port.reported = True
        port.fail_waiting(TransactionsFailed(f"transaction failed: {exc}"))
        log.error("a transaction of partition %s failed (%s: %s); nothing it held is "
                  "committed, and it is served again from its commit point",
                  tp.partition, type(exc).__name__, exc)
        if self._on_failed is not None:
            self._on_failed(tp, f"a transaction of partition {tp.partition} failed "
                            f"({type(exc).__name__}: {exc})")

    async def _answered(self, port: TransactionalProducerPort,
                        work: Coroutine[Any, Any, None]) -> None:
        """Run `work` (a commit) unless the port is let go of first — its producer is
        stopped, and aiokafka leaves the commit's waits unanswered for ever (`sluice
        bench chaos`: one commit so caught stopped all of a worker's commits) — or it
        is not answered within COMMIT_WITHIN_S (raises CommitUnanswered)."""
        task = asyncio.ensure_future(work)
        let_go = asyncio.ensure_future(port.let_go.wait())
        try:
            done, _ = await asyncio.wait({task, let_go}, timeout=self._commit_within_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the gate is held until the commit has unwound
            task.cancel()
            await asyncio.wait({task})
            raise
        finally:
            let_go.cancel()
        if task in done:
            task.result()
            return
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: what it says no longer matters
        if port.released:
            return  # nothing of it is committed from here; its next owner aborts it
        raise CommitUnanswered(f"the commit had no answer in {self._commit_within_s:g} s")

    async def _commit_and_send_waiting(self, tp: Any, port: TransactionalProducerPort) -> None:
        await self._commit(tp, port)
        await port.send_waiting()

    async def _commit(self, tp: Any, port: TransactionalProducerPort) -> None:
        if port.sent:
            # Every record acknowledged (or one failed): their offsets are finished by
            # delivery's callbacks, which run before this wait returns. (A wait, not a
            # gather: this commit cancelled must not cancel its records.)
            await asyncio.wait(port.sent)
            for record in port.sent:
                if record.cancelled():
                    raise TransactionsFailed("a record of the transaction was cancelled")
                if record.exception() is not None:
                    raise record.exception()  # type: ignore[misc]
        if port.released:
            # Let go of while this commit waited for the acknowledgements: its commit point
            # is gone with it, and committing the answers without their offsets would
            # have the partition's next owner answer them again. Left open, the
            # transaction is aborted when that owner takes the id over.
            return
        # Read under the gate, after the acknowledgements: a commit point read before
        # the gate was taken may be older than one a commit meanwhile wrote, and
        # committing it would move the partition back (the chaos test caught that).
        offsets = self._pending().get(tp)
        if not port.in_transaction and offsets is None:
            return
        had_records = bool(port.sent)
        await port.open()
        if offsets is not None:
            offset, meta = offsets
            await port.producer.send_offsets_to_transaction(
                {tp: OffsetAndMetadata(offset, meta)}, self._transactions.group_id)
        await port.producer.commit_transaction()
        port.in_transaction = False
        port.sent.clear()
        port.num_records = 0
        if offsets is not None:
            self._committed({tp: offsets})
        self.num_commits += 1
        if had_records:
            self._last_commit = time.monotonic()
        self._on_commit()


def _settle_fenced(producer: AIOKafkaProducer) -> None:
    """A fenced producer's transaction future holds the error, which nobody else will
    await: mark it seen, so that it is not reported again as never retrieved."""
    waiter = producer._txn_manager.wait_for_transaction_end()  # type: ignore[union-attr]
    if waiter is not None and waiter.done() and not waiter.cancelled():
        waiter.exception()


async def _stop_all(ports: list[TransactionalProducerPort]) -> None:
    await asyncio.gather(*(port.stop() for port in ports), return_exceptions=True)


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
