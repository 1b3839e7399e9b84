"""`sluice batch --format openai` without infrastructure: input lines translated to
requests or refused by name, output lines in OpenAI's Batch API shape (checked with the
official `openai` package's types), and which lines a re-run retries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai.types
import openai.types.chat
import orjson
import pytest

from gateway.openai_batch import (
    OpenAIFormat,
    Prepared,
    Refused,
    is_answered,
    output_line,
    prepare,
    refused_line,
)
from schemas import DoneEvent, ErrorCode, ErrorEvent, TimeoutEvent
from sluice.batch import answered_ids, failed_ids

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]


def _line(body: dict[str, Any], url: str = CHAT, method: str = "POST") -> dict[str, Any]:
    return {"custom_id": "c", "method": method, "url": url, "body": body}


def _refused(line: dict[str, Any], model_id: str = "tiny") -> Refused:
    out = prepare(line, model_id)
    assert isinstance(out, Refused), out
    return out


def _done(request_id: str = "batch-x-1", **extra: Any) -> DoneEvent:
    return DoneEvent(request_id=request_id, finish_reason="length", text="Hi there",
                     usage={"prompt_tokens": 7, "cached_prompt_tokens": 2,
                            "completion_tokens": 3},
                     timing={"queue_ms": 1.0, "ttft_ms": 2.0, "total_ms": 3.0},
                     model="tiny", **extra)


def test_chat_line_becomes_the_gateways_request_fields() -> None:
    out = prepare(_line({"model": "tiny", "messages": HELLO, "max_completion_tokens": 5,
                         "temperature": 0, "stop": "\n", "user": "u-1"}), "tiny")
    assert isinstance(out, Prepared) and out.kind == "chat" and out.model_id == "tiny"
    assert out.fields["messages"] == HELLO
    assert out.fields["max_tokens"] == 5 and out.fields["temperature"] == 0
    assert out.fields["stop"] == ["\n"] and out.fields["metadata"] == {"user": "u-1"}
    assert "adapter" not in out.fields and out.fields["session_id"].startswith("oai-")


def test_model_may_be_left_out_and_an_adapter_is_picked_by_model_id() -> None:
    bare = prepare(_line({"messages": HELLO}), "tiny")
    assert isinstance(bare, Prepared) and bare.model_id == "tiny"
    adapted = prepare(_line({"model": "tiny:a0", "messages": HELLO}), "tiny")
    assert isinstance(adapted, Prepared) and adapted.fields["adapter"] == "a0"
    assert adapted.model_id == "tiny:a0"
    # The job's model may name an adapter too: the default of lines without a model.
    default = prepare(_line({"messages": HELLO}), "tiny:a0")
    assert isinstance(default, Prepared) and default.fields["adapter"] == "a0"
    explicit = prepare(_line({"model": "tiny", "messages": HELLO}), "tiny:a0")
    assert isinstance(explicit, Prepared) and "adapter" not in explicit.fields


def test_completion_line_and_list_form_content() -> None:
    out = prepare(_line({"prompt": "Once upon"}, url="/v1/completions"), "tiny")
    assert isinstance(out, Prepared) and out.kind == "completion"
    assert out.fields["prompt"] == "Once upon" and out.fields["max_tokens"] == 16
    ids = prepare(_line({"prompt": [1, 2, 3]}, url="/v1/completions"), "tiny")
    assert isinstance(ids, Prepared) and ids.fields["prompt_token_ids"] == [1, 2, 3]
    parts = prepare(_line({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]}), "tiny")
    assert isinstance(parts, Prepared)
    assert parts.fields["messages"][0]["content"] == [{"type": "text", "text": "hel"},
                                                      {"type": "text", "text": "lo"}]


@pytest.mark.parametrize(("line", "code", "words"), [
    (_line({"input": "x"}, url="/v1/embeddings"), "invalid_url", "/v1/embeddings"),
    (_line({"messages": HELLO}, url="/v1/responses"), "invalid_url", "/v1/responses"),
    (_line({"messages": HELLO}, method="GET"), "invalid_method", "GET"),
    (_line({"model": "gpt-4o", "messages": HELLO}), "mismatched_model", "gpt-4o"),
    (_line({"model": "other:a0", "messages": HELLO}), "mismatched_model", "other:a0"),
    (_line({"messages": HELLO, "n": 3}), "invalid_request", "`n`"),
    (_line({"messages": HELLO, "tools": [{"type": "function"}]}), "invalid_request", "tools"),
    (_line({"messages": HELLO, "tool_choice": "required"}), "invalid_request", "tool_choice"),
    (_line({"messages": HELLO, "logit_bias": {"one": 5}}), "invalid_request", "logit_bias"),
    (_line({"messages": HELLO, "presence_penalty": 3}), "invalid_request",
     "presence_penalty"),
    (_line({"messages": HELLO, "functions": [{"name": "f"}]}), "invalid_request", "tools"),
    (_line({"messages": HELLO, "reasoning_effort": "high"}), "invalid_request",
     "reasoning_effort"),
    (_line({"messages": HELLO, "stream_options": {"include_usage": True}}),
     "invalid_request", "stream_options"),
    (_line({"messages": HELLO, "frobnicate": 1}), "invalid_request", "frobnicate"),
    (_line({"messages": HELLO, "stream": True}), "invalid_request", "stream"),
    (_line({"messages": []}), "invalid_request", "messages"),
    (_line({"prompt": "x"}), "invalid_request", "messages"),  # a completion body on chat
    (_line({"messages": HELLO, "temperature": 5}), "invalid_request", "temperature"),
    (_line({"messages": [{"role": "wizard", "content": "x"}]}), "invalid_request", "wizard"),
    (_line({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
     "invalid_request", "image_url"),
    (_line({"prompt": ["a", "b"]}, url="/v1/completions"), "invalid_request", "several"),
    ({"custom_id": "c", "url": CHAT, "body": {"messages": HELLO}}, "invalid_request", "method"),
    ({"custom_id": "c", "method": "POST", "body": {"messages": HELLO}}, "invalid_request",
     "url"),
    ({"custom_id": "c", "method": "POST", "url": CHAT, "body": "hi"}, "invalid_request",
     "body"),
])
def test_lines_sluice_does_not_serve_are_refused_by_name(line: dict[str, Any], code: str,
                                                         words: str) -> None:
    refused = _refused(line)
    assert refused.code == code and words in refused.message, refused


def test_refused_line_has_no_response_and_an_error() -> None:
    line = refused_line("c-1", Refused("invalid_url", "url '/v1/embeddings' is not served"))
    assert list(line) == ["id", "custom_id", "response", "error"]
    assert line["id"].startswith("batch_req_") and line["custom_id"] == "c-1"
    assert line["response"] is None
    assert line["error"] == {"code": "invalid_url", "message": "url '/v1/embeddings' is not "
                                                               "served"}
    assert not is_answered(orjson.loads(orjson.dumps(line)))


def test_done_becomes_a_200_response_with_openais_objects() -> None:
    chat = prepare(_line({"model": "tiny:a0", "messages": HELLO}), "tiny")
    assert isinstance(chat, Prepared)
    line = orjson.loads(orjson.dumps(output_line("c-1", chat, _done(adapter="a0"))))
    assert line["error"] is None and line["id"].startswith("batch_req_")
    assert line["response"]["status_code"] == 200
    assert line["response"]["request_id"] == "batch-x-1"
    body = openai.types.chat.ChatCompletion.model_validate(line["response"]["body"])
    assert body.choices[0].message.content == "Hi there" and body.model == "tiny:a0"
    assert body.choices[0].finish_reason == "length"
    assert body.usage is not None and body.usage.total_tokens == 10
    assert is_answered(line)

    text = prepare(_line({"prompt": "x"}, url="/v1/completions"), "tiny")
    assert isinstance(text, Prepared)
    line = orjson.loads(orjson.dumps(output_line("c-2", text, _done())))
    completion = openai.types.Completion.model_validate(line["response"]["body"])
    assert completion.object == "text_completion" and completion.choices[0].text == "Hi there"
    assert is_answered(line)


@pytest.mark.parametrize(("code", "status"), [
    (ErrorCode.UNAUTHORIZED, 401), (ErrorCode.UNKNOWN_ADAPTER, 404),
    (ErrorCode.CONTEXT_TOO_LONG, 400), (ErrorCode.OVERLOADED, 429), (ErrorCode.INTERNAL, 500),
])
def test_an_error_event_is_a_response_with_its_status_and_an_error_body(
        code: ErrorCode, status: int) -> None:
    chat = prepare(_line({"messages": HELLO}), "tiny")
    assert isinstance(chat, Prepared)
    event = ErrorEvent(request_id="batch-x-2", code=code, message="no way")
    line = output_line("c-3", chat, event)
    assert line["error"] is None
    assert line["response"]["status_code"] == status
    assert line["response"]["request_id"] == "batch-x-2"
    error = line["response"]["body"]["error"]
    # OpenAI's name for a context overflow, which clients look for to trim and retry
    expected = "context_length_exceeded" if code == ErrorCode.CONTEXT_TOO_LONG else code.value
    assert error["code"] == expected and error["message"].endswith("no way") and error["type"]
    if code == ErrorCode.CONTEXT_TOO_LONG:  # in OpenAI's words, naming the field sent
        assert error["message"].startswith("This model's maximum context length is")
        assert error["param"] == "messages"
    assert not is_answered(line)


def test_a_queue_timeout_is_openais_batch_expired() -> None:
    chat = prepare(_line({"messages": HELLO}), "tiny")
    assert isinstance(chat, Prepared)
    line = output_line("c-4", chat, TimeoutEvent(request_id="batch-x-3", waited_ms=61000,
                                                 max_ttft_ms=60000))
    assert line["response"] is None and line["error"]["code"] == "batch_expired"
    assert "60000" in line["error"]["message"]
    assert not is_answered(line)


def test_a_rerun_retries_every_line_without_a_200_response(tmp_path: Path) -> None:
    chat = prepare(_line({"messages": HELLO}), "tiny")
    assert isinstance(chat, Prepared)
    lines = [
        output_line("ok", chat, _done()),
        output_line("denied", chat, ErrorEvent(request_id="r", code=ErrorCode.UNAUTHORIZED,
                                               message="no")),
        refused_line("refused", Refused("invalid_url", "no")),
    ]
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    assert answered_ids(out, is_answered=is_answered) == {"ok"}
    assert failed_ids(out, is_answered=is_answered) == {"denied", "refused"}
    # The sluice format's rule (any response) would call the 401 answered.
    assert answered_ids(out) == {"ok", "denied"}


def test_reading_a_file_keeps_refusals_as_lines_and_drops_unreadable_ones(
        tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    rows = [_line({"messages": HELLO}) | {"custom_id": "a"},
            _line({"input": "x"}, url="/v1/embeddings") | {"custom_id": "b"},
            _line({"messages": HELLO}) | {"custom_id": "a"}]
    src.write_bytes(b"\n".join(orjson.dumps(r) for r in rows)
                    + b'\nnot json\n{"method": "POST"}\n[1]\n\n')
    items, problems = OpenAIFormat("tiny").read(src)
    assert [cid for cid, _ in items] == ["a", "b"]
    assert isinstance(items[0][1], Prepared) and isinstance(items[1][1], Refused)
    assert [p.split(":")[0] for p in problems] == ["line 3", "line 4", "line 5", "line 6"]
    assert "duplicate custom_id" in problems[0]
