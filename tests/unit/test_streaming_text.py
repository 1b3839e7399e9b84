"""Streamed text adds up: token events' text always equals the done event's text,
also when generation stops inside a multi-byte character, and across retried attempts."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gpu_runtime.tiny import build_tokenizer
from results.detokenize import IncrementalDecoder
from results.inflight import InFlight
from results.writer import ResultsOptions, ResultWriter
from schemas import DoneEvent, InferenceRequest, Outcome, Timing, TokenEvent, Usage
from sluice.replies import _Subscription, hide_attempts
from tests.unit.fake_producer import FakeProducer

TEXT = "naïve café — 你好 ☕ ok"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


def _ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    # Byte-level BPE with a small vocabulary: the CJK characters and the cup span
    # several tokens, so a stream can stop inside one.
    assert any("\ufffd" in tokenizer.decode(ids[:n]) for n in range(1, len(ids)))
    return ids


@pytest.mark.parametrize("cut", [0, 1, 2, 3])
def test_deltas_and_flush_add_up_to_the_text(tokenizer, cut: int) -> None:
    ids = _ids(tokenizer)
    generated = ids[: len(ids) - cut] if cut else ids
    decoder = IncrementalDecoder(tokenizer, [])
    deltas = [decoder.push([token]) for token in generated]
    deltas.append(decoder.flush())
    assert "".join(deltas) == tokenizer.decode(generated) == decoder.emitted


def test_a_stream_cut_inside_a_character_still_streams_all_of_its_text(tokenizer) -> None:
    ids = _ids(tokenizer)
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    decoder = IncrementalDecoder(tokenizer, [])
    streamed = "".join(decoder.push([token]) for token in ids[:cut])
    tail = decoder.flush()
    assert tail  # held back until the end, then handed out
    assert streamed + tail == tokenizer.decode(ids[:cut])


async def test_the_writer_sends_the_held_back_tail_before_done(tokenizer) -> None:
    ids = _ids(tokenizer)
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    producer = FakeProducer(topics={"r"})
    writer = ResultWriter(ResultsOptions(model="tiny", timeouts_topic="t", deadletter_topic="d",
                                         producer_options={}, request_timeout_s=1.0),
                          lambda tp, offset: None, producer=producer)
    request = InferenceRequest(request_id="r-1", model="tiny", prompt="hi", stream=True)
    ctx = InFlight(request=request, topic_partition=("t", 0), offset=0, reply_topic="r",
                   attempt=0, arrival_time=0.0, max_ttft_ms=1000,
                   decoder=IncrementalDecoder(tokenizer, []))
    for token in ids[:cut]:
        await writer.tokens(ctx, [token])
    await writer.done(ctx, finish_reason="length", token_ids=ids[:cut],
                      num_cached_prompt_tokens=0,
                      timing=Timing(queue_ms=1, ttft_ms=2, total_ms=3), adapter=None)
    await writer.flush()
    events = [orjson.loads(v) for v in producer.values("r")]
    tokens, done = events[:-1], events[-1]
    assert done["type"] == "done"
    assert tokens[-1]["token_ids"] == [] and tokens[-1]["text"]  # the tail, token-less
    assert [t["seq"] for t in tokens] == list(range(len(tokens)))
    assert "".join(t["text"] for t in tokens) == done["text"] == tokenizer.decode(ids[:cut])
    assert [i for t in tokens for i in t["token_ids"]] == done["token_ids"]


async def test_hidden_attempts_deliver_text_and_tokens_once() -> None:
    """Attempt 0 streams 'Hel' then dies; attempt 1 streams it all again, its last
    event token-less: the reader sees every token and character exactly once."""
    sub = _Subscription()

    def token(attempt: int, seq: int, ids: list[int], text: str) -> TokenEvent:
        return TokenEvent(request_id="r", attempt=attempt, seq=seq, token_ids=ids, text=text)

    for event in [
        token(0, 0, [1], "H"), token(0, 1, [2, 3], "el"), token(0, 1, [2, 3], "el"),
        token(1, 0, [1, 2], "He"), token(1, 1, [3], "l"), token(1, 2, [4], "l"),
        token(1, 3, [5], ""), token(1, 4, [], "o\u2615"),
        DoneEvent(request_id="r", attempt=1, finish_reason="stop", text="Hello\u2615",
                  token_ids=[1, 2, 3, 4, 5], usage=Usage(prompt_tokens=1,
                  cached_prompt_tokens=0, completion_tokens=5),
                  timing=Timing(queue_ms=0, ttft_ms=1, total_ms=2), model="m"),
    ]:
        sub.queue.put_nowait(event)
    seen = [e async for e in hide_attempts(sub, Outcome())]
    streamed = [e for e in seen if isinstance(e, TokenEvent)]
    assert [i for e in streamed for i in e.token_ids] == [1, 2, 3, 4, 5]
    assert "".join(e.text for e in streamed) == "Hello\u2615" == seen[-1].text


async def test_a_failed_reader_ends_the_wait_with_its_error() -> None:
    sub = _Subscription()
    sub.queue.put_nowait(RuntimeError("reply topic unreadable"))
    with pytest.raises(RuntimeError, match="unreadable"):
        async with asyncio.timeout(5):
            async for _ in hide_attempts(sub, Outcome()):
                pass
