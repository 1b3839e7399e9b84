"""One slotted dataclass holds all of a request's scheduling state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batcher.types import Request, RequestClass


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never admitted; holds no runtime state
    RUNNING = "running"  # admitted; holds KV blocks in the runtime
    PREEMPTED = "preempted"  # known to the runtime, blocks freed; waits to resume
    FINISHED = "finished"  # its terminal event was emitted


@dataclass(slots=True)
class RequestState:
    request: Request
    request_class: RequestClass
    arrival_order: int  # submission counter: FCFS order and a stable tie-break
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # prompt + generated tokens in the KV cache
    num_cached_prompt_tokens: int = 0  # found cached at first admission
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(
        default_factory=list)  # when the request asked for them
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    cancel_requested: bool = False
    # A client's cancel: ends with a `done` (finish_reason "cancelled", the tokens so far)
    # rather than silently (a partition handed over, served again elsewhere).
    cancel_answered: bool = False

    @property
    def key(self) -> str:
        return self.request.key

    @property
    def deadline(self) -> float:
        """When the first token is due (wall-clock seconds); inf for no deadline."""
        return self.request.deadline

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def has_first_token(self) -> bool:
        return self.first_token_time is not None

    @property
    def is_decoding(self) -> bool:
        return self.has_first_token and self.num_uncomputed == 1

    @property
    def in_runtime(self) -> bool:
        return self.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.request.token_ids, *self.output_token_ids]
