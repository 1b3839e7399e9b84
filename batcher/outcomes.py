"""Terminal and token events built from a request's state.

Every request ends exactly once: `finish` is the only way to a terminal event,
and it refuses a request that already finished.
"""

from __future__ import annotations

from batcher.state import RequestState, RequestStatus
from batcher.types import (
    Cancelled,
    Expired,
    Failed,
    Finished,
    Latency,
    TerminalEvent,
    TokenCounts,
    Tokens,
)
from schemas import ErrorCode


def error_code(exc: BaseException) -> ErrorCode:
    """The contract's code for a runtime error (its `.code`), else `internal`."""
    try:
        return ErrorCode(getattr(exc, "code", ErrorCode.INTERNAL))
    except ValueError:
        return ErrorCode.INTERNAL


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def token_event(state: RequestState, token_id: int) -> Tokens:
    req = state.request
    seq = len(state.output_token_ids) - 1
    logprobs = (state.output_logprobs[-1],) if state.output_logprobs else None
    return Tokens(req.key, req.attempt, req.origin, seq, (token_id,), logprobs)


def done_event(state: RequestState, finish_reason: str, now: float) -> Finished:
    req = state.request
    arrival = req.arrival_time
    first_scheduled = state.first_scheduled_time if state.first_scheduled_time is not None else now
    first_token = state.first_token_time if state.first_token_time is not None else now
    return Finished(
        req.key,
        req.attempt,
        req.origin,
        finish_reason,
        tuple(state.output_token_ids),
        TokenCounts(state.num_prompt_tokens, state.num_cached_prompt_tokens,
                    len(state.output_token_ids)),
        Latency(_ms(first_scheduled - arrival), _ms(first_token - arrival), _ms(now - arrival)),
        req.adapter_key,
        tuple(state.output_logprobs) if state.output_logprobs else None,
    )


def timeout_event(state: RequestState, now: float, *, early: bool = False) -> Expired:
    req = state.request
    return Expired(req.key, req.attempt, req.origin, _ms(now - req.arrival_time), early)


def error_event(state: RequestState, code: ErrorCode, message: str) -> Failed:
    req = state.request
    return Failed(req.key, req.attempt, req.origin, code, message)


def cancelled_event(state: RequestState, now: float) -> Cancelled | Finished:
    """A client's cancel is answered (`done`, "cancelled", the tokens so far); any
    other cancel ends the request silently, to be served again elsewhere."""
    if state.cancel_answered:
        return done_event(state, "cancelled", now)
    req = state.request
    return Cancelled(req.key, req.attempt, req.origin, len(state.output_token_ids))


def finish(state: RequestState, event: TerminalEvent) -> TerminalEvent:
    """Mark `state` finished; its one terminal event is `event`."""
    if state.status is RequestStatus.FINISHED:
        raise RuntimeError(f"request {state.key!r} already ended")
    state.status = RequestStatus.FINISHED
    return event
