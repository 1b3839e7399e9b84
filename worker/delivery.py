"""How a worker delivers: at-least-once, or exactly-once with Kafka transactions.

Exactly-once puts terminal records and offsets in transactions, one
transactional id per input partition, taken over by each new owner of the
partition (`results.transactions`: the broker fences the old one). This module
switches between the two when the compute config changes, takes partitions
over as they are assigned, and drops a partition whose id was fenced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.settings import Settings
from ingest.consumer import RequestIngest
from ingest.offsets import OffsetTracker
from results.transactions import PartitionTransactions, TransactionCommitter
from results.writer import ResultWriter
from schemas import ModelDeployment
from worker.metrics import WorkerMetrics
from worker.supervision import OnFailure, WatchedTasks

log = logging.getLogger(__name__)

# A fenced partition the group still gives this worker is taken over again once a
# heartbeat sent after the fence says the group is unchanged, or this long after at the
# latest: a zombie hears from its group within a few heartbeats (one a second).
RETAKE_AFTER_S = 5.0
RETAKE_CHECK_S = 0.1
# A partition whose transaction failed otherwise is taken over again this soon.
RETRY_AFTER_FAILURE_S = 1.0


@dataclass(slots=True, kw_only=True)
class Delivery:
    settings: Settings
    model: str
    writer: ResultWriter
    tracker: OffsetTracker
    metrics: WorkerMetrics
    tasks: WatchedTasks
    ingest_of: Callable[[], RequestIngest | None]
    fail: OnFailure
    drop_held: Callable[[set[object]], int]
    # Whether a heartbeat sent after a moment (time.monotonic) found this worker's
    # assignment current (`MembershipGate.member_since`).
    member_since: Callable[[float], bool] = lambda _moment: False
    # Exactly-once: the partitions' transactions, and who closes them (None:
    # at-least-once).
    transactions: PartitionTransactions | None = field(default=None, init=False)
    committer: TransactionCommitter | None = field(default=None, init=False)
    _committer_task: asyncio.Task[Any] | None = field(default=None, init=False)

    @property
    def group_id(self) -> str:
        return self.settings.topic(self.model)

    async def use(self, dep: ModelDeployment) -> None:
        """The delivery `dep` asks for, from now on."""
        ingest = self.ingest_of()
        if dep.compute_config.delivery != "exactly_once":
            if self.committer is not None:
                self.committer.close()
                if self._committer_task is not None:
                    self._committer_task.cancel()
                self.committer = self._committer_task = None
                await self.writer.use_transactions(None)
                self.transactions = None
                log.info("delivery: at least once")
            if ingest is not None:
                self.wire(ingest)
            return
        self.transactions = await self.writer.use_transactions(self.group_id)
        assert self.transactions is not None
        if ingest is not None:  # a reload: the partitions owned now get theirs
            await self.open_transactions(list(ingest.consumer.assignment()))
        if self.committer is None:
            self.committer = TransactionCommitter(
                self.transactions, self._pending_offsets, self.tracker.mark_committed,
                on_lost=self._on_partition_fenced, on_failed=self._on_partition_failed,
                on_commit=self.metrics.observe_transaction)
            self._committer_task = self.tasks.spawn(self.committer.run(), "transaction commits")
            log.info("delivery: exactly once (transactional ids %s.partition-N)",
                     self.group_id)
        if ingest is not None:
            self.wire(ingest)

    def wire(self, ingest: RequestIngest) -> None:
        """Ingest commits through the transactions, and serves an assigned partition only
        once it is taken over (both off in at-least-once)."""
        ingest.transactions = self.committer
        ingest.defer_assignment = self._take_over if self.transactions is not None else None

    def release(self, tps: list[Any], what: str) -> None:
        """Stop the producers of partitions this worker no longer owns (their new owners
        fence them anyway)."""
        if self.transactions is not None:
            self.tasks.spawn(self.transactions.release(tps), what, runs_forever=False)

    async def open_transactions(self, tps: list[Any]) -> None:
        """Take over the transactional ids of partitions just assigned, fencing their
        earlier holders, before their committed offsets are read. Retried while the
        broker is away; a worker that cannot is stopped (it may not serve them)."""
        if self.transactions is None or not tps:
            return
        deadline = time.monotonic() + self.settings.client.timeout_secs
        while True:
            try:
                await self.transactions.open(tps, self._still_assigned)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.fail(f"the transactional ids of partitions "
                               f"{sorted(tp.partition for tp in tps)} could not be taken "
                               "over", exc)
                    raise
                log.warning("taking over the transactional ids of partitions %s failed "
                            "(%s: %s); trying again", sorted(tp.partition for tp in tps),
                            type(exc).__name__, exc)
                await asyncio.sleep(1.0)

    def _still_assigned(self, tp: Any) -> bool:
        ingest = self.ingest_of()
        return ingest is not None and tp in ingest.consumer.assignment()

    def _on_partition_fenced(self, tp: Any, why: str) -> None:
        """A partition's transactional id was taken over: another worker owns the
        partition now (this one was paused, or cut off, past its session) — or the
        coordinator aborted a transaction open past TRANSACTION_TIMEOUT_MS, which fences
        the same way. Nothing more is written or committed for it; what this worker held
        of it is dropped. If the group still gives it to this worker a while later, it
        is taken over again (else nobody would serve it)."""
        dropped = self._drop_and_retake(tp, RETAKE_AFTER_S, "its transactional id was "
                                        "fenced (a transaction the coordinator timed out)")
        log.warning("%s (this worker was paused or cut off past its session timeout): "
                    "its %d requests here are dropped unanswered, served by their new "
                    "owner; nothing of it was committed from here", why, dropped)

    def _on_partition_failed(self, tp: Any, why: str) -> None:
        """A transaction of the partition failed other than by fencing (its coordinator
        cut off from its followers, say): the partition alone is dropped and taken over
        anew — its new producer aborts what the old one left open, and it is served
        again from its commit point — instead of stopping the worker."""
        dropped = self._drop_and_retake(tp, RETRY_AFTER_FAILURE_S, why)
        log.warning("%s: its %d requests here are dropped unanswered and served again "
                    "from its commit point once it is taken over anew", why, dropped)

    def _drop_and_retake(self, tp: Any, after_s: float, why: str) -> int:
        """Nothing more is answered, written or committed for `tp` here; it is taken over
        again `after_s` later if the group still gives it to this worker. Returns how
        many held requests were dropped."""
        self.tracker.revoke(tp)
        dropped = self.drop_held({tp})
        self.release([tp], f"stopping partition {tp.partition}'s producer")
        ingest = self.ingest_of()
        if ingest is not None:
            ingest.hold_back([tp])
            self.tasks.spawn(self._retake_if_still_ours(tp, ingest, ingest.assignments,
                                                        after_s, why),
                             f"checking partition {tp.partition}'s owner",
                             runs_forever=False)
        return dropped

    async def _retake_if_still_ours(self, tp: Any, ingest: RequestIngest, assignment: int,
                                    after_s: float, why: str) -> None:
        """A zombie learns within a few heartbeats that the group moved on (a rebalance,
        or its membership lost); a partition still this worker's when a heartbeat sent
        after now is answered, or `after_s` later at the latest, is taken over again
        (a transaction the coordinator timed out while a leader was cut off fences as
        a take-over does: waiting the whole `after_s` kept its requests waiting)."""
        since = time.monotonic()
        deadline = since + after_s
        while time.monotonic() < deadline and not self.member_since(since):
            await asyncio.sleep(RETAKE_CHECK_S)
        if (self.ingest_of() is not ingest or ingest.assignments != assignment
                or ingest.membership_lost() or not self._still_assigned(tp)):
            return
        log.warning("partition %d is still this worker's %.1f s after %s: taking it over "
                    "again", tp.partition, time.monotonic() - since, why)
        self._take_over([tp], assignment)

    def _pending_offsets(self) -> dict[Any, tuple[int, str]]:
        ingest = self.ingest_of()
        return dict(ingest.pending_offsets()) if ingest is not None else {}

    def _take_over(self, tps: list[Any], assignment: int) -> None:
        """Exactly-once: partitions just assigned (paused) are served once their
        transactional ids are taken over and their offsets read after that."""
        async def take_over() -> None:
            await self.open_transactions(tps)
            ingest = self.ingest_of()
            assert ingest is not None
            if assignment != ingest.assignments and self.transactions is not None:
                # A later rebalance came first: ports of partitions it did not give
                # this worker are let go of (those it did are kept, and its take-over
                # uses them).
                gone = [tp for tp in tps if not self._still_assigned(tp)]
                if gone:
                    self.release(gone, "stopping producers of a superseded take-over")
            await ingest.start_partitions(tps, assignment)

        self.tasks.spawn(take_over(), "taking partitions over", runs_forever=False)
