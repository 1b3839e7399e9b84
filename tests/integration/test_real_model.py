"""A real instruct model through Kafka (SmolLM2-135M-Instruct, its ChatML template and
`<|im_end|>` end of turn), compared with transformers' greedy answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import sluice
from tests.integration.pipeline_helpers import drop_schema, worker_process
from tests.real_model import smollm2_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK_SIZE = 16  # the compute config's default KV block


@pytest.fixture(scope="module")
def smol() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def reference(smol: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smol))
    model = AutoModelForCausalLM.from_pretrained(str(smol), dtype=torch.float32).eval()
    return tokenizer, model


def _greedy(reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy answer; it stops at generation_config.json's eos."""
    _, model = reference
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def _chat_ids(reference, messages: list[dict]) -> list[int]:
    tokenizer, _ = reference
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


async def test_two_turn_chat_is_transformers_greedy_and_reuses_the_whole_turn(
        settings, smol, reference, tmp_path) -> None:
    tokenizer, _ = reference
    client = sluice.Client(settings)
    client.models.register(model="smol", path=str(smol),
                           compute_config={"kv_cache_len": 4096})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="smol")
    try:
        with worker_process(settings, "smol", tmp_path) as worker:
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            turns = []
            for follow_up in ("And the capital of Germany?", None):
                prompt_ids = _chat_ids(reference, messages)
                expected = await asyncio.to_thread(_greedy, reference, prompt_ids, 48)
                done = await asyncio.wait_for(client.complete(
                    model="smol", api_key=key, session_id="chat-1", messages=messages,
                    max_tokens=48), 180)
                # The model's own template and end of turn: exactly transformers' answer,
                # ended by <|im_end|>, not by max_tokens.
                assert done.token_ids == expected, (done.text, tokenizer.decode(expected),
                                                    worker.log()[-3000:])
                assert done.finish_reason == "stop" and expected[-1] == tokenizer.eos_token_id
                assert done.text == tokenizer.decode(expected, skip_special_tokens=True)
                assert done.usage.prompt_tokens == len(prompt_ids)
                turns.append((len(prompt_ids), done))
                if follow_up is not None:
                    messages += [{"role": "assistant", "content": done.text},
                                 {"role": "user", "content": follow_up}]
            (first_prompt, first), (_, second) = turns
            assert "Paris" in first.text and "Berlin" in second.text
            # Turn 2 found all of turn 1 in the cache: its prompt and its answer.
            whole_turn = first_prompt + first.usage.completion_tokens
            print(f"turn 1: {first_prompt} prompt + {first.usage.completion_tokens} answer "
                  f"tokens; turn 2: {second.usage.cached_prompt_tokens} of "
                  f"{second.usage.prompt_tokens} prompt tokens cached")
            assert second.usage.cached_prompt_tokens >= whole_turn - BLOCK_SIZE, (
                second.usage, whole_turn)

            # A plain prompt is what tokenizer(text) gives: no invented bos.
            text = "The capital of France is"
            plain_ids = tokenizer(text)["input_ids"]
            expected = await asyncio.to_thread(_greedy, reference, plain_ids, 8)
            done = await asyncio.wait_for(client.complete(
                model="smol", api_key=key, prompt=text, max_tokens=8), 180)
            assert done.usage.prompt_tokens == len(plain_ids)
            assert done.token_ids == expected[:8]
    finally:
        await client.aclose()
        await drop_schema(settings)
