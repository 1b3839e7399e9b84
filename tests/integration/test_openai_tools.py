"""Tool calling, the Responses API and stop strings through `sluice gateway`, with the
official `openai` client, on SmolLM2-135M-Instruct through Kafka.

One gateway and one worker serve the module. Forced calls (a named function,
`required`) must parse and fit the function's schema even from a 135M model; `auto`
answers in text or a valid call; a streamed call's deltas add up to the same call; a
`tool` message round trip is answered; the Responses API answers plain, streamed
(typed events), as JSON fitting a schema, with a function tool and its output, and
continues `previous_response_id` on the worker holding its KV cache, and reports the
default output limit it ran under; stop strings are cut from texts and deltas alike. A
context overflow reaches the openai client, langchain-openai and litellm as each one's
context-window error.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

import sluice
from common.settings import Settings
from tests.integration.pipeline_helpers import drop_schema, served_gateway, worker_process
from tests.real_model import smollm2_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": WEATHER_ARGS}}, {"type": "function", "function": {
        "name": "get_time", "description": "The time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                       "required": ["timezone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Served:
    def __init__(self, api: openai.AsyncOpenAI, port: int, key: str):
        self.api = api
        self.port = port
        self.key = key


@pytest.fixture(scope="module")
async def served(endpoints, tmp_path_factory) -> AsyncIterator[Served]:
    name = f"t_tools_{uuid.uuid4().hex[:8]}"
    settings = Settings(kafka_bootstrap=endpoints.kafka_bootstrap,
                        database_url=endpoints.database_url, db_schema=name, topic_prefix=name,
                        request_partitions=2, kafka=endpoints.kafka_settings())
    client = sluice.Client(settings)
    client.models.register(model="smol", path=str(smollm2_dir()),
                           compute_config={"kv_cache_len": 8192})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="smol")
    client.close()
    try:
        async with served_gateway(settings, key, "tools", timeout_s=180) as (api, port):
            with worker_process(settings, "smol", tmp_path_factory.mktemp("tools")) as worker:
                worker.wait_for_log("serving smol as", 120)
                yield Served(api, port, key)
    finally:
        await drop_schema(settings)


def _fits(call: Any) -> dict[str, Any]:
    """A call's arguments, checked against its function's schema."""
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema[call.function.name])
    return args


async def test_a_named_function_is_called_with_arguments_that_fit(served: Served) -> None:
    answer = await served.api.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, temperature=0, max_completion_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(_fits(call)) <= {"city", "unit"}


async def test_required_and_auto_answer_in_calls_or_text(served: Served) -> None:
    forced = await served.api.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_completion_tokens=120)
    assert forced.choices[0].finish_reason == "tool_calls"
    assert all(_fits(c) is not None for c in forced.choices[0].message.tool_calls)
    free = await served.api.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, temperature=0, max_completion_tokens=60)
    message = free.choices[0].message
    if message.tool_calls:  # the model chose to call: then it is a valid call
        assert free.choices[0].finish_reason == "tool_calls"
        assert all(_fits(c) is not None for c in message.tool_calls)
    else:
        assert isinstance(message.content, str) and "<tool_call>" not in message.content


async def test_a_streamed_call_adds_up_to_the_same_call(served: Served) -> None:
    args = {"model": "smol", "messages": ASK, "tools": TOOLS, "temperature": 0,
            "max_completion_tokens": 120,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = (await served.api.chat.completions.create(**args)).choices[0].message.tool_calls[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in await served.api.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                call["name"] += (piece.function.name or "") if piece.function else ""
                call["arguments"] += (piece.function.arguments or "") if piece.function else ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)


async def test_a_tool_result_round_trip(served: Served) -> None:
    first = await served.api.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_completion_tokens=120)
    message = first.choices[0].message
    call = message.tool_calls[0]
    follow = [*ASK, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id,
               "content": json.dumps({"temperature_c": 18, "sky": "clear"})}]
    answer = await served.api.chat.completions.create(
        model="smol", messages=follow, tools=TOOLS, temperature=0, max_completion_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


async def test_stop_strings_are_cut_from_text_and_deltas(served: Served) -> None:
    ask = {"model": "smol", "temperature": 0, "max_completion_tokens": 16,
           "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    text = (await served.api.chat.completions.create(**ask)).choices[0].message.content
    assert "Paris" in text, text  # what the cases below cut
    for stop in (" is", " Paris", "Par", "aris"):  # across tokens, inside one, ...
        cut = await served.api.chat.completions.create(**ask, stop=[stop])
        assert cut.choices[0].message.content == text[:text.index(stop)], stop
        assert cut.choices[0].finish_reason == "stop"
        pieces = [c.choices[0].delta.content or "" async for c in
                  await served.api.chat.completions.create(**ask, stop=[stop], stream=True)
                  if c.choices]
        assert "".join(pieces) == text[:text.index(stop)], (stop, pieces)


async def test_the_responses_api(served: Served) -> None:
    api = served.api
    first = await api.responses.create(model="smol", input="What is the capital of France?",
                                       max_output_tokens=40, temperature=0)
    assert first.status == "completed" and first.output_text
    second = await api.responses.create(model="smol", input="And the capital of Germany?",
                                        previous_response_id=first.id, max_output_tokens=40,
                                        temperature=0)
    assert second.usage.input_tokens_details.cached_tokens > 0  # the same worker's cache
    assert (await api.responses.retrieve(second.id)).output_text == second.output_text

    async with api.responses.stream(model="smol", input="Say hello.", temperature=0,
                                    max_output_tokens=200) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert final.output_text

    shaped = await api.responses.create(
        model="smol", input="A city and its country.", temperature=0, max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "place", "schema": {
            "type": "object", "properties": {"city": {"type": "string"},
                                             "country": {"type": "string"}},
            "required": ["city", "country"], "additionalProperties": False}}})
    assert set(json.loads(shaped.output_text)) == {"city", "country"}

    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    asked = await api.responses.create(model="smol", input="Weather in Paris?", tools=tools,
                                       tool_choice="required", temperature=0,
                                       max_output_tokens=120, store=True)
    call = next(o for o in asked.output if o.type == "function_call")
    assert call.name in {"get_weather", "get_time"} and json.loads(call.arguments)
    answered = await api.responses.create(
        model="smol", previous_response_id=asked.id, tools=tools, temperature=0,
        max_output_tokens=30, input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": "18 C and clear"}])
    assert answered.status in ("completed", "incomplete")
    assert answered.usage.input_tokens_details.cached_tokens > 0

    unkept = await api.responses.create(model="smol", input="hi", store=False,
                                        max_output_tokens=5)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(unkept.id)


async def test_routes_and_errors_are_openais(served: Served) -> None:
    api = served.api
    with pytest.raises(openai.BadRequestError) as too_long:
        await api.chat.completions.create(model="smol", messages=ASK, max_tokens=100_000)
    assert too_long.value.code == "context_length_exceeded"
    assert "100000" in str(too_long.value)
    with pytest.raises(openai.BadRequestError) as orphan:
        await api.chat.completions.create(model="smol", messages=ASK,
                                          stream_options={"include_usage": True})
    assert orphan.value.param == "stream_options"
    with pytest.raises(openai.NotFoundError, match="not embeddings"):
        await api.embeddings.create(model="smol", input="x")
    raw = await api.chat.completions.with_raw_response.create(
        model="smol", messages=ASK, max_completion_tokens=2)
    assert raw.headers.get("x-request-id")
    status, body = await asyncio.to_thread(_get, served.port, "/v1/nowhere")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- the default paths of the clients people use ----------------------------------------


class Person(BaseModel):
    """A person extracted from text."""

    name: str
    age: int


async def test_instructor_in_its_default_mode(served: Served) -> None:
    import instructor

    client = instructor.from_openai(openai.AsyncOpenAI(
        base_url=served.api.base_url, api_key=served.key, max_retries=0))  # Mode.TOOLS
    person = await client.chat.completions.create(
        model="smol", response_model=Person, max_retries=0,
        messages=[{"role": "user", "content": "Alice is 30 years old."}])
    assert isinstance(person, Person) and (person.name, person.age) == ("Alice", 30)


async def test_instructor_in_its_responses_tools_mode(served: Served) -> None:
    """`Mode.RESPONSES_TOOLS` sends a named tool_choice and a `text.format` of the same
    schema: the forced call decides, as on OpenAI."""
    import instructor

    client = instructor.from_openai(openai.AsyncOpenAI(
        base_url=served.api.base_url, api_key=served.key, max_retries=0),
        mode=instructor.Mode.RESPONSES_TOOLS)
    person = await client.chat.completions.create(
        model="smol", response_model=Person, max_retries=0,
        messages=[{"role": "user", "content": "Alice is 30 years old."}])
    assert isinstance(person, Person) and (person.name, person.age) == ("Alice", 30)
    # A format and tools with tool_choice auto (a call or the format, the model's choice)
    # is refused by name: one grammar constrains an answer.
    with pytest.raises(openai.BadRequestError) as refused:
        await served.api.responses.create(
            model="smol", input="Alice is 30 years old.", max_output_tokens=40,
            tools=[{"type": "function", "name": "Person",
                    "parameters": Person.model_json_schema()}],
            text={"format": {"type": "json_schema", "name": "Person",
                             "schema": Person.model_json_schema()}})
    assert refused.value.param == "text.format"


async def test_a_context_overflow_is_openais_on_every_route(served: Served) -> None:
    """OpenAI's words, code, type, and `param` naming the field each route was sent."""
    api = served.api
    fits = await api.chat.completions.create(model="smol", messages=ASK,
                                             max_completion_tokens=1)
    prompt = fits.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as chat:
        await api.chat.completions.create(model="smol", messages=ASK, max_tokens=100_000)
    assert (chat.value.code, chat.value.param, chat.value.type) == (
        "context_length_exceeded", "messages", "invalid_request_error")
    assert chat.value.body["message"] == (
        f"This model's maximum context length is 8192 tokens. However, you requested "
        f"{prompt + 100_000} tokens ({prompt} in the messages, 100000 in the completion). "
        "Please reduce the length of the messages or completion.")
    with pytest.raises(openai.BadRequestError) as legacy:
        await api.completions.create(model="smol", prompt="Once upon a time",
                                     max_tokens=100_000)
    assert (legacy.value.code, legacy.value.param) == ("context_length_exceeded", "prompt")
    assert legacy.value.body["message"].startswith(
        "This model's maximum context length is 8192 tokens, however you requested ")
    with pytest.raises(openai.BadRequestError) as responses:
        await api.responses.create(model="smol", input="hi", max_output_tokens=100_000)
    assert (responses.value.code, responses.value.param) == ("context_length_exceeded",
                                                             "input")
    with pytest.raises(openai.BadRequestError) as alone:  # the prompt alone is too long
        await api.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "word " * 9000}])
    assert alone.value.code == "context_length_exceeded" and re.fullmatch(
        r"This model's maximum context length is 8192 tokens\. However, your messages "
        r"resulted in \d+ tokens\. Please reduce the length of the messages\.",
        alone.value.body["message"])


async def test_a_context_overflow_is_langchains_and_litellms_context_error(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI
    from langchain_openai.chat_models.base import OpenAIContextOverflowError

    base = {"model": "smol", "base_url": str(served.api.base_url), "api_key": served.key,
            "max_retries": 0, "max_tokens": 100_000}
    for llm in (ChatOpenAI(**base), ChatOpenAI(**base, use_responses_api=True)):
        with pytest.raises(OpenAIContextOverflowError) as caught:
            await llm.ainvoke("What is the weather in Paris?")
        assert isinstance(caught.value, ContextOverflowError)

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    import litellm

    for ask in ({"messages": ASK, "max_tokens": 100_000},
                {"messages": [{"role": "user", "content": "word " * 9000}]}):
        with pytest.raises(litellm.ContextWindowExceededError):
            await asyncio.to_thread(litellm.completion, model="openai/smol",
                                    api_base=str(served.api.base_url), api_key=served.key,
                                    num_retries=0, **ask)


async def test_a_responses_answer_cut_at_the_default_limit_reports_it(served: Served) -> None:
    """No `max_output_tokens`: the answer runs under sluice's default, 256, and says so."""
    answer = await served.api.responses.create(
        model="smol", temperature=0,
        input="Write a very long story about a dragon, at least 1000 words.")
    assert answer.status == "incomplete" and answer.incomplete_details.reason == \
        "max_output_tokens"
    assert answer.usage.output_tokens == 256 and answer.max_output_tokens == 256
    assert (await served.api.responses.retrieve(answer.id)).max_output_tokens == 256


async def test_pydantic_ai_with_a_structured_output_and_a_tool(served: Served) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    provider = OpenAIProvider(base_url=str(served.api.base_url), api_key=served.key)
    calls: list[str] = []
    for model in (OpenAIResponsesModel, OpenAIChatModel):  # the "openai:" default, chat
        agent = Agent(model("smol", provider=provider), output_type=Person)

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Get the weather for a city."""
            calls.append(city)
            return f"sunny in {city}"

        result = await agent.run("What's the weather in Paris? Then give me a person.",
                                 usage_limits=UsageLimits(request_limit=6))
        assert isinstance(result.output, Person), result.output
        assert all(isinstance(c, str) for c in calls)


async def test_langchain_tools_and_structured_output(served: Served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        return "sunny, 21C"

    base = {"model": "smol", "base_url": str(served.api.base_url), "api_key": served.key,
            "temperature": 0, "max_retries": 0}
    for llm in (ChatOpenAI(**base), ChatOpenAI(**base, use_responses_api=True)):
        bound = await llm.bind_tools([get_weather]).ainvoke("What's the weather in Paris?")
        assert bound.content  # the model chose text; a call would parse into tool_calls
        assert all(c["name"] == "get_weather" and "city" in c["args"]
                   for c in bound.tool_calls)
        forced = await llm.bind_tools([get_weather], tool_choice="get_weather").ainvoke(
            "What's the weather in Paris?")
        (call,) = forced.tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    chat = ChatOpenAI(**base)
    for method in ("function_calling", "json_schema"):  # the latter is the default
        person = await chat.with_structured_output(Person, method=method).ainvoke(
            "Alice is 30 years old.")
        assert person == Person(name="Alice", age=30), method


async def test_openai_agents_on_its_default_responses_model(served: Served) -> None:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    set_default_openai_client(openai.AsyncOpenAI(base_url=served.api.base_url,
                                                 api_key=served.key, max_retries=0))
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        asked.append(city)
        return f"sunny in {city}"

    helper = Agent(name="helper", instructions="You are helpful.", tools=[get_weather],
                   model="smol")
    answered = await Runner.run(helper, "What is the capital of France?", max_turns=3)
    assert "Paris" in answered.final_output
    caller = Agent(name="caller", instructions="You are helpful.", tools=[get_weather],
                   model="smol", model_settings=ModelSettings(tool_choice="required"),
                   tool_use_behavior="stop_on_first_tool")
    called = await Runner.run(caller, "What's the weather in Paris?", max_turns=3)
    assert asked and called.final_output == f"sunny in {asked[0]}"
