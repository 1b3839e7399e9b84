"""`InferenceRequest`: what producers put on `sluice.requests.<model>`."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from schemas.names import AdapterName, MessageId, ModelName, TopicName

MAX_PROMPT_TOKEN_IDS = 1_048_576
MAX_TOKENS_LIMIT = 1_048_576
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_TTFT_MS_LIMIT = 24 * 3600 * 1000
INT64_MAX = 2**63 - 1

Role = Literal["system", "user", "assistant", "tool"]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class TextPart(BaseModel):
    """One part of a list-form message content (OpenAI's `[{"type": "text", ...}]`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]
    text: str


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: the answer is JSON (any object, or fitting a schema),
    enforced token by token."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    # A string, or text parts (joined, as chat templates see a string).
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class InferenceRequest(BaseModel):
    """One inference request. Exactly one of `messages`, `prompt`, `prompt_token_ids`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # Left out on the wire unless given: a worker then uses the model's own defaults
    # (generation_config.json), so "not said" must stay distinguishable from "0".
    OMITTED_UNLESS_SET: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k")

    v: Literal[1] = 1
    request_id: MessageId
    session_id: MessageId | None = None
    model: ModelName
    adapter: AdapterName | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = Field(default=None, min_length=1)
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        default=None, min_length=1, max_length=MAX_PROMPT_TOKEN_IDS
    )
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    max_ttft_ms: int | None = Field(default=None, ge=1, le=MAX_TTFT_MS_LIMIT)
    reply_topic: TopicName | None = None
    stream: bool = True
    metadata: dict[str, Any] = Field(default_factory=dict)
    # Log probabilities: the sampled token's and the `logprobs` most likely (0-20).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> InferenceRequest:
        given = [
            name
            for name in ("messages", "prompt", "prompt_token_ids")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(
                "exactly one of messages, prompt or prompt_token_ids is required "
                f"(found: {found})"
            )
        return self

    @property
    def partition_key(self) -> str:
        return self.session_id or self.request_id


class CancelRequest(BaseModel):
    """Stops a request: sent on the request's own topic with the request's own key (so
    it reaches the partition, and the worker, that holds the request) and with an
    `authorization` header of the request's tenant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    type: Literal["cancel"] = "cancel"
    request_id: MessageId


def is_cancel(obj: dict[str, Any]) -> bool:
    """Whether a parsed request-topic record is a cancel (requests carry no `type`)."""
    return obj.get("type") == "cancel"
