"""Records on sluice's own topics: `sluice.timeouts` and `sluice.deadletter`."""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.names import MessageId


class TimeoutRecord(BaseModel):
    """The original request (as it was decoded) and why it timed out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    type: Literal["timeout"] = "timeout"
    request_id: MessageId
    model: str
    attempt: int = Field(default=0, ge=0)
    reason: str
    waited_ms: float = Field(ge=0, allow_inf_nan=False)
    max_ttft_ms: int = Field(ge=1)
    request: dict[str, Any]


class DeadLetterRecord(BaseModel):
    """Bytes that could not be parsed as a request, with the reason and their origin."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    type: Literal["deadletter"] = "deadletter"
    reason: str
    topic: str
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    key_b64: str | None = None
    value_b64: str
    value_truncated: bool = False

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
