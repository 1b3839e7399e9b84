"""Reading `sluice.requests.<model>`: every record to exactly one verdict, in order.

One consumer per worker replica, in group `<prefix>.<model>` with a static
`group_instance_id`, so partitions — and with them sessions and their KV
cache — stay with a replica across restarts. Each record read is started in
the offset tracker, judged (`ingest.checks`) and its verdict handed to the
caller's `Route`; bytes the Kafka client could not even hand over
(`common.safe_fetch`) are dead-lettered naming where they are. Records are
handled in partition order. The commit point is the tracker's: never past a
record whose verdict is not yet done with.

Requests are read `read_committed`: a transactional producer's aborted
requests are never served. Keys off their murmur2 partition are audited
(`ingest.partitioning`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import NoOffsetForPartitionError, OffsetOutOfRangeError
from aiokafka.structs import ConsumerRecord

from common.broker_loss import let_go_of_fenced_brokers
from common.safe_fetch import SafeFetcher, describe
from common.timeouts import within
from common.topics import partitions_of
from ingest.checks import RequestChecks
from ingest.offsets import OffsetTracker
from ingest.partitioning import PartitionAudit
from ingest.permissions import PermissionChecker
from ingest.prompting import PromptBuilder
from ingest.verdicts import Cancel, DeadLettered, IngestOptions, Route

log = logging.getLogger(__name__)

# The group gives up on a member silent this long, and on one that has not rejoined
# this long after a rebalance began (aiokafka's default rebalance timeout is the same;
# named here because a revocation's handover must end well within it).
SESSION_TIMEOUT_MS = 10_000

OnRevoked = Callable[[list[TopicPartition]], Awaitable[None]]
# Partitions just assigned, for their owner to take over before they are read
# (exactly-once: fencing their earlier owners), and then to `start_partitions`.
# Called in the rebalance listener: it must not wait (see `on_assigned`).
DeferAssignment = Callable[[list[TopicPartition], int], None]


class Committer(Protocol):
    async def commit(self) -> None:
        """Commit the tracker's commit points, with whatever is waiting to be."""


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, ingest: RequestIngest):
        self._ingest = ingest

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._ingest.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self._ingest.on_assigned(assigned)


class RequestIngest:
    def __init__(self, options: IngestOptions, *, tracker: OffsetTracker,
                 checker: PermissionChecker, prompts: PromptBuilder, route: Route,
                 on_revoked: OnRevoked, audit: PartitionAudit | None = None):
        self.options = options
        self.tracker = tracker
        self._route = route
        self._revoked_hook = on_revoked
        # Exactly-once: assigned partitions are taken over first (see `on_assigned`).
        self.defer_assignment: DeferAssignment | None = None
        self._not_started: set[TopicPartition] = set()  # assigned, not yet taken over
        self.assignments = 0  # rebalances seen: a take-over of an older one is stale
        self.audit = audit or PartitionAudit()
        self.consumer = AIOKafkaConsumer(
            **options.kafka_options, group_id=options.group_id,
            group_instance_id=options.instance_id, enable_auto_commit=False,
            # Never a silent jump: "earliest" restarted a partition from offset 0 when a
            # fetch came back out of range (a leader killed mid-run), and every finished
            # request was read again. Positions are set by `start_partitions` and, when
            # out of range, by `_reposition`.
            auto_offset_reset="none", isolation_level="read_committed",
            session_timeout_ms=SESSION_TIMEOUT_MS, rebalance_timeout_ms=SESSION_TIMEOUT_MS,
            heartbeat_interval_ms=1_000,
            max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=16 * 1024 * 1024,
        )
        let_go_of_fenced_brokers(self.consumer._client, "the request consumer")
        self.fetcher = SafeFetcher(self.consumer)
        self.checks = RequestChecks(options, checker, prompts, self._cluster_topics)
        self.num_records = 0
        # Exactly-once delivery: offsets are committed by the transactions, never here.
        self.transactions: Committer | None = None

    async def _cluster_topics(self) -> set[str]:
        return set(await self.consumer.topics())

    # ---- the model's placement and adapters (the worker keeps them current) ----------

    @property
    def adapters(self) -> frozenset[str]:
        return self.checks.adapters

    @adapters.setter
    def adapters(self, names: frozenset[str]) -> None:
        self.checks.adapters = names

    @property
    def max_ttft_ms(self) -> int:
        return self.checks.max_ttft_ms

    @max_ttft_ms.setter
    def max_ttft_ms(self, value: int) -> None:
        self.checks.max_ttft_ms = value

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect; joining the group is `subscribe`'s (only when the worker serves)."""
        await self.consumer.start()
        await self.check_access()

    async def check_access(self) -> None:
        """Raise TopicAuthorizationFailedError if this worker may not see its request
        topic: subscribed without DESCRIBE, the client would only log it once and read
        nothing, forever."""
        await partitions_of(self.consumer, self.options.request_topic)

    @property
    def subscribed(self) -> bool:
        return bool(self.consumer.subscription())

    def subscribe(self) -> None:
        self.consumer.subscribe([self.options.request_topic], listener=_Rebalance(self))

    async def stop(self) -> None:
        await self.consumer.stop()

    async def on_assigned(self, assigned: list[TopicPartition]) -> None:
        self.assignments += 1
        if not assigned:
            return
        if self.defer_assignment is not None:
            # Paused until taken over. Not awaited here: opening producers inside the
            # rebalance listener stalled the consumer (it fetched nothing afterwards).
            self.consumer.pause(*assigned)
            self._not_started.update(assigned)
            self.defer_assignment(list(assigned), self.assignments)
            return
        # Paused until started too: the consumer fetches a partition as soon as it is
        # assigned, and records it returns before the tracker knows the partition are
        # dropped by `poll` (its epoch is None), so a partition is read only from where
        # `start_partitions` seeks it (the committed offset, else the beginning). Reading
        # from the client's own position lost those records for good (the chaos run, at
        # least once: the first record of a partition produced before its assignment).
        self.consumer.pause(*assigned)
        self._not_started.update(assigned)
        await self.start_partitions(list(assigned), self.assignments)

    async def start_partitions(self, tps: list[TopicPartition], assignment: int) -> None:
        """Read `tps`' committed offsets and metadata and serve them from there — unless
        a later rebalance came first (then that one's start will). After a deferred
        take-over, the consumer is moved to those offsets: it may have read older ones,
        before the fence resolved an earlier owner's last transaction."""
        if assignment != self.assignments:
            return
        tps = [tp for tp in tps if tp in self.consumer.assignment()]
        if not tps:
            return
        # aiokafka's public `committed()` drops the metadata we need; ask the coordinator
        # directly for offset + metadata. The ends: records the last owner may have read.
        committed = await self.consumer._coordinator.fetch_committed_offsets(tps)
        ends = await self.consumer.end_offsets(tps)
        if assignment != self.assignments:
            return
        deferred = [tp for tp in tps if tp in self._not_started]
        for tp in tps:
            meta = committed.get(tp)
            offset = meta.offset if meta is not None and meta.offset >= 0 else None
            self.tracker.assign(tp, meta.metadata if meta is not None else None, ends.get(tp),
                                committed_offset=offset)
            self.fetcher.assigned(tp, offset)
            if tp in self._not_started:
                if offset is None:
                    await self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, offset)
            log.info("assigned partition %d (committed %s, end %s)", tp.partition,
                     None if meta is None else f"{meta.offset} {meta.metadata}", ends.get(tp))
        self._not_started.difference_update(tps)
        if deferred:
            self.consumer.resume(*deferred)

    def hold_back(self, tps: list[TopicPartition]) -> None:
        """`tps` are not served until started again (`start_partitions`, from their
        committed offsets): a partition whose transactional id was fenced."""
        tps = [tp for tp in tps if tp in self.consumer.assignment()]
        if tps:
            self.consumer.pause(*tps)
            self._not_started.update(tps)

    def pause_all(self, paused: bool) -> None:
        """Backpressure: pause every partition, or resume those that are started."""
        consumer = self.consumer
        if paused:
            unpaused = consumer.assignment() - consumer.paused()
            if unpaused:
                consumer.pause(*unpaused)
        else:
            ready = consumer.paused() - self._not_started
            if ready:
                consumer.resume(*ready)

    async def on_revoked(self, revoked: list[TopicPartition]) -> None:
        self._not_started.difference_update(revoked)
        for tp in revoked:  # records being judged now are dropped, not served
            self.tracker.close(tp)
        await self._revoked_hook(revoked)
        for tp in revoked:
            self.tracker.revoke(tp)
            self.fetcher.revoked(tp)

    def membership_lost(self) -> bool:
        """Whether the group no longer knows this member (its session expired while it
        was paused or cut off: its partitions went to others, and it is rejoining)."""
        return not self.consumer._coordinator.member_id

    # ---- reading ------------------------------------------------------------------------

    async def poll(self, max_records: int) -> int:
        """Read up to `max_records` and route each one's verdict; returns how many."""
        try:
            records, unreadable = await self.fetcher.getmany(timeout_ms=50,
                                                             max_records=max_records)
        except (OffsetOutOfRangeError, NoOffsetForPartitionError) as exc:
            await self._reposition(exc)
            return 0
        # Only partitions assigned now (a revoked one's last fetch is no longer ours).
        epochs = {tp: self.tracker.epoch(tp) for tp in
                  {TopicPartition(r.topic, r.partition) for r in records}
                  | {bad.tp for bad in unreadable}}
        records = [r for r in records
                   if epochs[TopicPartition(r.topic, r.partition)] is not None
                   and not self.tracker.read_before(TopicPartition(r.topic, r.partition),
                                                    r.offset)]
        unreadable = [bad for bad in unreadable if epochs[bad.tp] is not None]
        # Records the partition's last owner finished are not served again.
        finished = [r for r in records
                    if self.tracker.finished_earlier(TopicPartition(r.topic, r.partition),
                                                     r.offset)]
        if finished:
            for r in finished:
                tp = TopicPartition(r.topic, r.partition)
                self.tracker.start(tp, r.offset)
                self.tracker.finish(tp, r.offset)
            done = {(r.partition, r.offset) for r in finished}
            records = [r for r in records if (r.partition, r.offset) not in done]
        attempts = [
            self.tracker.start(TopicPartition(r.topic, r.partition), r.offset) for r in records
        ]
        for bad in unreadable:
            self.tracker.start(bad.tp, bad.offset)
        # Note who started what before any work begins, so a crash past here is seen as
        # one (in exactly-once mode the transaction loop commits it within moments).
        if self.transactions is None:
            await self.commit()
        for bad in unreadable:  # the partition goes on past bytes nobody can read
            await self._route(DeadLettered(bad.tp, bad.offset, None, b"", bad.reason,
                                           epoch=epochs[bad.tp] or 0))

        cancels: list[Cancel] = []

        async def judge(record: ConsumerRecord, attempt: int) -> None:
            self.audit.check(record, self._num_partitions())
            tp = TopicPartition(record.topic, record.partition)
            verdict = dataclasses.replace(await self.checks.verdict(record, attempt),
                                          epoch=epochs[tp] or 0)
            if isinstance(verdict, Cancel):
                cancels.append(verdict)
            else:
                await self._route(verdict)

        # Judged concurrently: with the permission database away, one record may wait,
        # and the others must still reach their own deadlines (a cache hit resolves at
        # once, so in the normal case records keep their order).
        await asyncio.gather(*(judge(r, a) for r, a in zip(records, attempts, strict=True)))
        # Cancels last, in log order: a request read in the same batch as its cancel
        # is with the engine before the cancel looks for it.
        for cancel in sorted(cancels, key=lambda c: (c.tp.partition, c.offset)):
            await self._route(cancel)
        self.num_records += len(records) + len(unreadable) + len(finished)
        return len(records) + len(unreadable) + len(finished)

    async def _reposition(self, exc: OffsetOutOfRangeError | NoOffsetForPartitionError
                          ) -> None:
        """A partition's position is out of its log's range, or it has none: put it back
        where reading goes on (one past the last record handed over, else where it was
        started), never at the log's start unless records there are owed. A partition
        not started yet has no position until `start_partitions` seeks it (the consumer
        asks on its own first), so it is left alone."""
        arg = exc.args[0] if exc.args else None
        wanted = arg if isinstance(arg, dict) else {arg: None} if arg is not None else {}
        for tp, fetch_offset in wanted.items():
            if tp not in self.consumer.assignment() or tp in self._not_started:
                continue
            offset = self.fetcher.resume_offset(tp)
            if offset is None:
                offset = fetch_offset
            try:
                begins = await within(10, self.consumer.beginning_offsets([tp]))
            except Exception as lookup:  # a leader away: try again from the same place
                log.warning("%s: looking up the log's start failed (%s)", tp, describe(lookup))
                begins = {}
            begin = begins.get(tp)
            if offset is None and begin is None:
                await asyncio.sleep(0.2)  # nowhere known yet: the next poll asks again
                continue
            if offset is None or (begin is not None and offset < begin):
                log.error("%s: records below offset %s were deleted before they were "
                          "read (retention); going on from %s", tp, begin, begin)
                offset = begin
            else:
                # Past the end of the leader's log: one that does not have every record
                # yet. Wait for it at the same offset rather than skip or replay.
                log.warning("%s: offset %d is out of the log's range (start %s); reading "
                            "from it again", tp, offset, begin)
                await asyncio.sleep(0.2)
            if tp in self.consumer.assignment() and tp not in self._not_started:
                self.consumer.seek(tp, offset)

    def _num_partitions(self) -> int | None:
        partitions = self.consumer.partitions_for_topic(self.options.request_topic)
        return len(partitions) if partitions else None

    def pending_offsets(self) -> dict[TopicPartition, tuple[int, str]]:
        """Commit points that moved, of the partitions still assigned."""
        pending = self.tracker.pending_commits()
        if not pending:
            return {}
        assigned = self.consumer.assignment()
        return {tp: point for tp, point in pending.items() if tp in assigned}  # type: ignore[misc]

    async def commit(self) -> None:
        """Commit each partition's commit point: with the consumer, or in exactly-once
        mode only ever in a transaction with the terminal events before it (a plain
        commit there could move past an answer its transaction has not committed)."""
        if self.transactions is not None:
            await self.transactions.commit()
            return
        offsets = self.pending_offsets()
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self.tracker.mark_committed(offsets)
        except Exception as exc:  # a rebalance in progress; the next commit retries
            log.warning("commit failed: %s", exc)
