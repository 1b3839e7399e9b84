"""The readers follow `schemas.Outcome`'s rule: the SDK's reply reader (record values
routed by `ReplyReader`, attempts hidden by `hide_attempts`), the gateway's answers and
streams over it, and `sluice batch`'s lines. Records are fed to the reader as the
consumer would hand them over; no Kafka."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson
import pytest

from common.settings import Settings
from gateway.app import Gateway
from schemas import Outcome, ReplyEvent, TimeoutEvent, TokenEvent, encode
from schemas.outcome import Terminal
from sluice.batch import SluiceFormat, outcome_of_stream
from sluice.replies import ReplyReader, _Subscription, hide_attempts
from tests.unit.test_outcome import ID, done, timeout, token

# Attempt 1 was streaming when the old owner's answer of attempt 0 landed; attempt 1's
# worker then failed and attempt 2, re-served past the deadline, timed out.
ANSWERED_THEN_TIMED_OUT = [token(1, 0), done(0), timeout(2)]


@contextlib.asynccontextmanager
async def subscribed(events: Iterable[ReplyEvent]) -> AsyncIterator[_Subscription]:
    """A subscription to request ID with `events` read from the reply topic, among a
    record of another request and one that is not a reply event."""
    reader = ReplyReader(Settings.load(), "sluice.results")
    sub = reader.subscribe(ID)
    reader._route(encode(timeout(0).model_copy(update={"request_id": "someone-else"})))
    reader._route(b'{"not": "a reply"}')
    for event in events:
        reader._route(encode(event))
    try:
        yield sub
    finally:
        await reader.stop()


async def read_all(events: Iterable[ReplyEvent]) -> list[ReplyEvent]:
    async with subscribed(events) as sub, asyncio.timeout(5):
        return [e async for e in hide_attempts(sub, Outcome())]


# ---- the SDK's stream ---------------------------------------------------------------


async def test_an_answer_is_not_replaced_by_a_later_attempts_timeout() -> None:
    seen = await read_all(ANSWERED_THEN_TIMED_OUT)
    assert seen == [token(1, 0), done(0)]


async def test_the_stream_ends_at_the_first_answer_of_the_newest_attempt() -> None:
    """Not streamed: the answer of attempt 0 ends it; the later timeout is never read."""
    assert await read_all([done(0), timeout(1)]) == [done(0)]


async def test_among_answers_the_newest_attempt_wins() -> None:
    assert await read_all([token(1, 0), done(0), done(1)]) == [token(1, 0), done(1)]


async def test_a_timeout_with_no_answer_read_before_it_is_the_outcome() -> None:
    """The reader started before the request was sent, so it read every earlier event:
    a timeout of the newest attempt with no answer before it ends the stream."""
    assert await read_all([timeout(1), done(0)]) == [timeout(1)]


async def test_a_superseded_attempts_tokens_and_timeout_are_dropped() -> None:
    late = TokenEvent(request_id=ID, attempt=0, seq=1, token_ids=[9], text="x")
    seen = await read_all([token(0, 0), token(1, 0), late, timeout(0), done(1)])
    assert seen == [token(0, 0), done(1)]  # attempt 1's first token repeats attempt 0's


async def test_while_the_newest_attempt_runs_an_earlier_answer_is_at_hand() -> None:
    """What `Client.stream` yields at its deadline instead of RequestTimeoutError."""
    outcome = Outcome()
    async with subscribed([token(1, 0), done(0)]) as sub:
        events = hide_attempts(sub, outcome)
        assert await anext(events) == token(1, 0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await anext(events)
    assert outcome.answer == done(0)


# ---- the gateway --------------------------------------------------------------------


async def test_the_gateway_answers_with_the_earlier_attempts_done() -> None:
    gateway = Gateway(Settings.load(), instance_id="unit")
    async with subscribed(ANSWERED_THEN_TIMED_OUT) as sub, asyncio.timeout(5):
        events = hide_attempts(sub, Outcome())
        first = await gateway._first(events)
        assert await gateway._done(first, events) == done(0)


async def test_the_gateways_stream_finishes_instead_of_timing_out() -> None:
    gateway = Gateway(Settings.load(), instance_id="unit")
    async with subscribed(ANSWERED_THEN_TIMED_OUT) as sub, asyncio.timeout(5):
        events = hide_attempts(sub, Outcome())
        first = await gateway._first(events)
        chunks = [c async for c in gateway._chunks("chat", ID, [first], [events], "tiny",
                                                   0, include_usage=False)]
    assert chunks[-1] == b"data: [DONE]\n\n"
    payloads: list[dict[str, Any]] = [orjson.loads(c.removeprefix(b"data: "))
                                      for c in chunks[:-1]]
    assert not [p for p in payloads if "error" in p]
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"


# ---- sluice batch -------------------------------------------------------------------


async def test_a_batch_line_holds_the_answer() -> None:
    async with subscribed(ANSWERED_THEN_TIMED_OUT) as sub, asyncio.timeout(5):
        event = await outcome_of_stream(hide_attempts(sub, Outcome()))

    async def send(_fields: dict[str, Any]) -> Terminal:
        return event

    result = await SluiceFormat().answer("c-1", {"prompt": "hi"}, ID, send)
    assert result.answered
    assert result.line == {"custom_id": "c-1", "response": done(0).model_dump(mode="json"),
                           "error": None}


async def test_a_batch_line_of_a_timeout_alone_is_its_error() -> None:
    async with subscribed([timeout(0)]) as sub, asyncio.timeout(5):
        event = await outcome_of_stream(hide_attempts(sub, Outcome()))
    assert isinstance(event, TimeoutEvent) and event == timeout(0)
