"""One record's verdict: decode, reply topic, model and adapter, permission, prompt.

The order of the checks is the order of the answers a client can get: bytes
that are not a request with an id (or name a reply topic it may not use) are
dead-lettered; a request for another model or an unknown adapter, an
unauthorized one, or one whose prompt cannot be built gets an `error` event;
the rest are admitted. With the permission database away, a request waits for
it (never served unchecked) until its deadline, and is then admitted as
expired: the engine times it out.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from common.tracing import context_headers
from ingest.permissions import Decision, PermissionChecker, PermissionsUnavailable
from ingest.prompting import PromptBuilder, PromptError
from ingest.verdicts import (
    Admitted,
    Cancel,
    DeadLettered,
    IngestOptions,
    Refused,
    Verdict,
    key_digest,
)
from schemas import (
    CancelRequest,
    ErrorCode,
    InferenceRequest,
    SchemaError,
    decode,
    is_cancel,
    validate,
)
from schemas.names import ID_PATTERN, is_valid_topic

log = logging.getLogger(__name__)

KnownTopics = Callable[[], Awaitable[set[str]]]
TOPICS_REFRESH_S = 0.1


class RequestChecks:
    def __init__(self, options: IngestOptions, checker: PermissionChecker,
                 prompts: PromptBuilder, known_topics: KnownTopics):
        self.options = options
        self.checker = checker
        self.prompts = prompts
        self._known_topics_of_cluster = known_topics
        self.adapters: frozenset[str] = frozenset()
        self.max_ttft_ms = 60_000  # the model's placement
        self._known_topics: set[str] = set()
        self._topics_checked = 0.0
        self._refreshing = asyncio.Lock()

    async def verdict(self, record: ConsumerRecord, attempt: int) -> Verdict:
        read_time = time.time()
        tp = TopicPartition(record.topic, record.partition)
        if not record.value:
            what = ("a tombstone (a record with no value)" if record.value is None
                    else "a record with an empty value")
            return DeadLettered(tp, record.offset, record.key, b"",
                                f"{what} is not a request: a request is a JSON "
                                "InferenceRequest (`sluice schemas export`), and requests "
                                "are never deleted by key")
        value = record.value
        try:
            request = decode(InferenceRequest, value)
        except SchemaError as exc:
            if exc.parsed is not None and is_cancel(exc.parsed):
                return await self._cancel(record, tp, exc.parsed, value)
            return await self._undecodable(record, tp, exc)
        reply_topic = request.reply_topic or self.options.default_reply_topic
        problem = await self._reply_topic_problem(reply_topic)
        if problem is not None:
            return DeadLettered(tp, record.offset, record.key, value, problem)

        trace = context_headers(record.headers)

        def refuse(code: ErrorCode, message: str) -> Refused:
            return Refused(tp, record.offset, reply_topic, request.request_id, code, message,
                           trace_headers=trace)

        model = self.options.model
        if request.model != model:
            return refuse(ErrorCode.UNKNOWN_MODEL,
                          f"model {request.model!r} is not served on topic {record.topic}")
        if request.adapter is not None and request.adapter not in self.adapters:
            return refuse(ErrorCode.UNKNOWN_ADAPTER,
                          f"model {model!r} has no adapter {request.adapter!r}")
        admitted = Admitted(request, tp, record.offset, attempt, reply_topic,
                            arrival_time=record.timestamp / 1000.0,
                            max_ttft_ms=min(request.max_ttft_ms or self.max_ttft_ms,
                                            self.max_ttft_ms),
                            token_ids=[], trace_headers=trace, read_time=read_time)
        decision = await self._permission(record, request, admitted.deadline)
        if decision is None:  # the database stayed away past the deadline
            return admitted
        if not decision.allowed:
            return refuse(ErrorCode.UNAUTHORIZED, decision.reason)
        prefix = decision.reply_topic_prefix
        if prefix is not None and not reply_topic.startswith(prefix):
            return DeadLettered(
                tp, record.offset, record.key, value,
                f"key {decision.key_id} may only use reply topics starting with {prefix!r}, "
                f"not {reply_topic!r}")
        try:
            prompt = self.prompts.build(request)
        except PromptError as exc:
            return refuse(ErrorCode.INVALID_REQUEST, str(exc))
        return Admitted(request, tp, record.offset, attempt, reply_topic,
                        admitted.arrival_time, admitted.max_ttft_ms, prompt.token_ids,
                        prompt.chat, decision.tenant, key_digest(_authorization(record)),
                        tool_format=prompt.tool_format, trace_headers=trace,
                        read_time=read_time)

    async def _cancel(self, record: ConsumerRecord, tp: TopicPartition,
                      parsed: dict[str, object], value: bytes) -> Verdict:
        """A cancel record: well-formed, its sender's tenant looked up — a cancel sent
        with its request's own key needs no lookup, and with the database away the
        lookup waits for it, as requests do, until the request's max_ttft_ms from the
        cancel has passed (a request still unchecked by then has timed out); malformed,
        it is dead-lettered — it has no reply topic to answer on, and an error event
        under its request id would be a second terminal event for that request."""
        try:
            cancel = validate(CancelRequest, parsed)
        except SchemaError as exc:
            return DeadLettered(tp, record.offset, record.key, value,
                                f"invalid cancel record: {exc}")
        auth = [v for k, v in record.headers if k.lower() == "authorization"]
        tenant = None
        if len(auth) == 1:
            tenant = await self._tenant_of(auth[0], cancel.request_id,
                                           record.timestamp / 1000 + self.max_ttft_ms / 1000)
        return Cancel(tp, record.offset, cancel.request_id, tenant,
                      key_digest(auth[0]) if len(auth) == 1 else None)

    async def _tenant_of(self, authorization: bytes, request_id: str,
                         deadline: float) -> str | None:
        waiting = False
        while True:
            try:
                return await self.checker.tenant_of(authorization)
            except PermissionsUnavailable as exc:
                if time.time() >= deadline:
                    log.warning("a cancel could not be checked before its request's "
                                "deadline, so it stops nothing (unless sent with the "
                                "request's own key): %s", exc, extra={"request_id": request_id})
                    return None
                if not waiting:
                    log.warning("a cancel waits for the permission database: %s", exc,
                                extra={"request_id": request_id})
                    waiting = True
                await asyncio.sleep(0.5)

    async def _permission(self, record: ConsumerRecord, request: InferenceRequest,
                          deadline: float) -> Decision | None:
        auth = [v for k, v in record.headers if k.lower() == "authorization"]
        if len(auth) > 1:
            return Decision(False, "more than one authorization header")
        waiting = False
        while True:
            try:
                return await self.checker.check(auth[0] if auth else None, self.options.model,
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
                           exc: SchemaError) -> Verdict:
        parsed = exc.parsed or {}
        request_id = parsed.get("request_id")
        reply = parsed.get("reply_topic") or self.options.default_reply_topic
        answerable = (
            isinstance(request_id, str) and re.fullmatch(ID_PATTERN, request_id) is not None
            and isinstance(reply, str) and await self._reply_topic_problem(reply) is None
        )
        if answerable:
            return Refused(tp, record.offset, reply, request_id, ErrorCode.INVALID_REQUEST,
                           f"invalid request: {exc}",
                           trace_headers=context_headers(record.headers))
        return DeadLettered(tp, record.offset, record.key, record.value or b"",
                            f"undecodable request: {exc}")

    async def _refresh_topics(self) -> None:
        """Ask the cluster for its topics after a miss: never refuse a topic on a list
        older than the record (a new gateway's reply topic, created a moment ago), and
        ask at most every TOPICS_REFRESH_S (misses arriving together share one ask)."""
        missed_at = time.monotonic()
        async with self._refreshing:
            if self._topics_checked >= missed_at:
                return  # a list asked for after this miss arrived while it waited
            wait = TOPICS_REFRESH_S - (time.monotonic() - self._topics_checked)
            # Yield even when no wait is due: misses already queued on the loop (records
            # of one fetch) note their time before this ask and so share it.
            await asyncio.sleep(max(wait, 0.0))
            asked = time.monotonic()
            self._known_topics = await self._known_topics_of_cluster()
            self._topics_checked = asked  # the list is at least as new as the asking

    async def _reply_topic_problem(self, topic: str) -> str | None:
        options = self.options
        if not is_valid_topic(topic):
            return f"reply_topic {topic[:100]!r} is not a valid topic name"
        if topic in options.internal_topics or topic.startswith(options.internal_prefixes):
            return f"reply_topic {topic!r} is one of sluice's internal topics"
        pattern = options.reply_topic_pattern
        if pattern is not None and re.fullmatch(pattern, topic) is None:
            return f"reply_topic {topic!r} does not match SLUICE_REPLY_TOPIC_PATTERN"
        if topic not in self._known_topics:
            await self._refresh_topics()
        if topic not in self._known_topics:
            return f"reply_topic {topic!r} does not exist" + (
                " (or this worker may not DESCRIBE it)" if options.secured else "")
        return None


def _authorization(record: ConsumerRecord) -> bytes | None:
    """The record's one authorization header, None when there is none (or several)."""
    auth = [v for k, v in record.headers if k.lower() == "authorization"]
    return auth[0] if len(auth) == 1 else None
