"""Events on a reply topic: `token`, then exactly one terminal `done`/`error`/`timeout`.

The reply topic is the request's `reply_topic` (default `<prefix>.results`); every
event is keyed by its request id (UTF-8) and tells its kind by `type`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from schemas.names import MessageId
from schemas.requests import ToolCall, WithOptionalFields

_ATTEMPT = (
    "Which serving of the request this event belongs to: 0 first, one more each time the "
    "request is served again after a worker failure; each attempt ends with its own "
    "terminal event. Readers drop token events of a lower attempt than the highest they "
    "have seen. The request's outcome: a done or error of any attempt (the highest "
    "attempt's among several), never replaced by a timeout; a timeout only while no done "
    "or error has been seen (a re-served request may time out after an earlier attempt "
    "answered it)."
)


class ErrorCode(StrEnum):
    """Why a request was refused or failed.

    invalid_request: a field is wrong or unknown, or the prompt cannot be built for the
    model; unauthorized: the API key is missing, unknown, revoked or not granted the
    model or adapter; unknown_model: the model is not served on the topic the request
    came on; unknown_adapter: the model has no adapter of that name; context_too_long:
    the request does not fit the model's context; overloaded: the engine has no room for
    it now; internal: a failure inside sluice."""

    INVALID_REQUEST = "invalid_request"
    UNAUTHORIZED = "unauthorized"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_ADAPTER = "unknown_adapter"
    CONTEXT_TOO_LONG = "context_too_long"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


class _Event(BaseModel):
    """What every reply event carries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = Field(default=1, description="Message format version; always 1.")
    request_id: MessageId = Field(description=(
        "The id of the request this event answers (also the record's Kafka key)."))


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position, with its log probability."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_id: int = Field(description="The token's id in the model's vocabulary.")
    token: str = Field(description=(
        "The token alone, decoded (\"\" for a model without a tokenizer)."))
    logprob: float = Field(description=(
        "Natural-log probability; -9999.0 for a token that cannot come (OpenAI's "
        "convention)."))


class TokenLogprob(TopLogprob):
    """A generated token's log probability (the model's distribution, before
    temperature and top-k/top-p) and the most likely tokens' at that position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list, description=(
        "The request's `logprobs` most likely tokens at this position, most likely "
        "first; empty when it asked for 0."))


class TokenEvent(_Event):
    """Newly generated tokens of a streamed request (`stream: true`), on the reply topic,
    keyed by request id. Joining the texts of an attempt's token events in seq order
    gives its done event's text."""

    type: Literal["token"] = Field(default="token", description='Always "token".')
    attempt: int = Field(default=0, ge=0, description=_ATTEMPT)
    seq: int = Field(ge=0, description=(
        "The event's place in its attempt's stream: 0, 1, 2, ..., restarting at 0 for "
        "each attempt. A seq already seen is a duplicate (a producer retry): drop it."))
    token_ids: list[int] = Field(description=(
        "The ids of the tokens generated since the previous event; empty for a last event "
        "that only carries text held back until then."))
    text: str = Field(description=(
        "The text those tokens added. Text that ends inside a UTF-8 character is held "
        "back and comes with a later event; a stop string is never part of it."))
    logprobs: list[TokenLogprob] | None = Field(default=None, description=(
        "One per token id, when the request asked for logprobs; else null."))


class Usage(BaseModel):
    """Token counts of a finished request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(ge=0, description="Tokens in the prompt, as the model saw it.")
    cached_prompt_tokens: int = Field(ge=0, description=(
        "Of prompt_tokens, those found in the KV cache (an earlier turn of the session or a "
        "shared prefix) and so not computed again."))
    completion_tokens: int = Field(ge=0, description="Tokens generated.")


class Timing(BaseModel):
    """Latencies of a finished request, in milliseconds from the broker's timestamp of
    the request record, so time queued on the topic counts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_ms: float = Field(ge=0, allow_inf_nan=False, description=(
        "Milliseconds until the request was first scheduled."))
    ttft_ms: float = Field(ge=0, allow_inf_nan=False, description=(
        "Milliseconds until its first token was generated (time to first token)."))
    total_ms: float = Field(ge=0, allow_inf_nan=False, description=(
        "Milliseconds until it was done."))


class DoneEvent(_Event, WithOptionalFields):
    """The request finished: the terminal event of a request that ran (or was cancelled),
    on the reply topic, keyed by request id."""

    OMITTED_WHEN_NULL: ClassVar[tuple[str, ...]] = ("tool_calls", "content")

    type: Literal["done"] = Field(default="done", description='Always "done".')
    attempt: int = Field(default=0, ge=0, description=_ATTEMPT)
    finish_reason: Literal["stop", "length", "cancelled", "tool_calls"] = Field(description=(
        "stop: the model ended its answer, a stop string appeared, or the JSON of "
        "response_format was complete; length: max_tokens (or the model's context) was "
        "reached; cancelled: a cancel record stopped it; tool_calls: the answer is the "
        "calls in tool_calls."))
    text: str = Field(description=(
        "All generated text. A stop string is never part of it. With stream true, the "
        "texts of the token events joined. With tool_calls, the calls as the model wrote "
        "them are part of it (content has the text without them)."))
    tool_calls: list[ToolCall] | None = Field(default=None, description=(
        "The calls the model made (a request with tools), parsed from its output in the "
        "model's own call format; null when it made none."))
    content: str | None = Field(default=None, description=(
        "With tool_calls: the generated text without the calls' own markup (what an "
        "OpenAI message's content is); null otherwise."))
    token_ids: list[int] | None = Field(default=None, description=(
        "All generated token ids, in order (sluice's workers always give them)."))
    usage: Usage = Field(description="Token counts.")
    timing: Timing = Field(description="Latencies, in milliseconds.")
    model: str = Field(description="The key of the model that served the request.")
    adapter: str | None = Field(default=None, description=(
        "The adapter that served it; null: the base model."))
    logprobs: list[TokenLogprob] | None = Field(default=None, description=(
        "One per generated token, when the request asked for logprobs; else null."))


class ErrorEvent(_Event):
    """The request was refused or failed: its terminal event, on the reply topic, keyed
    by request id."""

    type: Literal["error"] = Field(default="error", description='Always "error".')
    attempt: int = Field(default=0, ge=0, description=_ATTEMPT)
    code: ErrorCode = Field(description=(
        "What went wrong: invalid_request, unauthorized, unknown_model, unknown_adapter, "
        "context_too_long, overloaded or internal."))
    message: str = Field(description=(
        "A human-readable explanation naming the problem (for context_too_long, the "
        "numbers and the limit)."))


# What a timeout reports, in its event and in its `<prefix>.timeouts` record alike.
WaitedMs = Annotated[float, Field(ge=0, allow_inf_nan=False, description=(
    "Milliseconds from the broker's timestamp of the request record until it was "
    "timed out."))]
AppliedMaxTtftMs = Annotated[int, Field(ge=1, description=(
    "The deadline that applied, in milliseconds: the request's max_ttft_ms, capped by "
    "the model's."))]


class TimeoutEvent(_Event):
    """The request got no first token within its max_ttft_ms (or was predicted to miss
    it): its terminal event, on the reply topic, keyed by request id. No tokens follow;
    `<prefix>.timeouts` gets a record of it too."""

    type: Literal["timeout"] = Field(default="timeout", description='Always "timeout".')
    attempt: int = Field(default=0, ge=0, description=_ATTEMPT)
    waited_ms: WaitedMs
    max_ttft_ms: AppliedMaxTtftMs


ReplyEvent = Annotated[
    TokenEvent | DoneEvent | ErrorEvent | TimeoutEvent, Field(discriminator="type")
]
REPLY_EVENT_ADAPTER: TypeAdapter[ReplyEvent] = TypeAdapter(ReplyEvent)
TERMINAL_TYPES = frozenset({"done", "error", "timeout"})
