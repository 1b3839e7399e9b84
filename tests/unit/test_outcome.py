"""The reader's rule (`schemas.Outcome`): a `done` or `error` of any attempt is a request's
outcome and never gives way to a `timeout`; among answers the highest attempt wins; a
`timeout` stands only while no answer has been read; superseded attempts' tokens are
dropped. Event sequences as a reader of the reply topic reads them, no Kafka."""

from __future__ import annotations

import pytest

from schemas import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Outcome,
    ReplyEvent,
    TimeoutEvent,
    Timing,
    TokenEvent,
    Usage,
    outcome_of,
)

ID = "r-1"


def done(attempt: int, text: str = "Hello") -> DoneEvent:
    return DoneEvent(request_id=ID, attempt=attempt, finish_reason="stop", text=text,
                     token_ids=[1], usage=Usage(prompt_tokens=1, cached_prompt_tokens=0,
                                                completion_tokens=1),
                     timing=Timing(queue_ms=0, ttft_ms=1, total_ms=2), model="tiny")


def error(attempt: int) -> ErrorEvent:
    return ErrorEvent(request_id=ID, attempt=attempt, code=ErrorCode.OVERLOADED,
                      message="no room")


def timeout(attempt: int) -> TimeoutEvent:
    return TimeoutEvent(request_id=ID, attempt=attempt, waited_ms=61_000.0,
                        max_ttft_ms=60_000)


def token(attempt: int, seq: int) -> TokenEvent:
    return TokenEvent(request_id=ID, attempt=attempt, seq=seq, token_ids=[1], text="H")


@pytest.mark.parametrize(("events", "expected"), [
    # a record re-served after its answer was written: the late timeout loses
    ([done(0), timeout(1)], done(0)),
    # the old owner's answer lands after the new owner's timeout: the answer wins
    ([timeout(1), done(0)], done(0)),
    ([done(0), done(1)], done(1)),
    ([done(1), done(0)], done(1)),  # the highest attempt, whatever the order read
    ([error(0), timeout(2)], error(0)),
    ([done(0), error(1)], error(1)),
    ([timeout(0)], timeout(0)),
    ([timeout(0), timeout(1)], timeout(1)),
    # the fault run's sequence: done 0, done 13, then a timeout of attempt 14
    ([done(0), done(13), timeout(14)], done(13)),
    ([token(0, 0), token(1, 0), timeout(1), token(0, 1), done(0)], done(0)),
], ids=["done0-timeout1", "timeout1-done0", "done0-done1", "done1-done0", "error0-timeout2",
        "done0-error1", "timeout0", "timeout0-timeout1", "fault-run", "tokens-between"])
def test_the_outcome_of_an_event_sequence(events: list[ReplyEvent],
                                          expected: ReplyEvent) -> None:
    assert outcome_of(events) == expected


def test_tokens_alone_have_no_outcome() -> None:
    assert outcome_of([token(0, 0), token(0, 1)]) is None
    assert outcome_of([]) is None


def test_an_answer_read_after_a_timeout_replaces_it() -> None:
    outcome = Outcome()
    outcome.add(timeout(2))
    assert outcome.event == timeout(2) and outcome.answer is None
    outcome.add(done(0))
    assert outcome.event == done(0) == outcome.answer
    assert outcome.timeout == timeout(2)  # kept, but no longer the outcome


def test_events_of_a_superseded_attempt_are_told_apart() -> None:
    """Attempt 1 has started: attempt 0's late tokens are superseded (a reader drops
    them), its late answer is superseded too but still counts for the outcome."""
    outcome = Outcome()
    assert outcome.add(token(0, 0))
    assert outcome.add(token(1, 0))
    assert not outcome.add(token(0, 1))
    assert outcome.add(token(1, 1))  # the same attempt goes on
    assert not outcome.add(done(0))
    assert outcome.attempt == 1 and outcome.event == done(0)
