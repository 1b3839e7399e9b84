"""OpenAI's Responses API (`POST /v1/responses`), translated to and from sluice's shapes.

A request's `instructions` and `input` — a string, or items: messages (text parts),
`function_call` items (the model's earlier calls) and `function_call_output` items
(their results) — become the `messages` of an `InferenceRequest`, after the stored
conversation of `previous_response_id` when there is one; function `tools`,
`tool_choice`, `text.format` (JSON) and the sampling fields map as the chat route's
do (a forced call decides over `text.format`, as on OpenAI). The answer becomes a
`response` object (output items: a message with `output_text`, or `function_call`
items, and the `max_output_tokens` it ran under, sluice's default when the request
named none) or, streamed, its typed server-sent events.
Fields sluice does not serve are refused by name.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from gateway.openai_api import OpenAIError, add_metadata, with_answer_format
from schemas import DoneEvent, InferenceRequest

# Fields accepted with only their "not asked for" values.
_ONLY: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "truncation": (None, "disabled", "auto"),
    "service_tier": (None, "auto", "default"),
    # these models do not reason: only "no reasoning" can be honoured
    "reasoning": (None, {}, {"effort": None}, {"effort": "none"},
                  {"effort": None, "summary": None}, {"effort": "none", "summary": None}),
    "include": (None, []), "prompt": (None,), "conversation": (None,),
    "prompt_cache_key": (None,), "safety_identifier": (None,), "top_logprobs": (None, 0),
    "max_tool_calls": (None,), "stream_options": (None,),
}


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    def unserved(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name not in _ONLY:
                raise OpenAIError(400, f"Unrecognized request argument supplied: {name}",
                                  param=name)
            if value not in _ONLY[name]:
                raise OpenAIError(400, f"`{name}` is not supported by sluice", param=name)
        if not self.input and self.previous_response_id is None:
            raise OpenAIError(400, "`input` is required", param="input")
        for name, value in (self.text or {}).items():
            if name != "format" and value is not None:
                raise OpenAIError(400, f"`text.{name}` is not supported by sluice",
                                  param=f"text.{name}")

    def fields(self, earlier: list[dict[str, Any]]) -> dict[str, Any]:
        """The sluice request fields: the conversation (`earlier` messages, then this
        request's input), tools, sampling."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += earlier + input_messages(self.input)
        if not messages:
            raise OpenAIError(400, "the conversation is empty", param="input")
        fields: dict[str, Any] = {"messages": messages}
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.tools:
            fields["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
            if self.tool_choice is not None:
                fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
            if self.parallel_tool_calls is not None:
                fields["parallel_tool_calls"] = self.parallel_tool_calls
        elif self.tool_choice not in (None, "none", "auto"):
            raise OpenAIError(400, "`tool_choice` needs `tools`", param="tool_choice")
        with_answer_format(fields, _response_format((self.text or {}).get("format")),
                           "text.format")
        return add_metadata(fields, self.metadata, self.user)


def input_messages(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as sluice messages: consecutive calls join one assistant message."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            out.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (
                    last.get("tool_calls") or not last.get("content")):
                last.setdefault("tool_calls", []).append(call)
                if not last.get("content"):
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str)
                        else orjson.dumps(output).decode()})
        else:
            raise OpenAIError(400, f"input[{i}]: items of type {kind!r} are not supported "
                              "(messages, function_call and function_call_output are)",
                              param=f"input[{i}].type")
    return out


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise OpenAIError(400, f"input[{index}].role {role!r} is not one of system, developer, "
                          "user, assistant", param=f"input[{index}].role")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise OpenAIError(400, f"input[{index}]: content parts of type {kind!r} are "
                                  "not supported (text only)", param=f"input[{index}].content")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    elif not isinstance(content, str):
        raise OpenAIError(400, f"input[{index}].content must be text",
                          param=f"input[{index}].content")
    return {"role": role, "content": content}


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (`function` nested)."""
    if tool.get("type") != "function":
        raise OpenAIError(400, f"tools[{index}]: tools of type {tool.get('type')!r} are not "
                          "supported (function tools are)", param=f"tools[{index}].type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise OpenAIError(400, "tool_choice must be none, auto, required or "
                              '{"type": "function", "name": ...}', param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict")
                if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise OpenAIError(400, f"text.format {fmt.get('type')!r} is not one of text, json_object, "
                      "json_schema", param="text.format.type")


# ---- the answer ------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_id(response_id: str, kind: str, index: int) -> str:
    digest = hashlib.sha256(f"{response_id}\0{index}".encode()).hexdigest()[:32]
    return f"{kind}_{digest}"


def output_items(response_id: str, done: DoneEvent,
                 with_message: bool = False) -> list[dict[str, Any]]:
    """The answer as output items: the text as a message (with calls, only when there is
    text, or `with_message`: a stream already opened one), then any function calls."""
    items: list[dict[str, Any]] = []
    text = done.content if done.tool_calls else done.text
    if text or with_message or not done.tool_calls:
        items.append(message_item(response_id, text or "", "completed"))
    for call in done.tool_calls or []:
        items.append(call_item(response_id, len(items), call.id, call.function.name,
                               call.function.arguments, "completed"))
    return items


def message_item(response_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id(response_id, "msg", 0), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed" else []}


def call_item(response_id: str, index: int, call_id: str, name: str, arguments: str,
              status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id(response_id, "fc", index),
            "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def conversation_after(messages: list[dict[str, Any]], done: DoneEvent) -> list[dict[str, Any]]:
    """The conversation a later `previous_response_id` continues: this request's messages
    (its instructions left out, as OpenAI does) and the answer."""
    answer: dict[str, Any] = {"role": "assistant",
                              "content": (done.content or None) if done.tool_calls
                              else done.text}
    if done.tool_calls:
        answer["tool_calls"] = [c.model_dump() for c in done.tool_calls]
    kept = messages[1:] if messages and messages[0]["role"] == "system" else messages
    return [*kept, answer]


def applied_max_output_tokens(body: ResponsesBody, done: DoneEvent | None) -> int:
    """The output limit the answer ran under: the request's own, else sluice's default
    (`InferenceRequest.max_tokens`, which the gateway leaves to the request's schema),
    which a worker lowers to the room a long prompt leaves in the context; an answer
    that stopped there (finish `length`, fewer tokens than the default) shows that room."""
    if body.max_output_tokens is not None:
        return body.max_output_tokens
    default: int = InferenceRequest.model_fields["max_tokens"].default
    if done is not None and done.finish_reason == "length":
        return min(default, done.usage.completion_tokens)
    return default


def response_object(response_id: str, body: ResponsesBody, created: int,
                    done: DoneEvent | None, status: str = "completed",
                    with_message: bool = False) -> dict[str, Any]:
    output = output_items(response_id, done, with_message) if done is not None else []
    incomplete = None
    if done is not None and done.finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    usage = None
    if done is not None:
        u = done.usage
        usage = {"input_tokens": u.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                 "output_tokens": u.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u.prompt_tokens + u.completion_tokens}
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "background": False, "error": None, "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": applied_max_output_tokens(body, done),
        "model": body.model, "output": output, "parallel_tool_calls":
        body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "previous_response_id": body.previous_response_id, "reasoning":
        {"effort": None, "summary": None}, "service_tier": "default", "store": body.store,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [], "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": "disabled", "usage": usage, "user": body.user,
        "metadata": body.metadata or {},
    }


class ResponseEvents:
    """The typed server-sent events of one streamed response, numbered in order."""

    def __init__(self, response_id: str, body: ResponsesBody, created: int):
        self.response_id = response_id
        self.body = body
        self.created = created
        self.sequence = 0
        self.text = ""  # of the message item, as streamed
        self.message_open = False

    def event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"

    def started(self) -> list[bytes]:
        shell = response_object(self.response_id, self.body, self.created, None, "in_progress")
        return [self.event("response.created", response=shell),
                self.event("response.in_progress", response=shell)]

    def text_delta(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        out = self._open_message()
        self.text += delta
        out.append(self.event("response.output_text.delta", item_id=self._msg_id(),
                              output_index=0, content_index=0, delta=delta, logprobs=[]))
        return out

    def finished(self, done: DoneEvent) -> list[bytes]:
        out: list[bytes] = []
        items = output_items(self.response_id, done, self.message_open)
        for index, item in enumerate(items):
            if item["type"] == "message":
                final = item["content"][0]["text"]
                out += self._open_message()
                out += self.text_delta(final[len(self.text):] if final.startswith(self.text)
                                       else "")
                part = {"type": "output_text", "text": final, "annotations": []}
                out += [self.event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=final,
                                   logprobs=[]),
                        self.event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=part),
                        self.event("response.output_item.done", output_index=index,
                                   item=item)]
                continue
            opened = {**item, "arguments": "", "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=opened))
            arguments = item["arguments"]
            for start in range(0, len(arguments), 32):
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=index,
                                      delta=arguments[start:start + 32]))
            out += [self.event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, arguments=arguments, name=item["name"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        final = response_object(self.response_id, self.body, self.created, done,
                                with_message=self.message_open)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        out.append(self.event(kind, response=final))
        return out

    def failed(self, error: OpenAIError) -> list[bytes]:
        shell = response_object(self.response_id, self.body, self.created, None, "failed")
        shell["error"] = {"code": error.code or error.type, "message": error.message}
        return [self.event("response.failed", response=shell)]

    def _msg_id(self) -> str:
        return item_id(self.response_id, "msg", 0)

    def _open_message(self) -> list[bytes]:
        if self.message_open:
            return []
        self.message_open = True
        item = message_item(self.response_id, "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", item_id=item["id"],
                           output_index=0, content_index=0, part=part)]


def now() -> int:
    return int(time.time())

