"""`gateway`: what the OpenAI-compatible HTTP gateway adds on top of the SDK.

The same text prompts, one request at a time, alternating request by request
between two paths to the same worker (the served model of `kafka`/`bulk`):

- the SDK: `Client.stream(prompt=...)` straight onto the request topic;
- `sluice gateway` (`gateway.app.serve`, started in this process on a free
  loopback port) called with the official `openai` client: `AsyncOpenAI
  .completions.create(prompt=..., stream=True)`, i.e. `POST /v1/completions`.

TTFT is the time to the first piece of text on both paths (the SDK's first
token event with non-empty text; the gateway's first chunk with non-empty
`text`: it sends no chunk for a token whose text is still empty), end to end
the time to the SDK's `done` event / the gateway's chunk carrying
`finish_reason`. Which path goes first alternates with every prompt, so a
prompt's second request (whose prompt blocks the KV cache may already hold)
is the SDK's half the time and the gateway's the other half. What the gateway
adds = gateway minus SDK, at p50 and p99, and the percentiles of the
per-prompt differences (each pair ran back to back). The time to the
gateway's response headers (sent once the request's first event is back)
splits the way in from the way out. The floor: an HTTP round trip to
the gateway's `GET /health` on a kept-alive connection (the `openai` client's
own HTTP client), in the same process and event loop.

Then the same without streaming: `Client.complete` vs
`completions.create(stream=False)`, fewer requests.

Then tool calls: `chat.completions.create` with one function tool and
`tool_choice: "required"` (the call forced by its grammar, its arguments fitting
the function's schema) beside the same messages without tools, alternating
request by request. Both end-to-end latency and the time per output token are
reported (a forced call ends when its JSON closes, a plain answer at
`max_tokens`), the first call's extra (its grammar compiled, then cached), and
every call is parsed: its `arguments` must be JSON that fits the schema.

Everything (worker, SDK, gateway, `openai` client) shares one process and one
event loop, as in `kafka`: on a machine with few cores the gateway's parsing
and serialising compete with the worker for the same thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from bench.harness import figure, goal, latency_figures, percentile, ratio
from bench.kafka import added_figures, added_ms
from bench.served import MODEL, Served
from infra.common import free_port
from schemas import DoneEvent, TokenEvent

_WORDS = (
    "requests", "arrive", "on", "kafka", "topics", "are", "batched", "by", "deadline", "and",
    "run", "the", "model", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "tokens",
    "stream", "back", "to", "reply", "topic", "a", "session", "keeps", "its", "kv", "cache",
    "so", "second", "turn", "of", "chat", "computes", "only", "new", "hello", "world", "how",
    "you", "today", "i", "am", "fine", "thank", "what", "is", "weather", "like", "adapters",
    "share", "one", "base", "mixes", "them", "in", "step",
)
GOAL_ADDED_TTFT_P50_MS = 5.0


def _prompts(count: int, seed: int) -> list[str]:
    """Text prompts of 8-24 words from the tiny tokenizer's corpus (~20-60 tokens)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 24))).capitalize() + "."
            for _ in range(count)]


@contextlib.asynccontextmanager
async def running_gateway(served: Served) -> AsyncIterator[str]:
    """`sluice gateway` in this event loop on a free loopback port; yields its base URL."""
    from gateway.app import serve

    port = free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(serve(served.settings, "127.0.0.1", port,
                                     f"bench-{uuid.uuid4().hex[:8]}", ready=ready))
    try:
        waiter = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({waiter, task}, timeout=60,
                                     return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            if task.done():
                task.result()  # raises the gateway's own error
            raise RuntimeError("the gateway did not start within 60 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _sdk_stream(served: Served, rid: str, prompt: str,
                      max_tokens: int) -> tuple[float, float, str, int]:
    """(TTFT ms, end-to-end ms, text, cached prompt tokens) via `Client.stream`."""
    start = time.perf_counter()
    first = None
    async for event in served.client.stream(model=MODEL, api_key=served.api_key,
                                            request_id=rid, prompt=prompt,
                                            max_tokens=max_tokens, temperature=0.0):
        if isinstance(event, TokenEvent):
            if event.text and first is None:
                first = time.perf_counter()
        elif isinstance(event, DoneEvent):
            end = time.perf_counter()
            return (((first or end) - start) * 1000, (end - start) * 1000, event.text,
                    event.usage.cached_prompt_tokens)
        else:
            raise RuntimeError(f"request {rid} ended with {event!r}")
    raise RuntimeError(f"request {rid}: the reply stream ended early")


async def _gateway_stream(api: Any, prompt: str,
                          max_tokens: int) -> tuple[float, float, str, int, float]:
    """(TTFT ms, end-to-end ms, text, cached prompt tokens, ms to the response headers)
    via the gateway, streamed. The gateway answers with headers once the request's first
    event is back from the worker, so the headers split the request's way in from the
    chunks' way out."""
    start = time.perf_counter()
    first = end = None
    pieces: list[str] = []
    cached = 0
    stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True})
    headers = time.perf_counter()
    async for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.text:
                first = first or time.perf_counter()
                pieces.append(choice.text)
            if choice.finish_reason is not None:
                end = time.perf_counter()
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    if end is None:
        raise RuntimeError("the gateway's stream ended without a finish_reason")
    return (((first or end) - start) * 1000, (end - start) * 1000, "".join(pieces), cached,
            (headers - start) * 1000)


async def _sdk_complete(served: Served, rid: str, prompt: str, max_tokens: int) -> float:
    start = time.perf_counter()
    await served.client.complete(model=MODEL, api_key=served.api_key, request_id=rid,
                                 prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    return (time.perf_counter() - start) * 1000


async def _gateway_complete(api: Any, prompt: str, max_tokens: int) -> float:
    start = time.perf_counter()
    answer = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0)
    if not answer.choices:
        raise RuntimeError("the gateway's completion has no choices")
    return (time.perf_counter() - start) * 1000


# The forced call's function: a short enum and a bounded string, so the tiny model's
# arguments end within max_tokens.
_WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}


async def _chat(api: Any, prompt: str, max_tokens: int,
                tools: bool) -> tuple[float, int, str | None]:
    """(end-to-end ms, completion tokens, a problem with the call or None) of one chat
    completion, with the forced tool call or without tools."""
    extra: dict[str, Any] = ({"tools": [_WEATHER_TOOL], "tool_choice": "required"}
                             if tools else {})
    start = time.perf_counter()
    answer = await api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, **extra)
    elapsed = (time.perf_counter() - start) * 1000
    tokens = answer.usage.completion_tokens if answer.usage else 0
    if not tools:
        return elapsed, tokens, None
    choice = answer.choices[0]
    calls = choice.message.tool_calls or []
    if choice.finish_reason != "tool_calls" or len(calls) != 1:
        return elapsed, tokens, f"finish_reason {choice.finish_reason}, {len(calls)} calls"
    try:
        arguments = orjson.loads(calls[0].function.arguments)
    except orjson.JSONDecodeError as exc:
        return elapsed, tokens, f"arguments are not JSON: {exc}"
    if (calls[0].function.name != "get_weather" or set(arguments) != {"city", "unit"}
            or arguments["unit"] not in ("c", "f") or not isinstance(arguments["city"], str)
            or len(arguments["city"]) > 12):
        return elapsed, tokens, f"the call does not fit the schema: {arguments}"
    return elapsed, tokens, None


async def _tool_calls(api: Any, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    first_call, _, problem = await _chat(api, prompts[0], max_tokens, tools=True)
    if problem is not None:
        raise RuntimeError(f"the first tool call failed: {problem}")
    await _chat(api, prompts[0], max_tokens, tools=False)
    runs: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    problems: list[str] = []
    for i, prompt in enumerate(prompts[1:]):
        for tools in ((True, False) if i % 2 == 0 else (False, True)):
            elapsed, tokens, problem = await _chat(api, prompt, max_tokens, tools)
            runs[tools].append((elapsed, tokens))
            if problem is not None:
                problems.append(problem)

    def figures(rows: list[tuple[float, int]]) -> dict[str, Any]:
        per_token = [ms / max(1, n) for ms, n in rows]
        return {"end_to_end": latency_figures([ms for ms, _ in rows]),
                "completion_tokens_mean": figure(sum(n for _, n in rows) / len(rows),
                                                 "tokens", 1),
                "ms_per_output_token_p50": figure(percentile(per_token, 0.5), "ms", 2)}

    called, plain = figures(runs[True]), figures(runs[False])
    median_call = percentile([ms for ms, _ in runs[True]], 0.5)
    return {
        "forced_tool_call": called,
        "plain_chat": plain,
        "first_call_end_to_end": figure(first_call, "ms", 1),
        "first_call_over_median_call": ratio(first_call, median_call),
        "ratio_ms_per_output_token_call_over_plain": ratio(
            percentile([ms / max(1, n) for ms, n in runs[True]], 0.5),
            percentile([ms / max(1, n) for ms, n in runs[False]], 0.5)),
        "calls_not_fitting_the_schema": figure(len(problems), "requests", 0),
        "problems": problems[:5],
        "workload": f"{len(prompts) - 1} chat prompts each with tools=[get_weather] and "
                    f"tool_choice required and without tools, alternating, max_tokens "
                    f"{max_tokens}, greedy, not streamed",
    }


async def _health_round_trips(http: Any, base_url: str, count: int) -> list[float]:
    out = []
    for i in range(count + 1):
        start = time.perf_counter()
        reply = await http.get(f"{base_url}/health")
        reply.raise_for_status()
        if i:  # the first one opens the connection
            out.append((time.perf_counter() - start) * 1000)
    return out


def _paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """Percentiles of the per-prompt differences a[i] - b[i] (the same prompt on both
    paths, one right after the other): less sensitive to drift in machine load."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    return {"p50": figure(percentile(diffs, 0.5), "ms", 2),
            "p99": figure(percentile(diffs, 0.99), "ms", 2)}


async def bench_gateway(served: Served, device: str,
                        quick: bool) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """(results, raw TTFT samples per path for the plot)."""
    import openai

    count, max_tokens = (16, 8) if quick else (120, 16)
    unary_count = 8 if quick else 40
    tool_count = 6 if quick else 30
    prompts = _prompts(count + unary_count + 1, seed=13)
    tool_prompts = ["What is the weather like in " + p for p in _prompts(tool_count + 1, 17)]
    sdk: dict[str, list[float]] = {"ttft": [], "e2e": [], "cached": []}
    gw: dict[str, list[float]] = {"ttft": [], "e2e": [], "cached": [], "headers": []}
    unary: dict[str, list[float]] = {"sdk": [], "gateway": []}
    mismatches = 0
    # The openai package's own HTTP client class (httpx, or its fork in newer releases),
    # with its defaults; no proxy from the environment for a loopback server.
    async with running_gateway(served) as base_url, openai.DefaultAsyncHttpxClient(
            trust_env=False) as http:
        api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=served.api_key,
                                 max_retries=0, timeout=120, http_client=http)
        # Warm both paths: the gateway's reply reader, the HTTP connection, the prompt cache
        # of neither measured prompt. A lost warm-up request fails in 30 s, not 120.
        for _ in range(2):
            await _gateway_stream(api.with_options(timeout=30), prompts[-1], 2)
            await _sdk_stream(served, f"gw-warm-{uuid.uuid4().hex[:6]}", prompts[-1], 2)
        for i, prompt in enumerate(prompts[:count]):
            order = ("sdk", "gateway") if i % 2 == 0 else ("gateway", "sdk")
            texts = {}
            for path in order:
                if path == "sdk":
                    ttft, e2e, texts[path], cached = await _sdk_stream(
                        served, f"gw-sdk-{i}", prompt, max_tokens)
                    into = sdk
                else:
                    ttft, e2e, texts[path], cached, headers = await _gateway_stream(
                        api, prompt, max_tokens)
                    gw["headers"].append(headers)
                    into = gw
                into["ttft"].append(ttft)
                into["e2e"].append(e2e)
                into["cached"].append(cached)
            mismatches += texts["sdk"] != texts["gateway"]
        for i, prompt in enumerate(prompts[count:count + unary_count]):
            for path in (("sdk", "gateway") if i % 2 == 0 else ("gateway", "sdk")):
                if path == "sdk":
                    unary[path].append(await _sdk_complete(served, f"gw-unary-{i}", prompt,
                                                           max_tokens))
                else:
                    unary[path].append(await _gateway_complete(api, prompt, max_tokens))
        tool_calls = await _tool_calls(api, tool_prompts, 160)
        hops = await _health_round_trips(http, base_url, 10 if quick else 50)

    added_p50 = added_ms(gw["ttft"], sdk["ttft"], 0.5)
    floor = percentile(hops, 0.5)
    results: dict[str, Any] = {
        "gateway_ttft": latency_figures(gw["ttft"]),
        "gateway_end_to_end": latency_figures(gw["e2e"]),
        "gateway_to_response_headers": latency_figures(gw["headers"]),
        "baseline_sdk_ttft": latency_figures(sdk["ttft"]),
        "baseline_sdk_end_to_end": latency_figures(sdk["e2e"]),
        "added_by_gateway": {
            **added_figures(gw, sdk),
            "ttft_paired_difference": _paired(gw["ttft"], sdk["ttft"]),
            "end_to_end_paired_difference": _paired(gw["e2e"], sdk["e2e"]),
        },
        "non_streaming": {
            "gateway": latency_figures(unary["gateway"]),
            "baseline_sdk_complete": latency_figures(unary["sdk"]),
            "added_p50": figure(added_ms(unary["gateway"], unary["sdk"], 0.5), "ms", 2),
            "added_p99": figure(added_ms(unary["gateway"], unary["sdk"], 0.99), "ms", 2),
            "ratio_p50_gateway_over_sdk": ratio(percentile(unary["gateway"], 0.5),
                                                percentile(unary["sdk"], 0.5)),
        },
        "tool_calls": tool_calls,
        "checks": {
            "answers_differing_from_sdk": figure(mismatches, "requests", 0),
            "mean_cached_prompt_tokens_sdk": figure(sum(sdk["cached"]) / count, "tokens", 1),
            "mean_cached_prompt_tokens_gateway": figure(sum(gw["cached"]) / count,
                                                        "tokens", 1),
        },
        "limits": {
            "http_health_round_trip": latency_figures(hops),
            "http_floor_p50": figure(floor, "ms", 2),
        },
        "fraction_of_limit": {
            "added_ttft_p50_over_http_floor": ratio(added_p50, floor),
        },
        "ratios": {
            "ttft_p50_gateway_over_sdk": ratio(percentile(gw["ttft"], 0.5),
                                               percentile(sdk["ttft"], 0.5)),
            "ttft_p99_gateway_over_sdk": ratio(percentile(gw["ttft"], 0.99),
                                               percentile(sdk["ttft"], 0.99)),
            "end_to_end_p50_gateway_over_sdk": ratio(percentile(gw["e2e"], 0.5),
                                                     percentile(sdk["e2e"], 0.5)),
        },
        "workload": f"{count} text prompts (8-24 words) one at a time, {max_tokens} new tokens, "
                    "greedy; SDK Client.stream(prompt=) vs openai AsyncOpenAI "
                    "completions.create(prompt=, stream=True) on POST /v1/completions; paths "
                    f"alternate request by request, first path alternating; then {unary_count} "
                    "non-streamed (Client.complete vs stream=False) the same way",
    }
    results["goals"] = {
        "added_ttft_p50": goal(f"gateway adds <= {GOAL_ADDED_TTFT_P50_MS:g} ms p50 to TTFT",
                               added_p50, GOAL_ADDED_TTFT_P50_MS, higher_is_better=False,
                               unit="ms"),
    }
    return results, {"sdk": sdk["ttft"], "gateway": gw["ttft"]}
