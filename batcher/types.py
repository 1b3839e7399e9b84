"""Plain data in and out of the batcher: the request handed in, the events handed out.

`ingest` builds a `Request` from a decoded Kafka record; `results` turns each
event into its wire message. Nothing here knows Kafka or pydantic: `origin` is
an opaque object (partition + offset) the batcher passes back untouched.

Times are wall-clock seconds (`time.time()` scale, like a broker timestamp);
durations in events are milliseconds, as on the wire.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from gpu_runtime.sequence import SamplingParams


class RequestClass(enum.Enum):
    """Interactive requests have tight deadlines; bulk ones fill idle capacity."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


class ErrorCode:
    """Error codes of CONTRACT.md that the batcher itself emits."""

    INVALID_REQUEST = "invalid_request"
    CONTEXT_TOO_LONG = "context_too_long"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as the batcher sees it.

    `arrival_time` is the broker timestamp, so queue time counts toward TTFT;
    `max_ttft` is already the tighter of the request's and the model's.
    `request_class=None` lets the scheduler classify by `max_ttft`.
    """

    request_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    max_ttft: float
    adapter_key: str | None = None
    attempt: int = 0
    origin: Any = None
    request_class: RequestClass | None = None

    @property
    def deadline(self) -> float:
        return self.arrival_time + self.max_ttft


@dataclass(frozen=True, slots=True)
class Usage:
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timing:
    queue_ms: float  # arrival -> first scheduled
    ttft_ms: float  # arrival -> first token sampled
    total_ms: float  # arrival -> done


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    attempt: int
    origin: Any
    seq: int  # 0, 1, 2 ... per attempt
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DoneEvent:
    request_id: str
    attempt: int
    origin: Any
    finish_reason: str  # "stop" | "length"
    token_ids: tuple[int, ...]  # every generated token
    usage: Usage
    timing: Timing
    adapter_key: str | None = None


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    request_id: str
    attempt: int
    origin: Any
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class TimeoutEvent:
    request_id: str
    attempt: int
    origin: Any
    waited_ms: float
    max_ttft_ms: float
    early: bool = False  # predicted to miss its deadline, dropped before it passed


@dataclass(frozen=True, slots=True)
class CancelledEvent:
    request_id: str
    attempt: int
    origin: Any
    num_completion_tokens: int = 0


Event = TokenEvent | DoneEvent | ErrorEvent | TimeoutEvent | CancelledEvent
TerminalEvent = DoneEvent | ErrorEvent | TimeoutEvent | CancelledEvent
TERMINAL_EVENT_TYPES = (DoneEvent, ErrorEvent, TimeoutEvent, CancelledEvent)


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start; read by the engine's callers and the bench."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_finished: int = 0
    num_timeouts: int = 0
    num_early_timeouts: int = 0
    num_errors: int = 0
    num_cancelled: int = 0
    max_adapters_in_step: int = 0
    num_isolated_failures: int = 0  # steps that failed without naming a culprit
