"""A request's outcome from its reply events: the one rule every reader of a reply topic
follows (the SDK, the gateway through it, `sluice batch`, `sluice replay`, the tests).

- A `done` or `error` of any attempt is the request's answer; a `timeout` never
  replaces it.
- Among answers, the highest attempt wins.
- A `timeout` stands only while no answer has been seen: an answer read later, of any
  attempt (a lower one too), replaces it.
- Token events of an attempt lower than the highest seen are dropped.

Why an answer beats a later timeout: under at-least-once delivery a request whose
answer was written but whose offset was not yet committed is served again after a
worker failure, as the next attempt; by then its max_ttft_ms has passed, so that
attempt ends in `timeout`. The worker serving it cannot know the earlier attempt was
answered (it would have to read the reply topic), so the readers decide.

It lives here, beside the events, because any room (and any plain Kafka consumer
written in Python) reading a reply topic needs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from schemas.events import DoneEvent, ErrorEvent, ReplyEvent, TimeoutEvent

Answer = DoneEvent | ErrorEvent
Terminal = DoneEvent | ErrorEvent | TimeoutEvent
TerminalT = TypeVar("TerminalT", bound=Terminal)


class Outcome:
    """One request's outcome so far; `add` its events in the order they were read."""

    __slots__ = ("answer", "attempt", "timeout")

    def __init__(self) -> None:
        self.answer: Answer | None = None  # of the highest attempt among answers
        self.timeout: TimeoutEvent | None = None  # of the highest attempt among timeouts
        self.attempt = -1  # the highest attempt of any event seen

    def add(self, event: ReplyEvent) -> bool:
        """Take one event; False when it belongs to an attempt lower than one already
        seen (a superseded attempt, whose token events a reader drops)."""
        current = event.attempt >= self.attempt
        self.attempt = max(self.attempt, event.attempt)
        if isinstance(event, DoneEvent | ErrorEvent):
            self.answer = _of_higher_attempt(self.answer, event)
        elif isinstance(event, TimeoutEvent):
            self.timeout = _of_higher_attempt(self.timeout, event)
        return current

    @property
    def event(self) -> Terminal | None:
        """The request's terminal event by the rule; None before any."""
        return self.answer if self.answer is not None else self.timeout


def _of_higher_attempt(kept: TerminalT | None, event: TerminalT) -> TerminalT:
    """`event`, unless `kept` is of a higher attempt."""
    return event if kept is None or event.attempt >= kept.attempt else kept


def outcome_of(events: Iterable[ReplyEvent]) -> Terminal | None:
    """The terminal event that is one request's outcome, its events given in the order
    they were read; None when none of them is terminal."""
    outcome = Outcome()
    for event in events:
        outcome.add(event)
    return outcome.event
