"""Events on a reply topic: `token`, then exactly one terminal `done`/`error`/`timeout`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from schemas.names import MessageId


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"
    UNAUTHORIZED = "unauthorized"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_ADAPTER = "unknown_adapter"
    CONTEXT_TOO_LONG = "context_too_long"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    request_id: MessageId


class TopLogprob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    token_id: int
    token: str  # the token alone, decoded
    logprob: float  # -9999.0 for a token that cannot come (OpenAI's convention)


class TokenLogprob(TopLogprob):
    """A generated token's log probability (the model's distribution, before
    temperature and top-k/top-p) and the most likely tokens' at that position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class TokenEvent(_Event):
    type: Literal["token"] = "token"
    attempt: int = Field(default=0, ge=0)
    seq: int = Field(ge=0)
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(ge=0)
    cached_prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class Timing(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_ms: float = Field(ge=0, allow_inf_nan=False)
    ttft_ms: float = Field(ge=0, allow_inf_nan=False)
    total_ms: float = Field(ge=0, allow_inf_nan=False)


class DoneEvent(_Event):
    type: Literal["done"] = "done"
    attempt: int = Field(default=0, ge=0)
    finish_reason: Literal["stop", "length", "cancelled"]
    text: str
    token_ids: list[int] | None = None
    usage: Usage
    timing: Timing
    model: str
    adapter: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when asked for


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    attempt: int = Field(default=0, ge=0)
    code: ErrorCode
    message: str


class TimeoutEvent(_Event):
    type: Literal["timeout"] = "timeout"
    attempt: int = Field(default=0, ge=0)
    waited_ms: float = Field(ge=0, allow_inf_nan=False)
    max_ttft_ms: int = Field(ge=1)


ReplyEvent = Annotated[
    TokenEvent | DoneEvent | ErrorEvent | TimeoutEvent, Field(discriminator="type")
]
REPLY_EVENT_ADAPTER: TypeAdapter[ReplyEvent] = TypeAdapter(ReplyEvent)
TERMINAL_TYPES = frozenset({"done", "error", "timeout"})
