"""The gateway's translation, exactly: a forced tool call beside a JSON format, a context
overflow in OpenAI's words (from the worker's own messages), and the output limit a
Responses answer reports."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from batcher.config import BatcherConfig
from batcher.scheduler import Scheduler
from batcher.types import Failed
from gateway import openai_api as oai
from gateway import openai_errors as errs
from gateway import responses_api as rapi
from gpu_runtime import ContextTooLongError
from schemas import DoneEvent, ErrorCode, InferenceRequest
from tests.runtime_support import greedy, make_hf_checkpoint, make_runtime
from tests.unit.batcher.fake_runtime import FakeRuntime, SimClock
from tests.unit.batcher.sim import make_request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}},
          "required": ["name"]}
CHAT_TOOL = {"type": "function", "function": {"name": "Person", "parameters": SCHEMA}}
NAMED_CHAT = {"type": "function", "function": {"name": "Person"}}
RESPONSES_TOOL = {"type": "function", "name": "Person", "parameters": SCHEMA}
TEXT_FORMAT = {"format": {"type": "json_schema", "name": "Person", "schema": SCHEMA,
                          "strict": True}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "Person", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Alice is 30."}]


def _wire(fields: dict[str, Any]) -> InferenceRequest:
    """The fields as the SDK sends them: the wire schema must take them."""
    return InferenceRequest.model_validate({**fields, "request_id": "r", "model": "m"})


def _responses(**body: Any) -> dict[str, Any]:
    parsed = rapi.ResponsesBody.model_validate({"model": "m", "input": "Alice is 30.", **body})
    parsed.unserved()
    return parsed.fields([])


def _chat(**body: Any) -> dict[str, Any]:
    parsed = oai.ChatCompletionBody.model_validate({"model": "m", "messages": ASK, **body})
    parsed.unserved()
    return parsed.fields()


# ---- a JSON format beside tools ----------------------------------------------------------


@pytest.mark.parametrize("choice", [{"type": "function", "name": "Person"}, "required"])
def test_a_forced_call_decides_over_text_format(choice: Any) -> None:
    """instructor's Mode.RESPONSES_TOOLS: a named tool_choice and a text.format of the
    same schema. The call is the answer; the format is not sent on."""
    fields = _responses(tools=[RESPONSES_TOOL], tool_choice=choice, text=TEXT_FORMAT)
    assert "response_format" not in fields
    sent = _wire(fields)
    assert sent.calls_tools and sent.response_format is None
    wanted = {"type": "function", "function": {"name": "Person"}} if isinstance(
        choice, dict) else choice
    assert fields["tool_choice"] == wanted


@pytest.mark.parametrize("choice", [NAMED_CHAT, "required"])
def test_a_forced_call_decides_over_response_format_on_chat(choice: Any) -> None:
    fields = _chat(tools=[CHAT_TOOL], tool_choice=choice, response_format=RESPONSE_FORMAT)
    assert "response_format" not in fields and fields["tool_choice"] == choice
    _wire(fields)


def test_tool_choice_none_or_no_tools_leave_the_format_to_the_answer() -> None:
    for fields in (_responses(tools=[RESPONSES_TOOL], tool_choice="none", text=TEXT_FORMAT),
                   _responses(text=TEXT_FORMAT), _responses(tool_choice="auto",
                                                            text=TEXT_FORMAT),
                   _chat(tools=[CHAT_TOOL], tool_choice="none",
                         response_format=RESPONSE_FORMAT)):
        assert fields["response_format"]["type"] == "json_schema"
        assert _wire(fields).response_format is not None


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_with_a_format_is_refused_by_name(choice: str | None) -> None:
    """A call or the format, the model's choice: one grammar cannot say both."""
    with pytest.raises(oai.OpenAIError) as refused:
        _responses(tools=[RESPONSES_TOOL], tool_choice=choice, text=TEXT_FORMAT)
    assert refused.value.status == 400 and refused.value.param == "text.format"
    assert "tool_choice required" in refused.value.message
    with pytest.raises(oai.OpenAIError) as refused:
        _chat(tools=[CHAT_TOOL], tool_choice=choice, response_format=RESPONSE_FORMAT)
    assert refused.value.param == "response_format"


def test_a_text_format_of_type_text_constrains_nothing() -> None:
    fields = _responses(tools=[RESPONSES_TOOL], text={"format": {"type": "text"}})
    assert "response_format" not in fields and _wire(fields).calls_tools


# ---- a context overflow in OpenAI's words ------------------------------------------------


@pytest.fixture(scope="module")
def overflows(tmp_path_factory) -> dict[str, str]:
    """The worker's own context_too_long messages: the runtime's (prompt and max_tokens
    past the context; a prompt alone past it) and the batcher's (past the KV cache)."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp("overflow"), seed=5)[0]
    rt = make_runtime(path, max_model_len=40)
    out = {}
    with pytest.raises(ContextTooLongError) as both:
        rt.add_sequence("a", list(range(3, 33)), greedy(100))
    out["with_completion"] = str(both.value)
    with pytest.raises(ContextTooLongError) as prompt:
        rt.add_sequence("b", list(range(3, 53)), dataclasses.replace(
            greedy(100), max_tokens_asked=False))
    out["prompt_alone"] = str(prompt.value)
    clock = SimClock()
    fake = FakeRuntime(num_blocks=8, block_size=4, clock=clock)
    sched = Scheduler(fake, BatcherConfig(), clock=clock)  # type: ignore[arg-type]
    sched.submit(make_request("big", list(range(1, 41)), arrival=clock.now))
    (failed,) = [e for e in sched.schedule().events if isinstance(e, Failed)]
    assert failed.code == ErrorCode.CONTEXT_TOO_LONG
    out["cache"] = failed.message
    return out


def test_an_overflow_with_its_completion_is_openais_sentence(overflows: dict[str, str]) -> None:
    error = errs.error_of("context_too_long", overflows["with_completion"],
                          errs.Asked("messages", 100))
    assert (error.status, error.type, error.code, error.param) == (
        400, "invalid_request_error", "context_length_exceeded", "messages")
    assert error.message == (
        "This model's maximum context length is 40 tokens. However, you requested 130 "
        "tokens (30 in the messages, 100 in the completion). Please reduce the length of "
        "the messages or completion.")
    assert error.body()["error"]["code"] == "context_length_exceeded"


def test_a_prompt_alone_past_the_context(overflows: dict[str, str]) -> None:
    """Without max_tokens asked, OpenAI's sentence for messages alone; with it, the
    completion the request asked for (the worker names only the prompt)."""
    alone = errs.error_of("context_too_long", overflows["prompt_alone"], errs.CHAT_ASKED)
    assert alone.message == (
        "This model's maximum context length is 40 tokens. However, your messages resulted "
        "in 50 tokens. Please reduce the length of the messages.")
    asked = errs.error_of("context_too_long", overflows["prompt_alone"],
                          errs.Asked("input", 20))
    assert asked.param == "input" and asked.message == (
        "This model's maximum context length is 40 tokens. However, you requested 70 tokens "
        "(50 in the messages, 20 in the completion). Please reduce the length of the "
        "messages or completion.")
    cache = errs.error_of("context_too_long", overflows["cache"], errs.Asked("messages", 4))
    assert cache.message.startswith("This model's maximum context length is 32 tokens. "
                                    "However, you requested 44 tokens (40 in the messages")


def test_an_overflow_on_completions_names_prompt(overflows: dict[str, str]) -> None:
    fields = oai.CompletionBody.model_validate({"model": "m", "prompt": "x"}).fields()
    error = errs.error_of("context_too_long", overflows["prompt_alone"],
                          errs.asked_of("completion", fields))
    assert error.param == "prompt" and error.code == "context_length_exceeded"
    assert error.message == (  # the legacy route's own wording, its default 16 tokens
        "This model's maximum context length is 40 tokens, however you requested 66 tokens "
        "(50 in your prompt; 16 for the completion). Please reduce your prompt; or "
        "completion length.")


def test_each_route_names_the_field_it_was_sent() -> None:
    assert errs.asked_of("chat", _chat(max_completion_tokens=9)) == errs.Asked("messages", 9)
    assert errs.asked_of("responses", _responses()) == errs.Asked("input", None)
    assert errs.asked_of("responses", _responses(max_output_tokens=7)) == errs.Asked("input", 7)


def test_an_overflow_of_another_shape_keeps_openais_opening() -> None:
    error = errs.error_of("context_too_long", "too big", errs.CHAT_ASKED)
    assert error.message == "This model's maximum context length is smaller than this " \
                            "request: too big"
    assert errs.error_of("overloaded", "busy").message == "busy"


# ---- the output limit a Responses answer reports -----------------------------------------


def _done(finish: str, completion_tokens: int) -> DoneEvent:
    return DoneEvent(request_id="r", finish_reason=finish, text="x", model="m",
                     usage={"prompt_tokens": 5, "cached_prompt_tokens": 0,
                            "completion_tokens": completion_tokens},
                     timing={"queue_ms": 0, "ttft_ms": 1, "total_ms": 2})


def test_a_responses_answer_reports_the_output_limit_applied() -> None:
    default = InferenceRequest.model_fields["max_tokens"].default
    assert default == 256
    body = rapi.ResponsesBody.model_validate({"model": "m", "input": "hi"})
    cut = rapi.response_object("resp_1", body, 0, _done("length", default))
    assert cut["status"] == "incomplete" and cut["max_output_tokens"] == default
    assert rapi.response_object("resp_1", body, 0, None, "in_progress")[
        "max_output_tokens"] == default
    # Cut short by the context's room (a long prompt): that room was the limit.
    assert rapi.response_object("resp_1", body, 0, _done("length", 40))[
        "max_output_tokens"] == 40
    assert rapi.response_object("resp_1", body, 0, _done("stop", 3))[
        "max_output_tokens"] == default
    asked = rapi.ResponsesBody.model_validate({"model": "m", "input": "hi",
                                               "max_output_tokens": 12})
    assert rapi.response_object("resp_1", asked, 0, _done("length", 12))[
        "max_output_tokens"] == 12


def test_a_batch_lines_overflow_names_the_field_it_sent(overflows: dict[str, str]) -> None:
    from gateway.openai_batch import Prepared, output_line, prepare
    from schemas import ErrorEvent

    event = ErrorEvent(request_id="b-1", code=ErrorCode.CONTEXT_TOO_LONG,
                       message=overflows["with_completion"])
    for url, body, param in (("/v1/completions", {"prompt": "x"}, "prompt"),
                             ("/v1/chat/completions", {"messages": ASK}, "messages")):
        prepared = prepare({"custom_id": "c", "method": "POST", "url": url, "body": body}, "m")
        assert isinstance(prepared, Prepared)
        error = output_line("c", prepared, event)["response"]["body"]["error"]
        assert error["param"] == param and error["code"] == "context_length_exceeded"
        assert error["message"].startswith("This model's maximum context length is 40 tokens")
