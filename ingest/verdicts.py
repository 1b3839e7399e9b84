"""What ingest decides about each record, and what it needs to decide it.

Every record read ends in exactly one verdict, which ingest hands to its
caller's `Route` (the worker): `Admitted` goes to the engine, `Refused` is
answered with an `error` event, `DeadLettered` goes to the dead-letter topic
(bytes that cannot even be answered), `Cancel` stops a request the worker
holds. Ingest itself writes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from common.tracing import Headers
from ingest.turns import ChatPrompt
from schemas import ErrorCode, InferenceRequest


@dataclass(frozen=True, slots=True)
class IngestOptions:
    """Plain values ingest works with (the worker builds them from the settings)."""

    model: str
    request_topic: str
    group_id: str  # the model's consumer group
    instance_id: str  # this replica's static group member id
    default_reply_topic: str
    # sluice's own topics, never a reply topic: exact names and name prefixes.
    internal_topics: frozenset[str]
    internal_prefixes: tuple[str, ...]
    reply_topic_pattern: str | None  # SLUICE_REPLY_TOPIC_PATTERN
    kafka_options: Mapping[str, Any]  # aiokafka client options (bootstrap, security)

    @property
    def secured(self) -> bool:
        return self.kafka_options.get("security_protocol", "PLAINTEXT") != "PLAINTEXT"


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed every check: for the engine."""

    request: InferenceRequest
    tp: TopicPartition
    offset: int
    attempt: int
    reply_topic: str
    arrival_time: float  # the broker's timestamp of the record, seconds
    max_ttft_ms: int  # the tighter of the request's and the model's
    token_ids: list[int]  # empty only when it expired before it could be checked
    chat: ChatPrompt | None = None  # a templated chat prompt, for its next turn
    tenant: str | None = None  # whose key sent it: only that tenant may cancel it
    # A digest of its authorization header: a cancel with the same key needs no lookup.
    key_digest: bytes | None = None
    epoch: int = 0  # of the partition's assignment it was read under
    tool_format: str | None = None  # how the model writes tool calls (tools asked for)
    # The record's W3C trace context (`common.tracing`), continued by its answers.
    trace_headers: Headers | None = None
    read_time: float = 0.0  # when the worker read it, wall-clock seconds

    @property
    def deadline(self) -> float:
        """When the first token is due, on the broker's clock: the one source of it."""
        return self.arrival_time + self.max_ttft_ms / 1000


@dataclass(frozen=True, slots=True)
class Refused:
    """A request that can be answered, but only with an `error` event."""

    tp: TopicPartition
    offset: int
    reply_topic: str
    request_id: str
    code: ErrorCode
    message: str
    epoch: int = 0
    trace_headers: Headers | None = None  # the record's, passed on to its error event


@dataclass(frozen=True, slots=True)
class DeadLettered:
    """A record that cannot be answered (no request id, a forbidden reply topic, bytes
    the client could not read): it goes to the dead-letter topic with the reason."""

    tp: TopicPartition
    offset: int
    key: bytes | None
    value: bytes
    reason: str
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class Cancel:
    """A client's cancel record: stop `request_id` if this worker holds it and it was
    sent by `tenant` (None: the cancel's key is unknown or revoked, so it stops
    nothing). Nothing is written for the record itself."""

    tp: TopicPartition
    offset: int
    request_id: str
    tenant: str | None
    key_digest: bytes | None = None  # of its authorization header
    epoch: int = 0


Verdict = Admitted | Refused | DeadLettered | Cancel


def key_digest(authorization: bytes | str | None) -> bytes | None:
    """A digest of an authorization header's value: two records with the same key have
    the same digest (the key itself is not kept)."""
    if authorization is None:
        return None
    raw = authorization.encode() if isinstance(authorization, str) else authorization
    return hashlib.sha256(raw.strip()).digest()
Route = Callable[[Verdict], Awaitable[None]]
