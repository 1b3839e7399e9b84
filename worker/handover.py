"""Partitions leaving this worker: a rebalance's revocation, or the whole group left.

A revocation finishes the requests held for the partitions (bounded by
HAND_OVER_S), drops the rest unanswered (their offsets stay unfinished, so the
new owner serves them again), commits and hands over. A worker the group no
longer knows (paused or cut off past its session) hands nothing over: the
partitions have new owners already, so it drops what it holds for them at once
and commits nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import TopicPartition

from batcher.engine import Engine
from common.timeouts import within
from ingest.consumer import SESSION_TIMEOUT_MS, RequestIngest
from ingest.offsets import OffsetTracker
from results.writer import ResultWriter
from worker.delivery import Delivery
from worker.metrics import WorkerMetrics
from worker.requests import HeldRequests

log = logging.getLogger(__name__)

LEAVE_GROUP_S = 30.0
# A revocation runs inside the rebalance: a member that has not rejoined within the
# rebalance timeout is dropped from the group, its partitions given to others while it
# still hands them over (and streams). Half of it for the requests to finish, a quarter
# for the last commit, the rest to rejoin.
HAND_OVER_S = SESSION_TIMEOUT_MS / 1000 / 2
LAST_COMMIT_S = SESSION_TIMEOUT_MS / 1000 / 4


@dataclass(slots=True, kw_only=True)
class Handover:
    held: HeldRequests
    tracker: OffsetTracker
    metrics: WorkerMetrics
    writer: ResultWriter
    delivery: Delivery
    ingest_of: Callable[[], RequestIngest | None]
    engine_of: Callable[[], Engine | None]

    def drop_held(self, partitions: set[object]) -> int:
        return self.held.cancel_from(partitions, self.engine_of())

    async def on_revoked(self, revoked: list[TopicPartition]) -> None:
        """Partitions move away (ingest has closed them: records still being judged are
        dropped)."""
        gone: set[object] = set(revoked)
        if not gone:
            return
        started = time.monotonic()
        names = sorted(tp.partition for tp in revoked)
        ingest = self.ingest_of()
        if ingest is not None and ingest.membership_lost():
            for tp in revoked:  # no answer, and no commit point to commit, from now on
                self.tracker.revoke(tp)
            dropped = self.drop_held(gone)
            self.delivery.release(list(revoked), "stopping revoked partitions' producers")
            log.warning("this worker fell out of the consumer group (paused or cut off "
                        "longer than its session timeout): partitions %s went to other "
                        "workers, which serve its %d requests of them again; dropped them "
                        "unanswered and rejoining", names, dropped)
            return
        await self.held.wait_none_from(gone, HAND_OVER_S)
        dropped = self.drop_held(gone)
        for tp in revoked:  # nothing more is answered for them, even if a step ends
            self.tracker.silence(tp)
        if ingest is not None:
            try:
                await within(LAST_COMMIT_S, ingest.commit())
            except Exception as exc:  # their new owner serves from the last commit point
                log.warning("the last commit of partitions %s failed (%s: %s); handing "
                            "them over from their previous commit point", names,
                            type(exc).__name__, exc)
        self.delivery.release(list(revoked), "stopping revoked partitions' producers")
        log.info("partitions %s revoked; handed over after %.2f s%s", names,
                 time.monotonic() - started,
                 f" ({dropped} unfinished requests left to their new owner)" if dropped else "")

    async def leave_group(self, ingest: RequestIngest, why: str) -> None:
        """This pool left the model's placement: finish what we hold, then hand the
        partitions to the workers of the pools that remain."""
        log.info("%s: leaving the group", why)
        await self.held.wait_empty(LEAVE_GROUP_S)
        await self.writer.flush()
        await ingest.commit()
        ingest.consumer.unsubscribe()
        for tp in list(self.tracker.partitions):
            self.tracker.revoke(tp)
            self.metrics.forget_partition(tp.partition)
