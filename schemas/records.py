"""Records on sluice's own topics: `sluice.timeouts` and `sluice.deadletter`."""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.events import AppliedMaxTtftMs, WaitedMs
from schemas.names import MessageId

_V = "Message format version; always 1."


class TimeoutRecord(BaseModel):
    """The original request (as it was decoded) and why it timed out.

    Topic `<prefix>.timeouts`, keyed by request id (UTF-8): the log of timed-out
    requests, written beside the timeout event on the reply topic."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = Field(default=1, description=_V)
    type: Literal["timeout"] = Field(default="timeout", description='Always "timeout".')
    request_id: MessageId = Field(description="The timed-out request's id (also the key).")
    model: str = Field(description="The key of the model whose worker timed it out.")
    attempt: int = Field(default=0, ge=0, description=(
        "Which serving of the request timed out: 0 first, one more each time it is served "
        "again after a worker failure."))
    reason: str = Field(description=(
        "Why, in words: e.g. \"max_ttft_ms passed before the first token\", \"predicted to "
        "miss max_ttft_ms\", or the permission database staying unavailable until "
        "max_ttft_ms passed."))
    waited_ms: WaitedMs
    max_ttft_ms: AppliedMaxTtftMs
    request: dict[str, Any] = Field(description=(
        "The request as it was decoded: every InferenceRequest field, defaults filled in."))


class DeadLetterRecord(BaseModel):
    """Bytes that could not be parsed as a request, with the reason and their origin.

    Topic `<prefix>.deadletter`, keyed by the original record's key. Also records a
    request that named a reply topic it may not use, a malformed cancel, and a request
    whose terminal event its reply topic refused for good (then with the request
    re-encoded as the value)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = Field(default=1, description=_V)
    type: Literal["deadletter"] = Field(default="deadletter", description=(
        'Always "deadletter".'))
    reason: str = Field(description="Why the record could not be answered, in words.")
    topic: str = Field(description="The topic the original record was read from.")
    partition: int = Field(ge=0, description="Its partition.")
    offset: int = Field(ge=0, description="Its offset in that partition.")
    key_b64: str | None = Field(default=None, description=(
        "The original record's key, base64 (standard alphabet, padded); null when it had "
        "none."))
    value_b64: str = Field(description=(
        "The original record's value, base64 (standard alphabet, padded): its first "
        "65,536 bytes."))
    value_truncated: bool = Field(default=False, description=(
        "true when the value was longer than what value_b64 holds."))

    @classmethod
    def of(cls, *, reason: str, topic: str, partition: int, offset: int, key: bytes | None,
           value: bytes, keep_bytes: int = 65_536) -> DeadLetterRecord:
        kept = value[:keep_bytes]
        return cls(
            reason=reason, topic=topic, partition=partition, offset=offset,
            key_b64=base64.b64encode(key).decode() if key is not None else None,
            value_b64=base64.b64encode(kept).decode(),
            value_truncated=len(kept) < len(value),
        )

    def value(self) -> bytes:
        return base64.b64decode(self.value_b64)
