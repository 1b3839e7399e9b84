"""`sluice batch --format openai`: OpenAI Batch API files in and out.

Input lines are OpenAI's batch requests, `{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {<OpenAI request body>}}`,
translated as the gateway translates its requests (`gateway.openai_api`); the
body's `model` is `MODEL` or `MODEL:ADAPTER` and must be the job's model (it
may be left out: the job's `--model`). Output lines are OpenAI's:
`{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id",
"body"} | null, "error": {"code", "message"} | null}`. As OpenAI does, a
request that ran and failed gets a `response` with its status code and an
`{"error": ...}` body; a line that could not be sent (a url, method, model or
body sluice does not serve) gets `response: null` and an `error`, as does a
request whose deadline passed in the queue (`batch_expired`, OpenAI's code for
a request its batch window ran out on). A line counts as answered only with a
200 response; a re-run retries the rest.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from gateway import openai_api as oai
from gateway import openai_errors as errs
from schemas import DoneEvent, ErrorEvent, InferenceRequest, TimeoutEvent
from sluice.batch import LineResult, Send, Terminal, read_lines
from sluice.errors import InvalidRequestError

URLS: dict[str, oai.Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class BatchRequestLine(BaseModel):
    """One input line, past its custom_id (read on its own: a line without one can have
    no output line)."""

    model_config = ConfigDict(extra="ignore")

    method: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A line ready to send."""

    kind: oai.Kind
    model_id: str  # as the line named it (or the job's model): echoed in the answer
    fields: dict[str, Any]  # an InferenceRequest's fields, adapter and session included


@dataclass(frozen=True, slots=True)
class Refused:
    """A line that is not sent; `code` says why (`invalid_url`, `invalid_method`,
    `mismatched_model`, `invalid_request`)."""

    code: str
    message: str


def _problems(exc: pydantic.ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'line'}: {err['msg']}"
                     for err in exc.errors(include_url=False, include_input=False))


def prepare(line: dict[str, Any], model_id: str) -> Prepared | Refused:
    """One input line (a JSON object) as a request of the job's model `model_id`
    (`MODEL` or `MODEL:ADAPTER`, the default for a body without `model`), or why not."""
    try:
        request = BatchRequestLine.model_validate(line)
    except pydantic.ValidationError as exc:
        return Refused("invalid_request", f"invalid batch line: {_problems(exc)}")
    if request.method.upper() != "POST":
        return Refused("invalid_method", f"method {request.method!r} is not served: "
                       "batch requests are POST")
    kind = URLS.get(request.url)
    if kind is None:
        return Refused("invalid_url", f"url {request.url!r} is not served by sluice; "
                       f"use one of {', '.join(URLS)}")
    raw = request.body if request.body.get("model") is not None \
        else {**request.body, "model": model_id}
    body_type = oai.ChatCompletionBody if kind == "chat" else oai.CompletionBody
    try:
        body = body_type.model_validate(raw)
    except pydantic.ValidationError as exc:
        return Refused("invalid_request", f"invalid request body: {_problems(exc)}")
    base, adapter = oai.split_model(body.model)
    if base != oai.split_model(model_id)[0]:
        return Refused("mismatched_model", f"body.model {body.model!r} is not this job's model "
                       f"{oai.split_model(model_id)[0]!r}: a batch runs one model (its adapters "
                       "as MODEL:ADAPTER)")
    try:
        body.unserved()
        if body.stream:  # a batch line gets one whole answer: never pretend to stream
            raise oai.OpenAIError(400, "`stream` is not available in a batch", param="stream")
        fields = body.fields()
    except oai.OpenAIError as exc:
        return Refused("invalid_request", exc.message)
    if adapter is not None:
        fields["adapter"] = adapter
    try:  # the wire's own checks (tools, penalties, ...), before anything is sent
        InferenceRequest.model_validate({**fields, "request_id": "check", "model": base})
    except pydantic.ValidationError as exc:
        return Refused("invalid_request", f"invalid request body: {_problems(exc)}")
    # As the gateway: the turns of one conversation share a key, so a worker's KV cache.
    fields["session_id"] = oai.session_key(body.model, fields, None)
    return Prepared(kind, body.model, fields)


def is_answered(line: dict[str, Any]) -> bool:
    """A 200 response and no error."""
    response = line.get("response")
    return (isinstance(response, dict) and response.get("status_code") == 200
            and line.get("error") is None)


def _line(custom_id: str, response: dict[str, Any] | None,
          error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}


def refused_line(custom_id: str, refused: Refused) -> dict[str, Any]:
    return _line(custom_id, None, {"code": refused.code, "message": refused.message})


def output_line(custom_id: str, prepared: Prepared, event: Terminal) -> dict[str, Any]:
    """The output line of a request that was sent, from its terminal event."""
    if isinstance(event, DoneEvent):
        build = oai.chat_completion if prepared.kind == "chat" else oai.text_completion
        return _line(custom_id, {"status_code": 200, "request_id": event.request_id,
                                 "body": build(event, prepared.model_id, oai.now())}, None)
    if isinstance(event, ErrorEvent):
        error = errs.error_of(event.code.value, event.message,
                              errs.asked_of(prepared.kind, prepared.fields))
        return _line(custom_id, {"status_code": error.status, "request_id": event.request_id,
                                 "body": error.body()}, None)
    assert isinstance(event, TimeoutEvent)
    return _line(custom_id, None, {
        "code": "batch_expired",
        "message": f"request {event.request_id} got no first token within its max_ttft_ms "
                   f"({event.max_ttft_ms} ms; waited {event.waited_ms:.0f} ms)"})


class OpenAIFormat:
    """OpenAI Batch API lines in and out, for one model (`MODEL` or `MODEL:ADAPTER`: the
    default of lines without `body.model`)."""

    errors_hint = "their `error` or `response.body.error`"

    def __init__(self, model_id: str):
        self.model_id = model_id

    def read(self, in_path: Path) -> tuple[list[tuple[str, Any]], list[str]]:
        return read_lines(in_path, lambda line: prepare(line, self.model_id))

    def is_answered(self, line: dict[str, Any]) -> bool:
        return is_answered(line)

    async def answer(self, custom_id: str, item: Any, request_id: str,
                     send: Send) -> LineResult:
        if isinstance(item, Refused):
            return LineResult(refused_line(custom_id, item), False)
        try:
            event = await send(dict(item.fields))
        except InvalidRequestError as exc:  # sluice's own checks of the translated request
            return LineResult(refused_line(custom_id, Refused("invalid_request", str(exc))),
                              False)
        if isinstance(event, DoneEvent):
            return LineResult(output_line(custom_id, item, event), True,
                              event.usage.completion_tokens)
        return LineResult(output_line(custom_id, item, event), False)
