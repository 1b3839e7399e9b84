"""Plain data in and out of the batcher: the request handed in, the events handed out.

The worker builds a `Request` from an admitted record; it turns each event
into its wire message. Nothing here knows Kafka or pydantic: `origin` is the
caller's own record of the request, handed back untouched in every event.

Times are wall-clock seconds (`time.time()` scale, like a broker timestamp);
durations in events are milliseconds, as on the wire. Error codes are the
contract's (`schemas.ErrorCode`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from gpu_runtime.sequence import SamplingParams
from schemas import ErrorCode


class RequestClass(enum.Enum):
    """Interactive requests have tight deadlines; bulk ones fill idle capacity."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as the batcher sees it.

    `key` is unique among the engine's requests (the caller chooses it).
    `arrival_time` is the broker timestamp, so queue time counts toward TTFT;
    `deadline` (when the first token is due) is already the tighter of the
    request's and the model's. `request_class=None` lets the scheduler classify
    by the time the request allows (`deadline - arrival_time`).
    """

    key: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    deadline: float
    adapter_key: str | None = None
    attempt: int = 0
    origin: Any = None
    request_class: RequestClass | None = None

    @property
    def ttft_allowance(self) -> float:
        """Seconds from arrival to the deadline."""
        return self.deadline - self.arrival_time


@dataclass(frozen=True, slots=True)
class TokenCounts:
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_completion_tokens: int


@dataclass(frozen=True, slots=True)
class Latency:
    queue_ms: float  # arrival -> first scheduled
    ttft_ms: float  # arrival -> first token sampled
    total_ms: float  # arrival -> done


# A generated token's log probability and the most likely alternatives' (id, logprob).
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, slots=True)
class Tokens:
    """Tokens a request just generated."""

    key: str
    attempt: int
    origin: Any
    seq: int  # 0, 1, 2 ... per attempt
    token_ids: tuple[int, ...]
    # Per token, when asked for: (logprob, ((id, logprob) of the most likely, ...)).
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """A request generated its last token."""

    key: str
    attempt: int
    origin: Any
    finish_reason: str  # "stop" | "length"
    token_ids: tuple[int, ...]  # every generated token
    counts: TokenCounts
    latency: Latency
    adapter_key: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # of every token, when asked for


@dataclass(frozen=True, slots=True)
class Failed:
    key: str
    attempt: int
    origin: Any
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class Expired:
    """No first token by the deadline (or none possible by then: `early`)."""

    key: str
    attempt: int
    origin: Any
    waited_ms: float
    early: bool = False  # predicted to miss its deadline, dropped before it passed


@dataclass(frozen=True, slots=True)
class Cancelled:
    key: str
    attempt: int
    origin: Any
    num_completion_tokens: int = 0


Event = Tokens | Finished | Failed | Expired | Cancelled
TerminalEvent = Finished | Failed | Expired | Cancelled
TERMINAL_EVENT_TYPES = (Finished, Failed, Expired, Cancelled)


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
