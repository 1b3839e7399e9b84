"""Terminal and token events built from a request's state.

Every request ends exactly once: `finish` is the only way to a terminal event,
and it refuses a request that already finished.
"""

from __future__ import annotations

from batcher.state import RequestState, RequestStatus
from batcher.types import (
    CancelledEvent,
    DoneEvent,
    ErrorEvent,
    TerminalEvent,
    TimeoutEvent,
    Timing,
    TokenEvent,
    Usage,
)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def token_event(state: RequestState, token_id: int) -> TokenEvent:
    req = state.request
    seq = len(state.output_token_ids) - 1
    return TokenEvent(req.request_id, req.attempt, req.origin, seq, (token_id,))


def done_event(state: RequestState, finish_reason: str, now: float) -> DoneEvent:
    req = state.request
    arrival = req.arrival_time
    first_scheduled = state.first_scheduled_time if state.first_scheduled_time is not None else now
    first_token = state.first_token_time if state.first_token_time is not None else now
    return DoneEvent(
        req.request_id,
        req.attempt,
        req.origin,
        finish_reason,
        tuple(state.output_token_ids),
        Usage(state.num_prompt_tokens, state.num_cached_prompt_tokens, len(state.output_token_ids)),
        Timing(_ms(first_scheduled - arrival), _ms(first_token - arrival), _ms(now - arrival)),
        req.adapter_key,
    )


def timeout_event(state: RequestState, now: float, *, early: bool = False) -> TimeoutEvent:
    req = state.request
    return TimeoutEvent(
        req.request_id,
        req.attempt,
        req.origin,
        _ms(now - req.arrival_time),
        _ms(req.max_ttft),
        early,
    )


def error_event(state: RequestState, code: str, message: str) -> ErrorEvent:
    req = state.request
    return ErrorEvent(req.request_id, req.attempt, req.origin, code, message)


def cancelled_event(state: RequestState) -> CancelledEvent:
    req = state.request
    return CancelledEvent(req.request_id, req.attempt, req.origin, len(state.output_token_ids))


def finish(state: RequestState, event: TerminalEvent) -> TerminalEvent:
    """Mark `state` finished; its one terminal event is `event`."""
    if state.status is RequestStatus.FINISHED:
        raise RuntimeError(f"request {state.request_id!r} already ended")
    state.status = RequestStatus.FINISHED
    return event
