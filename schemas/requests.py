"""`InferenceRequest` and `CancelRequest`: what producers put on `sluice.requests.<model>`.

Both travel as UTF-8 JSON values, keyed by the request's session id (its request
id when it has none), with a Kafka header `authorization: Bearer <api key>`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    model_serializer,
    model_validator,
)

from schemas.names import AdapterName, MessageId, ModelName, TopicName

MAX_PROMPT_TOKEN_IDS = 1_048_576
MAX_TOKENS_LIMIT = 1_048_576
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_TTFT_MS_LIMIT = 24 * 3600 * 1000
INT64_MAX = 2**63 - 1

Role = Literal["system", "user", "assistant", "tool"]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]

_V = "Message format version; always 1."
_REQUEST_ID = (
    "The request's id, chosen by the producer: 1-256 printable ASCII characters, no "
    "spaces. Every event on the reply topic carries it and is keyed by it."
)


class TextPart(BaseModel):
    """One part of a list-form message content (OpenAI's `[{"type": "text", ...}]`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"] = Field(description='Always "text": text is the only part kind.')
    text: str = Field(description="The part's text; a message's parts are joined without a "
                                  "separator.")


class JsonSchemaFormat(BaseModel):
    """The schema the answer must fit, in `response_format.json_schema` (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="response", max_length=64, description=(
        "A name for the schema, at most 64 characters; default \"response\". Accepted as "
        "OpenAI's API has it; the answer does not depend on it."))
    description: str | None = Field(default=None, description=(
        "What the schema is for. Accepted as OpenAI's API has it; the answer does not "
        "depend on it."))
    schema_: dict[str, Any] = Field(alias="schema", description=(
        "The JSON Schema (an object) the generated text must fit, enforced token by token. "
        "A schema that cannot be compiled ends the request with error invalid_request."))
    strict: bool | None = Field(default=None, description=(
        "Accepted as OpenAI's API has it; the schema is always enforced."))


class ResponseFormat(BaseModel):
    """OpenAI's response_format: the answer is JSON (any object, or fitting a schema),
    enforced token by token."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = Field(description=(
        "text: no constraint; json_object: the answer is one JSON object; json_schema: "
        "the answer is JSON fitting json_schema.schema. With JSON, the request ends "
        "(finish_reason stop) as soon as the JSON is complete."))
    json_schema: JsonSchemaFormat | None = Field(default=None, description=(
        "The schema, required when type is json_schema (else error invalid_request); "
        "ignored otherwise."))


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class WithOptionalFields(BaseModel):
    """A message whose fields added after version 1 are left out of its JSON while
    null, so its bytes stay what readers of version 1 (which refuse unknown fields)
    accept."""

    OMITTED_WHEN_NULL: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_null_additions(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in self.OMITTED_WHEN_NULL:
                if data.get(name) is None:
                    data.pop(name, None)
        return data
MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    """A function the model may call (OpenAI's `tools[].function`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: FunctionName = Field(description=(
        "The function's name: 1-64 letters, digits, '_', '.' or '-'."))
    description: str | None = Field(default=None, description=(
        "What the function does, for the model to decide when to call it."))
    parameters: dict[str, Any] | None = Field(default=None, description=(
        "The JSON Schema of its arguments (an object schema); null: no arguments. With "
        "tool_choice required or a named function, the arguments are generated to fit it, "
        "token by token."))
    strict: bool | None = Field(default=None, description=(
        "Accepted as OpenAI's API has it; a forced call's arguments always fit the schema."))


class Tool(BaseModel):
    """One tool of `tools`: a function (the only kind)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = Field(description='Always "function".')
    function: FunctionDefinition = Field(description="The function.")


class ToolChoiceFunction(BaseModel):
    """Names the function a forced call must be to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: FunctionName = Field(description="One of the tools' function names.")


class NamedToolChoice(BaseModel):
    """`tool_choice` forcing a call to one named function."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = Field(description='Always "function".')
    function: ToolChoiceFunction = Field(description="The function to call.")


class FunctionCall(BaseModel):
    """The function a tool call calls, and with what."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The function's name.")
    arguments: str = Field(description="Its arguments: a JSON object, as a string.")


class ToolCall(BaseModel):
    """A call the model made (in a done event), or made earlier (in an assistant message
    of the conversation)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=256, description=(
        "The call's id; a tool message answering it names it in tool_call_id."))
    type: Literal["function"] = Field(default="function", description='Always "function".')
    function: FunctionCall = Field(description="What is called.")


class ChatMessage(WithOptionalFields):
    """One turn of a conversation in `messages`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    OMITTED_WHEN_NULL: ClassVar[tuple[str, ...]] = ("tool_calls", "tool_call_id", "name")

    role: Role = Field(description="Who speaks: system, user, assistant or tool.")
    # A string, or text parts (joined, as chat templates see a string).
    content: str | list[TextPart] | None = Field(default=None, description=(
        "The turn's text: a string, or a list of text parts that are joined into one "
        "string before the chat template sees it. May be null (or left out) only in an "
        "assistant message with tool_calls."))
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=64, description=(
        "In an assistant message: the calls it made. Rendered by the model's chat "
        "template (or, for a template without tools, as the model's call format)."))
    tool_call_id: str | None = Field(default=None, max_length=256, description=(
        "In a tool message: the id of the call this message answers."))
    name: str | None = Field(default=None, max_length=64, description=(
        "In a tool message: the function whose result this is (optional)."))

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant "
                             "message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class InferenceRequest(WithOptionalFields):
    """One inference request. Exactly one of `messages`, `prompt`, `prompt_token_ids`.

    Topic `<prefix>.requests.<model>` (prefix SLUICE_TOPIC_PREFIX, default sluice);
    Kafka key: `session_id`, else `request_id` (UTF-8), partitioned with murmur2 (the
    Java client's default; librdkafka producers set partitioner=murmur2_random);
    header `authorization: Bearer <api key>` (exactly one). Unknown fields are refused.
    Answers go to the reply topic: token events (when streamed), then exactly one
    terminal event (done, error or timeout) per attempt. A request that cannot be
    answered there (no usable request_id, or a reply topic it may not use) is
    dead-lettered on `<prefix>.deadletter` instead."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # Left out on the wire unless given: a worker then uses the model's own defaults
    # (generation_config.json), so "not said" must stay distinguishable from "0".
    OMITTED_UNLESS_SET: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k")
    OMITTED_WHEN_NULL: ClassVar[tuple[str, ...]] = (
        "tools", "tool_choice", "parallel_tool_calls", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos")

    v: Literal[1] = Field(default=1, description=_V)
    request_id: MessageId = Field(description=_REQUEST_ID + (
        " The Kafka key when there is no session_id."))
    session_id: MessageId | None = Field(default=None, description=(
        "The conversation this request is a turn of (same id rules as request_id); null: "
        "none. It is the Kafka key, so a session's turns reach the same partition, worker "
        "and KV cache (partitioned with murmur2). Send the full conversation each turn: "
        "the engine reuses the part it already holds."))
    model: ModelName = Field(description=(
        "The registered model's key: 1-64 letters, digits, '-' or '_', starting with a "
        "letter or digit. Must be the model of the topic the request is on, else error "
        "unknown_model."))
    adapter: AdapterName | None = Field(default=None, description=(
        "A LoRA adapter registered for the model (same name rules as model); null: the "
        "base model. Unknown: error unknown_adapter; not granted to the API key: error "
        "unauthorized."))
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, description=(
        "The conversation so far (at least one message), rendered with the model's own chat "
        "template. Exactly one of messages, prompt or prompt_token_ids is given; otherwise "
        "error invalid_request."))
    prompt: str | None = Field(default=None, min_length=1, description=(
        "Plain text (at least one character), tokenized with the model's tokenizer as it "
        "is (a bos token only where the tokenizer adds one). Exactly one of messages, "
        "prompt or prompt_token_ids."))
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        default=None, min_length=1, max_length=MAX_PROMPT_TOKEN_IDS, description=(
            "The prompt as token ids (1 to 1,048,576 of them, each within the model's "
            "vocabulary, else error invalid_request), used as they are. Models without a "
            "tokenizer take only these. Exactly one of messages, prompt or "
            "prompt_token_ids."))
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_LIMIT, description=(
        "Most tokens to generate, 1 to 1,048,576; default 256. Reaching it ends the request "
        "with finish_reason length. Prompt tokens + max_tokens must fit the model's "
        "context, else the request is refused with error context_too_long."))
    temperature: float = Field(default=0.0, ge=0.0, le=100.0, allow_inf_nan=False, description=(
        "Sampling temperature, 0 to 100; 0 is greedy. Left out: the model's own default "
        "from its generation_config.json (greedy unless that samples)."))
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False, description=(
        "Nucleus sampling: sample only from the most likely tokens whose probabilities add "
        "up to top_p; above 0, at most 1 (1 = off). Left out: the model's own default."))
    top_k: int = Field(default=0, ge=0, le=1_000_000, description=(
        "Sample only from the top_k most likely tokens, 0 to 1,000,000 (0 = off). Left out: "
        "the model's own default."))
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX, description=(
        "Seed of this request's own random generator, 0 to 2^63-1: the same seed draws the "
        "same tokens whatever else shares its batch. null: unseeded."))
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS,
                                   description=(
        "Up to 16 strings (1-256 characters each) that end generation with finish_reason "
        "stop when one appears. A stop string is never part of text (nor of the streamed "
        "token texts). Needs a model with a tokenizer. Default: none."))
    max_ttft_ms: int | None = Field(default=None, ge=1, le=MAX_TTFT_MS_LIMIT, description=(
        "Most milliseconds from the broker's timestamp of the record (queue time counts) "
        "to the first token, 1 to 86,400,000. It may only tighten the model's own "
        "placement.max_ttft_ms (default 60000), which applies when this is null. Missed: "
        "a timeout event and a record on <prefix>.timeouts, never late tokens."))
    reply_topic: TopicName | None = Field(default=None, description=(
        "The topic the events go to (Kafka's topic name rules: 1-249 letters, digits, '.', "
        "'_' or '-'). null: <prefix>.results, i.e. sluice.results with the default "
        "SLUICE_TOPIC_PREFIX. It must already exist and may not be one of sluice's "
        "internal topics (request, control, timeouts, dead-letter); it must match "
        "SLUICE_REPLY_TOPIC_PATTERN when that is set and the API key's reply-topic prefix "
        "when it has one. Otherwise the request is dead-lettered with the reason."))
    stream: bool = Field(default=True, description=(
        "true (default): token events as tokens are generated, then the terminal event; "
        "false: only the terminal event is written."))
    metadata: dict[str, Any] = Field(default_factory=dict, description=(
        "Any JSON object of the producer's own, default {}. The engine does not act on it; "
        "it travels with the request (e.g. into a timeout record's copy)."))
    # Log probabilities: the sampled token's and the `logprobs` most likely (0-20).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "Ask for log probabilities: 0 to 20, the number of most likely alternatives given "
        "beside each sampled token's own. Token and done events then carry logprobs. "
        "null (default): none."))
    response_format: ResponseFormat | None = Field(default=None, description=(
        "Constrain the answer to JSON (OpenAI's response_format). null: free text."))
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS,
                                     description=(
        "Functions the model may call (OpenAI's tools; up to 128), with messages only. "
        "They reach the model's chat template as transformers passes them; calls come back "
        "in the done event's tool_calls, with finish_reason tool_calls."))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description=(
            "none: answer in text; auto (the default with tools): the model chooses text "
            "or calls; required: at least one call; {\"type\": \"function\", \"function\": "
            "{\"name\": ...}}: a call to that function. Forced calls (required, named) are "
            "generated to fit the functions' parameter schemas, token by token."))
    parallel_tool_calls: bool | None = Field(default=None, description=(
        "With tool_choice required: true allows several calls in one answer; otherwise "
        "one. (With auto the model's own output decides.)"))
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                           description=(
        "OpenAI's presence penalty, -2 to 2: each token already generated loses this much "
        "logit once. null: 0."))
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0,
                                            allow_inf_nan=False, description=(
        "OpenAI's frequency penalty, -2 to 2: each token already generated loses this much "
        "logit per time it was generated. null: 0."))
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0,
                                             allow_inf_nan=False, description=(
        "transformers' repetition penalty, above 0 and at most 10: tokens of the prompt or "
        "the output have positive logits divided by it, others multiplied. null: 1 (off)."))
    logit_bias: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")],
                     Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=1024, description=(
            "OpenAI's logit_bias: token id (as a string) to a bias of -100 to 100 added to "
            "its logit; up to 1024 of them. null: none."))
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT, description=(
        "The end-of-sequence tokens are forbidden until this many tokens are generated "
        "(stop strings still apply). null: 0."))
    ignore_eos: bool | None = Field(default=None, description=(
        "true: the model's end-of-sequence tokens do not end the answer (only max_tokens "
        "and stop strings do). null: false."))

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
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        choice = self.tool_choice
        if self.tools is None:
            if choice not in (None, "none"):
                raise ValueError("tool_choice needs tools")
            return
        if self.messages is None:
            raise ValueError("tools need messages (a chat), not prompt or prompt_token_ids")
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is "
                             "not one of the tools")
        wants_json = (self.response_format is not None
                      and self.response_format.type != "text")
        if wants_json and choice != "none":
            raise ValueError("response_format and tools (unless tool_choice is none) cannot "
                             "both constrain an answer: use one of them")

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may be (or must be) tool calls."""
        return self.tools is not None and self.tool_choice != "none"

    @property
    def partition_key(self) -> str:
        return self.session_id or self.request_id


class CancelRequest(BaseModel):
    """Stops a request: sent on the request's own topic with the request's own key (so
    it reaches the partition, and the worker, that holds the request) and with an
    `authorization` header of the request's tenant.

    A running request ends with a done event, finish_reason cancelled, and the tokens
    so far; a queued one the same with none; a finished or unknown one, or a cancel
    from another tenant's key, changes nothing. A malformed cancel is dead-lettered."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = Field(default=1, description=_V)
    type: Literal["cancel"] = Field(default="cancel", description=(
        'Always "cancel": what tells a cancel apart from a request on the request topic '
        "(requests carry no type)."))
    request_id: MessageId = Field(description="The id of the request to stop.")


def is_cancel(obj: dict[str, Any]) -> bool:
    """Whether a parsed request-topic record is a cancel (requests carry no `type`)."""
    return obj.get("type") == "cancel"
