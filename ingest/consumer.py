"""Reading `sluice.requests.<model>`: decode, validate, check permission, hand over.

One consumer per worker replica, in group `<prefix>.<model>` with a static
`group_instance_id`, so partitions — and with them sessions and their KV
cache — stay with a replica across restarts. Each record ends one of three
ways: handed to the engine, answered at once with an `error` event, or
dead-lettered when it cannot even be answered (no request id, or a reply
topic it may not use, or bytes the Kafka client could not even hand over —
see `ingest.safe_fetch`). Records are handled in partition order.

Requests are read `read_committed`: a transactional producer's aborted
requests are never served. Session keys are expected on their murmur2
partition (the Java client's default partitioner); a key found elsewhere
means a producer partitions differently (librdkafka's default CRC32, say)
and splits sessions across workers, so it is counted and warned about.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.partitioner import murmur2
from aiokafka.structs import ConsumerRecord

from ingest.offsets import OffsetTracker
from ingest.permissions import Decision, PermissionChecker, PermissionsUnavailable
from ingest.prompting import PromptBuilder, PromptError
from ingest.safe_fetch import SafeFetcher, Unreadable
from results.writer import ResultWriter
from schemas import ErrorCode, InferenceRequest, SchemaError, decode
from schemas.names import ID_PATTERN, is_valid_topic
from sluice.settings import Settings
from sluice.topics import is_internal_topic, partitions_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Accepted:
    """A request that passed every check, ready for the engine."""

    request: InferenceRequest
    tp: TopicPartition
    offset: int
    attempt: int
    reply_topic: str
    arrival_time: float
    max_ttft_ms: int
    token_ids: list[int]
    # The permission database stayed unreachable past the request's deadline.
    expired: bool = False


Submit = Callable[[Accepted], Awaitable[None]]
OnMisrouted = Callable[[int], None]

# A producer partitioning keys differently is warned about at most this often.
MISROUTED_WARN_EVERY_S = 600.0


def murmur2_partition(key: bytes, num_partitions: int) -> int:
    """The partition Kafka's Java client (and aiokafka) picks for `key`."""
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, ingest: RequestIngest):
        self._ingest = ingest

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._ingest.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self._ingest.on_assigned(assigned)


class RequestIngest:
    def __init__(self, settings: Settings, *, model: str, instance_id: str,
                 tracker: OffsetTracker, writer: ResultWriter, checker: PermissionChecker,
                 prompts: PromptBuilder, submit: Submit,
                 on_revoked: Callable[[list[TopicPartition]], Awaitable[None]],
                 on_misrouted: OnMisrouted | None = None):
        self.settings = settings
        self.model = model
        self.tracker = tracker
        self.writer = writer
        self.checker = checker
        self.prompts = prompts
        self._submit = submit
        self._revoked_hook = on_revoked
        self.adapters: frozenset[str] = frozenset()
        self.max_ttft_ms = 60_000
        self._on_misrouted = on_misrouted
        self.consumer = AIOKafkaConsumer(
            **settings.kafka_options(), group_id=settings.topic(model),
            group_instance_id=instance_id, enable_auto_commit=False,
            auto_offset_reset="earliest", isolation_level="read_committed",
            session_timeout_ms=10_000, heartbeat_interval_ms=1_000,
            max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=16 * 1024 * 1024,
        )
        self.fetcher = SafeFetcher(self.consumer)
        self._known_topics: set[str] = set()
        self._topics_checked = 0.0
        self._misrouted_warned_at = -MISROUTED_WARN_EVERY_S
        self._misrouted_since_warning = 0
        self.num_records = 0
        self.num_misrouted = 0

    async def start(self) -> None:
        """Connect; joining the group is `subscribe`'s (only when the worker serves)."""
        await self.consumer.start()
        await self.check_access()

    async def check_access(self) -> None:
        """Raise TopicAuthorizationFailedError if this worker may not see its request
        topic: subscribed without DESCRIBE, the client would only log it once and read
        nothing, forever."""
        await partitions_of(self.consumer, self.settings.requests_topic(self.model))

    @property
    def subscribed(self) -> bool:
        return bool(self.consumer.subscription())

    def subscribe(self) -> None:
        self.consumer.subscribe([self.settings.requests_topic(self.model)],
                                listener=_Rebalance(self))

    async def stop(self) -> None:
        await self.consumer.stop()

    async def on_assigned(self, assigned: list[TopicPartition]) -> None:
        for tp in assigned:
            # aiokafka's public `committed()` drops the metadata we need; ask the
            # coordinator directly for offset + metadata.
            committed = await self.consumer._coordinator.fetch_committed_offsets([tp])
            meta = committed.get(tp)
            self.tracker.assign(tp, meta.metadata if meta is not None else None)
            self.fetcher.assigned(tp, meta.offset if meta is not None and meta.offset >= 0
                                  else None)
            log.info("assigned partition %d (committed %s)", tp.partition,
                     None if meta is None else f"{meta.offset} {meta.metadata}")

    async def on_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._revoked_hook(revoked)
        for tp in revoked:
            self.tracker.revoke(tp)
            self.fetcher.revoked(tp)

    async def poll(self, max_records: int) -> int:
        """Read and handle up to `max_records`; returns how many were read."""
        records, unreadable = await self.fetcher.getmany(timeout_ms=50, max_records=max_records)
        attempts = [
            self.tracker.start(TopicPartition(r.topic, r.partition), r.offset) for r in records
        ]
        for bad in unreadable:
            self.tracker.start(bad.tp, bad.offset)
        # Note who started what before any work begins, so a crash past here is seen as one.
        await self.commit()
        for bad in unreadable:
            await self._unreadable(bad)
        # Handled concurrently: with the permission database away, one record may
        # wait, and the others must still reach their own deadlines (a cache hit
        # resolves at once, so in the normal case records keep their order).
        await asyncio.gather(*(self._handle(r, a) for r, a in zip(records, attempts, strict=True)))
        self.num_records += len(records) + len(unreadable)
        return len(records) + len(unreadable)

    async def commit(self) -> None:
        pending = self.tracker.pending_commits()
        if not pending:
            return
        assigned = self.consumer.assignment()
        offsets = {tp: point for tp, point in pending.items() if tp in assigned}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self.tracker.mark_committed(offsets)
        except Exception as exc:  # a rebalance in progress; the next commit retries
            log.warning("commit failed: %s", exc)

    async def _unreadable(self, bad: Unreadable) -> None:
        """Bytes the client could not hand over: dead-lettered (naming where they are),
        so the partition goes on."""
        await self.writer.dead_letter(tp=bad.tp, offset=bad.offset, topic=bad.tp.topic,
                                      partition=bad.tp.partition, key=None, value=b"",
                                      reason=bad.reason)

    def _check_partitioning(self, record: ConsumerRecord) -> None:
        """Count (and now and then warn about) a key that is not on its murmur2
        partition: its producer splits sessions across workers."""
        if record.key is None:
            return
        partitions = self.consumer.partitions_for_topic(record.topic)
        if not partitions:
            return
        expected = murmur2_partition(record.key, len(partitions))
        if expected == record.partition:
            return
        self.num_misrouted += 1
        self._misrouted_since_warning += 1
        if self._on_misrouted is not None:
            self._on_misrouted(record.partition)
        now = time.monotonic()
        if now - self._misrouted_warned_at >= MISROUTED_WARN_EVERY_S:
            log.warning(
                "%d request(s) arrived on a partition other than their key's murmur2 partition "
                "(e.g. key %r on %s/%d, expected %d): a producer partitions differently, so a "
                "session's turns can reach different workers and miss their KV cache. "
                "librdkafka producers (confluent-kafka, kcat, ...) must set "
                "partitioner=murmur2_random", self._misrouted_since_warning,
                record.key[:64], record.topic, record.partition, expected)
            self._misrouted_warned_at = now
            self._misrouted_since_warning = 0

    async def _handle(self, record: ConsumerRecord, attempt: int) -> None:
        tp = TopicPartition(record.topic, record.partition)
        value = record.value if record.value is not None else b""
        self._check_partitioning(record)
        try:
            request = decode(InferenceRequest, value)
        except SchemaError as exc:
            await self._undecodable(record, tp, exc)
            return
        reply_topic = request.reply_topic or self.settings.topic("results")
        problem = await self._reply_topic_problem(reply_topic)
        if problem is not None:
            await self.writer.dead_letter(tp=tp, offset=record.offset, topic=record.topic,
                                          partition=record.partition, key=record.key,
                                          value=value, reason=problem)
            return

        async def refuse(code: ErrorCode, message: str) -> None:
            await self.writer.error_without_context(
                tp=tp, offset=record.offset, reply_topic=reply_topic,
                request_id=request.request_id, code=code, message=message)

        if request.model != self.model:
            await refuse(ErrorCode.UNKNOWN_MODEL,
                         f"model {request.model!r} is not served on topic {record.topic}")
            return
        if request.adapter is not None and request.adapter not in self.adapters:
            await refuse(ErrorCode.UNKNOWN_ADAPTER,
                         f"model {self.model!r} has no adapter {request.adapter!r}")
            return
        arrival = record.timestamp / 1000.0
        max_ttft_ms = min(request.max_ttft_ms or self.max_ttft_ms, self.max_ttft_ms)
        decision = await self._permission(record, request, arrival + max_ttft_ms / 1000)
        if decision is None:  # the database stayed away past the deadline
            await self._submit(Accepted(request, tp, record.offset, attempt, reply_topic,
                                        arrival, max_ttft_ms, [], expired=True))
            return
        if not decision.allowed:
            await refuse(ErrorCode.UNAUTHORIZED, decision.reason)
            return
        prefix = decision.reply_topic_prefix
        if prefix is not None and not reply_topic.startswith(prefix):
            await self.writer.dead_letter(
                tp=tp, offset=record.offset, topic=record.topic, partition=record.partition,
                key=record.key, value=value,
                reason=f"key {decision.key_id} may only use reply topics starting with "
                f"{prefix!r}, not {reply_topic!r}")
            return
        try:
            token_ids = self.prompts.token_ids(request)
        except PromptError as exc:
            await refuse(ErrorCode.INVALID_REQUEST, str(exc))
            return
        await self._submit(Accepted(request, tp, record.offset, attempt, reply_topic, arrival,
                                    max_ttft_ms, token_ids))

    async def _permission(self, record: ConsumerRecord, request: InferenceRequest,
                          deadline: float) -> Decision | None:
        auth = [v for k, v in record.headers if k.lower() == "authorization"]
        if len(auth) > 1:
            return Decision(False, "more than one authorization header")
        waiting = False
        while True:
            try:
                return await self.checker.check(auth[0] if auth else None, self.model,
                                                request.adapter)
            except PermissionsUnavailable as exc:
                if time.time() >= deadline:
                    return None
                if not waiting:
                    log.warning("waiting for the permission database: %s", exc,
                                extra={"request_id": request.request_id})
                    waiting = True
                await asyncio.sleep(0.5)

    async def _undecodable(self, record: ConsumerRecord, tp: TopicPartition,
                           exc: SchemaError) -> None:
        parsed = exc.parsed or {}
        request_id = parsed.get("request_id")
        reply = parsed.get("reply_topic") or self.settings.topic("results")
        answerable = (
            isinstance(request_id, str) and re.fullmatch(ID_PATTERN, request_id) is not None
            and isinstance(reply, str) and await self._reply_topic_problem(reply) is None
        )
        if answerable:
            await self.writer.error_without_context(
                tp=tp, offset=record.offset, reply_topic=reply, request_id=request_id,
                code=ErrorCode.INVALID_REQUEST, message=f"invalid request: {exc}")
        else:
            await self.writer.dead_letter(
                tp=tp, offset=record.offset, topic=record.topic, partition=record.partition,
                key=record.key, value=record.value or b"", reason=f"undecodable request: {exc}")

    async def _reply_topic_problem(self, topic: str) -> str | None:
        if not is_valid_topic(topic):
            return f"reply_topic {topic[:100]!r} is not a valid topic name"
        if is_internal_topic(self.settings, topic):
            return f"reply_topic {topic!r} is one of sluice's internal topics"
        pattern = self.settings.reply_topic_pattern
        if pattern is not None and re.fullmatch(pattern, topic) is None:
            return f"reply_topic {topic!r} does not match SLUICE_REPLY_TOPIC_PATTERN"
        if topic not in self._known_topics and time.monotonic() - self._topics_checked > 1.0:
            self._known_topics = set(await self.consumer.topics())
            self._topics_checked = time.monotonic()
        if topic not in self._known_topics:
            secured = self.settings.kafka.security_protocol != "PLAINTEXT"
            return f"reply_topic {topic!r} does not exist" + (
                " (or this worker may not DESCRIBE it)" if secured else "")
        return None
