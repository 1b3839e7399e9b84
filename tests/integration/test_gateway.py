"""`sluice gateway` used by the official `openai` client, on the real broker.

Chat (streamed and not, list-form content), completions, the models list, an
adapter as `MODEL:ADAPTER`, a wrong key (401), an unknown model (404), a field
sluice does not serve (400), and a client that disconnects mid-stream: its
request is cancelled on the worker.
"""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from tests.integration.pipeline_helpers import (
    drop_schema,
    scrape_metrics,
    served_gateway,
    tiny_with_adapter,
    worker_process,
)

pytestmark = [pytest.mark.integration]


def _get(port: int, path: str) -> tuple[int, dict]:
    """(status, JSON body) of a GET to the gateway."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _runtime_logprobs(model_dir, prompt: list[int], num: int) -> list[float]:
    """Greedy tokens' log probabilities from an in-process runtime's own logits."""
    import torch

    from gpu_runtime import Runtime, RuntimeConfig, SamplingParams, StepPlan

    rt = Runtime(model_dir, RuntimeConfig(kv_cache_len=1024))
    rt.add_sequence("ref", prompt, SamplingParams(max_tokens=num, ignore_eos=True))
    out, plan = [], {"ref": len(prompt)}
    while rt.sequences:
        step = rt.execute(StepPlan(plan, return_logits=True))
        token = step.outputs[0].token_id
        out.append(torch.log_softmax(step.logits["ref"].float(), -1)[token].item())
        plan = {"ref": 1}
    rt.close()
    return out


async def test_openai_client_through_the_gateway(settings, tiny_model, tmp_path) -> None:
    client, key = tiny_with_adapter(settings, tiny_model, tmp_path / "adapters")
    other = client.keys.create(tenant="globex")  # granted nothing
    try:
        async with served_gateway(settings, key, "test", timeout_s=120) as (api, port):
            with worker_process(settings, "tiny", tmp_path) as worker:
                messages = [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Say something."}]
                chat = await api.chat.completions.create(model="tiny", messages=messages,
                                                         max_completion_tokens=12, temperature=0)
                assert chat.object == "chat.completion", worker.log()
                answer = chat.choices[0].message.content
                assert answer and chat.choices[0].finish_reason in ("stop", "length")
                assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 0

                # Streamed: the same greedy answer, chunk by chunk, then a usage chunk; the
                # same conversation hits the KV cache (same session key, same worker).
                pieces, usage, finish = [], None, None
                stream = await api.chat.completions.create(
                    model="tiny", messages=messages, max_completion_tokens=12, temperature=0,
                    stream=True, stream_options={"include_usage": True})
                async for part in stream:
                    if part.choices:
                        pieces.append(part.choices[0].delta.content or "")
                        finish = part.choices[0].finish_reason or finish
                    if part.usage is not None:
                        usage = part.usage
                assert "".join(pieces) == answer and finish == chat.choices[0].finish_reason
                assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
                assert usage.prompt_tokens_details.cached_tokens > 0

                # List-form text content is the same prompt.
                parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "content": [{"type": "text", "text": "Say "},
                                                      {"type": "text", "text": "something."}]}]
                listed = await api.chat.completions.create(model="tiny", messages=parts,
                                                           max_completion_tokens=12, temperature=0)
                assert listed.choices[0].message.content == answer

                completion = await api.completions.create(model="tiny", prompt="Once upon",
                                                          max_tokens=6, temperature=0)
                assert completion.object == "text_completion"
                assert completion.choices[0].text and completion.usage.completion_tokens >= 1

                # Log probabilities: greedy picks the most likely token at every position.
                scored = await api.chat.completions.create(
                    model="tiny", messages=messages, max_completion_tokens=8, temperature=0,
                    logprobs=True, top_logprobs=2)
                content = scored.choices[0].logprobs.content
                assert len(content) == scored.usage.completion_tokens
                for entry in content:
                    assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
                    assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
                    assert entry.top_logprobs[0].token == entry.token
                prompt = [5, 9, 14, 22, 31, 40]
                legacy = await api.completions.create(model="tiny", prompt=prompt,
                                                      max_tokens=4, temperature=0, logprobs=2)
                served = legacy.choices[0].logprobs
                assert served.token_logprobs == pytest.approx(
                    _runtime_logprobs(tiny_model, prompt, 4), abs=1e-4)
                # {token text: logprob}: two byte tokens may decode alike and share a key.
                assert all(1 <= len(alternatives) <= 2 for alternatives in served.top_logprobs)

                # n choices: sampled with seeds seed, seed+1, ...; streamed, each by index.
                several = await api.chat.completions.create(
                    model="tiny", messages=messages, max_completion_tokens=8, temperature=1.0,
                    seed=7, n=3)
                assert [c.index for c in several.choices] == [0, 1, 2]
                assert len({c.message.content for c in several.choices}) > 1
                assert several.usage.completion_tokens >= 3  # summed over the choices
                texts = ["", ""]
                stream = await api.chat.completions.create(
                    model="tiny", messages=messages, max_completion_tokens=8, temperature=1.0,
                    seed=7, n=2, stream=True, stream_options={"include_usage": True})
                streamed_usage = None
                async for part in stream:
                    for choice in part.choices:
                        texts[choice.index] += choice.delta.content or ""
                    streamed_usage = part.usage or streamed_usage
                assert texts == [c.message.content for c in several.choices[:2]]
                assert streamed_usage is not None

                # Structured output: JSON that parses and fits the schema, token by token.
                schema = {"type": "object", "additionalProperties": False,
                          "required": ["color", "count", "ok"],
                          "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "ok": {"type": "boolean"}}}
                shaped = await api.chat.completions.create(
                    model="tiny", messages=messages, max_completion_tokens=200, temperature=0.7,
                    seed=1, response_format={"type": "json_schema", "json_schema": {
                        "name": "thing", "schema": schema, "strict": True}})
                value = json.loads(shaped.choices[0].message.content)
                assert set(value) == {"color", "count", "ok"} and value["color"] in schema[
                    "properties"]["color"]["enum"]
                assert isinstance(value["count"], int) and 0 <= value["count"] <= 99
                assert shaped.choices[0].finish_reason == "stop"
                anything = await api.chat.completions.create(
                    model="tiny", messages=messages, max_completion_tokens=200, temperature=0,
                    response_format={"type": "json_object"})
                assert isinstance(json.loads(anything.choices[0].message.content), dict)
                with pytest.raises(openai.BadRequestError, match="schema"):
                    await api.chat.completions.create(
                        model="tiny", messages=messages, response_format={
                            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                                "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})

                listed = (await api.models.list()).data
                assert {m.id for m in listed} == {"tiny", "tiny:a0"}
                assert all(m.created > 1_700_000_000 and m.ready for m in listed)
                status, ready = await asyncio.to_thread(_get, port, "/ready")
                assert status == 200 and ready["models"]["tiny"]["ready"]  # from its heartbeat
                assert (await asyncio.to_thread(_get, port, "/ready?model=ghost"))[0] == 503
                adapted = await api.chat.completions.create(model="tiny:a0", messages=messages,
                                                            max_completion_tokens=12, temperature=0)
                assert adapted.choices[0].message.content

                wrong = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=other,
                                           max_retries=0)
                with pytest.raises(openai.AuthenticationError):
                    await wrong.chat.completions.create(model="tiny", messages=messages)
                assert (await wrong.models.list()).data == []  # a valid key, granted nothing
                bogus = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                           api_key="sk-sluice-nonsense", max_retries=0)
                with pytest.raises(openai.AuthenticationError):
                    await bogus.models.list()
                with pytest.raises(openai.NotFoundError):
                    await api.chat.completions.create(model="ghost", messages=messages)
                with pytest.raises(openai.NotFoundError):
                    await api.chat.completions.create(model="tiny:ghost", messages=messages)
                with pytest.raises(openai.BadRequestError, match="reasoning_effort") as refused:
                    await api.chat.completions.create(model="tiny", messages=messages,
                                                      reasoning_effort="high")
                assert refused.value.param == "reasoning_effort"

                # A client that goes away mid-stream: the worker stops its request.
                stream = await api.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "A long story, please."}],
                    max_completion_tokens=2000, temperature=0, stream=True)
                async for _part in stream:
                    break
                await stream.close()

                def cancelled() -> float:
                    found = re.search(
                        r'sluice_cancels_total\{[^}]*outcome="cancelled"[^}]*\} (\S+)',
                        scrape_metrics(worker))
                    return float(found.group(1)) if found else 0.0

                async with asyncio.timeout(30):
                    while await asyncio.to_thread(cancelled) < 1:
                        await asyncio.sleep(0.2)
    finally:
        await client.aclose()
        await drop_schema(settings)
