"""results: pure translation, and delivery's policy against a fake producer — a terminal
event finishes its offset only once acknowledged; one refused for good, or whose reply
topic is gone, dead-letters its request; a retriable refusal is retried; a token event
to a topic without metadata never holds anything up. (The same writer against the real
broker: tests/integration/test_faults.py and test_pipeline.py.)"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError, TopicAuthorizationFailedError

from results import delivery
from results.detokenize import IncrementalDecoder
from results.inflight import InFlight
from results.translate import Translator
from results.writer import ResultsOptions, ResultWriter
from schemas import ErrorCode, InferenceRequest, Timing
from tests.unit.fake_producer import FakeProducer

TP = TopicPartition("sluice.requests.tiny", 0)
TIMING = Timing(queue_ms=1, ttft_ms=2, total_ms=3)


class BrokenDecoder(IncrementalDecoder):
    """A detokenizer that fails, as one might on ids it cannot map."""

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def _ctx(offset: int = 7, *, stream: bool = True, reply_topic: str = "replies",
         decoder: IncrementalDecoder | None = None) -> InFlight:
    request = InferenceRequest(request_id=f"r-{offset}", model="tiny", prompt="hi",
                               stream=stream, session_id="s-1")
    return InFlight(request=request, topic_partition=TP, offset=offset,
                    reply_topic=reply_topic, attempt=0, arrival_time=0.0, max_ttft_ms=1000,
                    decoder=decoder or IncrementalDecoder(None, []), num_prompt_tokens=3)


@pytest.fixture
def producer() -> FakeProducer:
    return FakeProducer(topics={"replies", "sluice.timeouts", "sluice.deadletter"})


@pytest.fixture
def finished() -> list[tuple[object, int]]:
    return []


@pytest.fixture
def writer(producer, finished) -> ResultWriter:
    options = ResultsOptions(model="tiny", timeouts_topic="sluice.timeouts",
                             deadletter_topic="sluice.deadletter", producer_options={},
                             request_timeout_s=1.0)
    return ResultWriter(options, lambda tp, offset: finished.append((tp, offset)),
                        producer=producer)


def test_translation_is_pure_and_complete() -> None:
    t = Translator("tiny", "sluice.timeouts", "sluice.deadletter")
    ctx = _ctx()
    assert t.tokens(ctx, [5]).topic == "replies" and ctx.next_seq == 1
    *tail, done = t.done(ctx, finish_reason="stop", token_ids=[5, 6],
                         num_cached_prompt_tokens=1, timing=TIMING, adapter=None)
    assert tail == [] and done.key == b"r-7"
    event = orjson.loads(done.value)
    assert event["usage"] == {"prompt_tokens": 3, "cached_prompt_tokens": 1,
                              "completion_tokens": 2}
    log, terminal = t.timeout(_ctx(8), 1500.0, "max_ttft_ms passed")
    assert log.topic == "sluice.timeouts" and terminal.topic == "replies"
    assert orjson.loads(terminal.value)["max_ttft_ms"] == 1000
    assert orjson.loads(log.value)["request"]["prompt"] == "hi"
    letter = orjson.loads(t.undeliverable(_ctx(9), "the topic no longer exists").value)
    assert letter["offset"] == 9 and "no longer exists" in letter["reason"]
    assert t.undeliverable(_ctx(9), "x").key == b"s-1"  # the request record's own key
    assert t.tokens(_ctx(stream=False), [5]) is None


async def test_a_terminal_event_finishes_its_offset_once_acknowledged(
    writer, producer, finished
) -> None:
    ctx = _ctx()
    await writer.tokens(ctx, [5])
    await writer.done(ctx, finish_reason="length", token_ids=[5, 6],
                      num_cached_prompt_tokens=0, timing=TIMING, adapter=None)
    await writer.flush()
    assert [orjson.loads(v)["type"] for v in producer.values("replies")] == ["token", "done"]
    assert finished == [(TP, 7)]


async def test_a_done_that_cannot_be_built_becomes_an_internal_error(
    writer, producer, finished
) -> None:
    ctx = _ctx(decoder=BrokenDecoder(None, []))
    await writer.tokens(ctx, [5])  # skipped: no terminal, the request goes on
    assert producer.acked == []
    await writer.done(ctx, finish_reason="length", token_ids=[5, 6],
                      num_cached_prompt_tokens=0, timing=TIMING, adapter=None)
    await writer.flush()
    (value,) = producer.values("replies")
    event = orjson.loads(value)
    assert event["type"] == "error" and event["code"] == "internal"
    assert "UnicodeDecodeError" in event["message"]
    assert finished == [(TP, 7)]


async def test_refused_for_good_or_gone_dead_letters_the_request(
    writer, producer, finished, monkeypatch
) -> None:
    monkeypatch.setattr(delivery, "GONE_RECHECK_S", 0.01)
    monkeypatch.setattr(delivery, "METADATA_WAIT_S", 0.05)
    producer.fail_ack["forbidden"] = TopicAuthorizationFailedError("forbidden")
    producer.topics.add("forbidden")
    await writer.error(_ctx(1, reply_topic="forbidden"), ErrorCode.INTERNAL, "boom")
    # "deleted": the producer cannot learn it, and the broker says it does not exist.
    await writer.error(_ctx(2, reply_topic="deleted"), ErrorCode.INTERNAL, "boom")
    await asyncio.wait_for(writer.flush(), 10)
    letters = [orjson.loads(v) for v in producer.values("sluice.deadletter")]
    assert sorted(letter["offset"] for letter in letters) == [1, 2]
    reasons = {letter["offset"]: letter["reason"] for letter in letters}
    assert "TopicAuthorizationFailedError" in reasons[1]
    assert "no longer exists" in reasons[2]
    assert sorted(offset for _, offset in finished) == [1, 2]  # never stuck


async def test_a_retriable_refusal_is_retried_and_delivered(
    writer, producer, finished, monkeypatch
) -> None:
    monkeypatch.setattr(delivery, "RESEND_BACKOFF_S", 0.01)
    producer.refuse_send["replies"] = [KafkaTimeoutError("leader moving")] * 2
    await writer.error(_ctx(3), ErrorCode.OVERLOADED, "busy")
    await asyncio.wait_for(writer.flush(), 10)
    assert [orjson.loads(v)["code"] for v in producer.values("replies")] == ["overloaded"]
    assert producer.values("sluice.deadletter") == []
    assert finished == [(TP, 3)]


async def test_a_token_event_to_a_topic_without_metadata_holds_nothing_up(
    writer, producer, finished, monkeypatch
) -> None:
    monkeypatch.setattr(delivery, "METADATA_WAIT_S", 0.05)
    producer.unknown.add("slow")
    slow, fast = _ctx(4, reply_topic="slow"), _ctx(5)
    started = asyncio.get_running_loop().time()
    await writer.tokens(slow, [5])  # waits METADATA_WAIT_S once, then is dropped
    await writer.tokens(slow, [6])  # skipped at once: the topic is known to be unready
    await writer.done(fast, finish_reason="stop", token_ids=[7], num_cached_prompt_tokens=0,
                      timing=TIMING, adapter=None)
    await writer.flush()
    assert asyncio.get_running_loop().time() - started < 1.0
    assert finished == [(TP, 5)]


async def test_records_that_never_became_requests_finish_their_offsets(
    writer, producer, finished
) -> None:
    await writer.refusal(tp=TP, offset=10, reply_topic="replies", request_id="r-10",
                         code=ErrorCode.UNAUTHORIZED, message="no key")
    await writer.dead_letter(tp=TP, offset=11, key=None, value=b"\xff", reason="garbage")
    await writer.flush()
    assert orjson.loads(producer.values("replies")[0])["code"] == "unauthorized"
    letter = orjson.loads(producer.values("sluice.deadletter")[0])
    assert (letter["topic"], letter["partition"], letter["offset"]) == (TP.topic, 0, 11)
    assert finished == [(TP, 10), (TP, 11)]
