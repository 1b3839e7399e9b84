"""OpenAI's API shapes, translated to and from sluice's (the gateway and batch files).

Requests: `ChatCompletionBody` / `CompletionBody` (what OpenAI clients send) to
the fields of an `InferenceRequest`; model ids are `MODEL` or `MODEL:ADAPTER`.
Answers: a `done` event to a `chat.completion` / `text_completion` object, token
events to stream chunks, sluice's error codes to OpenAI's status and error body
(`gateway.openai_errors`). A JSON format
beside tools is combined as OpenAI combines them (`with_answer_format`): a forced
call decides.
Fields sluice does not serve are refused by name (400), never ignored in
silence: a request asking for something must not get an answer that looks like
it honoured it. Tools and tool choice, penalties, logit_bias (and vLLM's
min_tokens, ignore_eos, repetition_penalty) are served.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal, TypeVar

import orjson
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from schemas import DoneEvent, TokenLogprob, TopLogprob

_B = TypeVar("_B", bound=BaseModel)

# OpenAI fields sluice does not serve, and the values that mean "not asked for".
_UNSERVED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "functions": (None,), "function_call": (None,), "echo": (False,),
    "best_of": (None, 1), "suffix": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
    "store": (None, False), "service_tier": (None, "auto", "default"),
    "verbosity": (None,), "prompt_cache_key": (None,), "safety_identifier": (None,),
}
_HINTS = {"functions": " (send `tools`)", "function_call": " (send `tool_choice`)",
          "reasoning_effort": " (these models do not reason)"}
_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop",
                   "tool_calls": "tool_calls"}


class OpenAIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are checked by name below

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # an extension, as vLLM's
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions, served the same way
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)

    def unserved(self, max_n: int = 1) -> None:
        """Refuse (400) fields asked for that sluice does not serve (here: `n` above
        `max_n`), and `stream_options` without `stream` (as OpenAI does)."""
        for name, value in (self.model_extra or {}).items():
            if name not in _UNSERVED_DEFAULTS:
                raise OpenAIError(400, f"Unrecognized request argument supplied: {name}",
                                  param=name)
            if value in _UNSERVED_DEFAULTS[name]:
                continue
            hint = _HINTS.get(name, "")
            raise OpenAIError(400, f"`{name}` is not supported by sluice{hint}", param=name)
        if self.n > max_n:
            raise OpenAIError(400, f"`n` may be at most {max_n} here", param="n")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "`stream_options` is only allowed with `stream: true`",
                              param="stream_options")

    def common_fields(self, max_tokens: int | None) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "top_k", "seed"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        for name in ("presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.logit_bias:
            fields["logit_bias"] = self.logit_bias
        return add_metadata(fields, self.metadata, self.user)


def add_metadata(fields: dict[str, Any], metadata: dict[str, Any] | None,
                 user: str | None) -> dict[str, Any]:
    """`fields` with the request's metadata, OpenAI's `user` kept among it."""
    merged = dict(metadata or {})
    if user is not None:
        merged["user"] = user
    if merged:
        fields["metadata"] = merged
    return fields


class ChatCompletionBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unserved(self, max_n: int = 1) -> None:
        super().unserved(max_n)
        kind = (self.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise OpenAIError(400, f"response_format {kind!r} is not one of text, json_object, "
                              "json_schema", param="response_format")

    def fields(self) -> dict[str, Any]:
        fields = self.common_fields(self.max_completion_tokens or self.max_tokens)
        fields["messages"] = [_message(m, i) for i, m in enumerate(self.messages)]
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "`top_logprobs` needs `logprobs: true`",
                              param="top_logprobs")
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        if self.tools:  # checked by the wire schema (sluice's own is OpenAI's)
            fields["tools"] = self.tools
            if self.tool_choice is not None:
                fields["tool_choice"] = self.tool_choice
            if self.parallel_tool_calls is not None:
                fields["parallel_tool_calls"] = self.parallel_tool_calls
        elif self.tool_choice not in (None, "none"):
            raise OpenAIError(400, "`tool_choice` needs `tools`", param="tool_choice")
        wanted = self.response_format
        return with_answer_format(fields, wanted if (wanted or {}).get("type") != "text"
                                  else None, "response_format")


def with_answer_format(fields: dict[str, Any], answer_format: dict[str, Any] | None,
                       param: str) -> dict[str, Any]:
    """`fields` (their tools and tool_choice already in) with the JSON format asked of the
    answer (`param`: the field that asked), combined as OpenAI combines the two:

    - no tools, or tool_choice `none`: the format is the answer's (the worker enforces it);
    - tool_choice `required` or a named function: the forced call is the answer, its
      arguments fitting the function's parameters, so the format is left out. OpenAI
      accepts this pair and the call decides (instructor's `Mode.RESPONSES_TOOLS` sends
      a named tool_choice and a `text.format` of the same schema);
    - `auto` (the default with tools): OpenAI lets the model choose between a call and an
      answer in the format. A worker constrains an answer by one grammar, a call's or the
      format's, so sluice refuses the pair (400 naming `param`) rather than honour one of
      the two in silence.
    """
    if answer_format is None:
        return fields
    choice = fields.get("tool_choice", "auto") if fields.get("tools") else "none"
    if choice == "none":
        fields["response_format"] = answer_format
    elif choice == "auto":
        raise OpenAIError(400, f"`{param}` with `tools` and tool_choice auto is not supported "
                          "by sluice (the answer would be a call or the format, the model's "
                          "choice): send tool_choice required or a named function (the call "
                          "is the answer), none (the format is), or only one of the two",
                          param=param)
    return fields


class CompletionBody(_Body):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def fields(self) -> dict[str, Any]:
        fields = self.common_fields(self.max_tokens or 16)  # OpenAI's default for completions
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            fields["prompt_token_ids"] = prompt
        elif isinstance(prompt, list):
            if len(prompt) != 1:
                raise OpenAIError(400, "a list of several prompts is not supported by sluice "
                                  "yet; send one request per prompt", param="prompt")
            fields["prompt"] = prompt[0]
        else:
            fields["prompt"] = prompt
        return fields


def _message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """One OpenAI message as sluice's: role and content (string or text parts), an
    assistant's tool calls, a tool message's call id."""
    role = message.get("role")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise OpenAIError(400, f"messages[{index}].role {role!r} is not one of system, "
                          "developer, user, assistant, tool", param=f"messages[{index}].role")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(400, f"messages[{index}]: content parts of type {kind!r} "
                                  "are not supported (text only)",
                                  param=f"messages[{index}].content")
        content = [{"type": "text", "text": str(part.get("text", ""))} for part in content]
    elif not isinstance(content, str):
        raise OpenAIError(400, f"messages[{index}].content must be a string or a list of "
                          "text parts", param=f"messages[{index}].content")
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": (c.get("function") or {}).get("name"),
                                           "arguments": _arguments_text(c)}}
                             for c in message["tool_calls"] if isinstance(c, dict)]
        if not content:
            out["content"] = None
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    if message.get("name") is not None and role == "tool":
        out["name"] = message["name"]
    return out


def _arguments_text(call: dict[str, Any]) -> str:
    """A tool call's arguments as OpenAI's JSON string (some clients send an object)."""
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        return arguments
    return orjson.dumps(arguments if arguments is not None else {}).decode()


def parse_body(body_type: type[_B], raw: bytes) -> _B:
    """The request body as `body_type`, or OpenAI's 400 naming the first bad field
    (`param`) in plain words."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return body_type.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        param = ".".join(str(part) for part in errors[0]["loc"]) or None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: "
            f"{str(e['msg']).removeprefix('Value error, ')}" for e in errors)
        raise OpenAIError(400, f"invalid request: {problems}", param=param) from None


def split_model(model_id: str) -> tuple[str, str | None]:
    """`MODEL` or `MODEL:ADAPTER`."""
    model, _, adapter = model_id.partition(":")
    return model, adapter or None


def session_key(model_id: str, fields: dict[str, Any], header: str | None) -> str:
    """The Kafka key, so every turn of a conversation lands on one partition (and the
    worker holding its KV cache): `x-session-id` when given, else a digest of the
    model id and the conversation's first messages (system and first user turn)."""
    if header:
        return header
    messages = fields.get("messages")
    if messages:
        opening = messages[:2] if messages[0]["role"] == "system" else messages[:1]
        basis: Any = opening
    else:
        basis = fields.get("prompt") or fields.get("prompt_token_ids")
    digest = hashlib.sha256(orjson.dumps([model_id, basis], option=orjson.OPT_SORT_KEYS))
    return "oai-" + digest.hexdigest()[:32]


def usage(done: DoneEvent | list[DoneEvent]) -> dict[str, Any]:
    """Of one answer, or of n choices: the prompt counted once, completions summed."""
    dones = done if isinstance(done, list) else [done]
    u = dones[0].usage
    completion = sum(d.usage.completion_tokens for d in dones)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
            "total_tokens": u.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def finish_reason(done: DoneEvent) -> str:
    return _FINISH_REASONS.get(done.finish_reason, "stop")


def assistant_message(done: DoneEvent) -> dict[str, Any]:
    """The answer as an OpenAI assistant message: text, or tool calls (with the text
    around them as content, null when there is none)."""
    if not done.tool_calls:
        return {"role": "assistant", "content": done.text, "refusal": None}
    return {"role": "assistant", "content": done.content or None, "refusal": None,
            "tool_calls": [c.model_dump() for c in done.tool_calls]}


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's chat `logprobs`: per token its text, bytes, logprob and alternatives."""
    if logprobs is None:
        return None

    def one(t: TopLogprob) -> dict[str, Any]:
        return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}

    return {"content": [{**one(t), "top_logprobs": [one(a) for a in t.top_logprobs]}
                        for t in logprobs], "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprob] | None,
                        offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists, alternatives as {token: logprob}."""
    if logprobs is None:
        return None
    offsets = []
    for t in logprobs:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in logprobs],
            "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs} for t in logprobs],
            "text_offset": offsets}


def chat_completion(done: DoneEvent | list[DoneEvent], model_id: str,
                    created: int, request_id: str | None = None) -> dict[str, Any]:
    """One answer, or n choices (their `done` events in choice order)."""
    dones = done if isinstance(done, list) else [done]
    return {
        "id": f"chatcmpl-{request_id or dones[0].request_id}", "object": "chat.completion",
        "created": created, "model": model_id, "system_fingerprint": None,
        "choices": [{"index": i, "message": assistant_message(d),
                     "logprobs": chat_logprobs(d.logprobs),
                     "finish_reason": finish_reason(d)} for i, d in enumerate(dones)],
        "usage": usage(dones),
    }


def text_completion(done: DoneEvent | list[DoneEvent], model_id: str,
                    created: int, request_id: str | None = None) -> dict[str, Any]:
    dones = done if isinstance(done, list) else [done]
    return {
        "id": f"cmpl-{request_id or dones[0].request_id}", "object": "text_completion",
        "created": created, "model": model_id, "system_fingerprint": None,
        "choices": [{"index": i, "text": d.text,
                     "logprobs": completion_logprobs(d.logprobs),
                     "finish_reason": finish_reason(d)} for i, d in enumerate(dones)],
        "usage": usage(dones),
    }


Kind = Literal["chat", "completion"]


def chunk(kind: Kind, request_id: str, model_id: str, created: int, *, text: str | None = None,
          role: bool = False, finish: str | None = None,
          logprobs: list[TokenLogprob] | None = None, offset: int = 0,
          index: int = 0, tool_call: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: a piece of text (with the role, first), a piece of a tool
    call, or the finish."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        choice: dict[str, Any] = {"index": index, "delta": delta,
                                  "logprobs": chat_logprobs(logprobs),
                                  "finish_reason": finish}
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk",
                "created": created, "model": model_id, "system_fingerprint": None,
                "choices": [choice]}
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created,
            "model": model_id, "system_fingerprint": None,
            "choices": [{"index": index, "text": text or "",
                         "logprobs": completion_logprobs(logprobs, offset),
                         "finish_reason": finish}]}


def usage_chunk(kind: Kind, dones: list[DoneEvent], request_id: str, model_id: str,
                created: int) -> dict[str, Any]:
    prefix, obj = (("chatcmpl", "chat.completion.chunk") if kind == "chat"
                   else ("cmpl", "text_completion"))
    return {"id": f"{prefix}-{request_id}", "object": obj, "created": created,
            "model": model_id, "system_fingerprint": None, "choices": [],
            "usage": usage(dones)}


def now() -> int:
    return int(time.time())
