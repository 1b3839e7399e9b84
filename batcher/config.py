"""The batcher's settings: one validated, immutable object built at start-up."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from batcher.errors import ConfigError


class OrderingPolicy(enum.Enum):
    """How waiting requests are ordered (admission is decided separately)."""

    EDF = "edf"  # earliest deadline first; ties go to the longest cached prefix
    FCFS = "fcfs"  # arrival order (the baseline the bench compares against)


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    """Knobs of the scheduler.

    - `max_num_batched_tokens`: the one token budget of a step (decodes + chunks).
    - `max_num_seqs`: sequences per step.
    - `max_adapters_per_step`: distinct non-base adapters among running requests.
    - `kv_headroom_blocks`: free blocks a new request must leave for the running
      ones to decode into (waived when nothing runs, so a lone long prompt fits).
    - `bulk_min_ttft`: a request without a class hint is bulk if its max_ttft is
      at least this many seconds.
    - `bulk_token_share`: share of each step's budget reserved for the oldest
      bulk request while bulk work exists (bulk never starves).
    - `early_timeout`: time out a waiting request as soon as the measured prefill
      speed says it cannot get its first token before its deadline.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    max_adapters_per_step: int = 4
    kv_headroom_blocks: int = 4
    ordering: OrderingPolicy = OrderingPolicy.EDF
    bulk_min_ttft: float = 300.0
    bulk_token_share: float = 0.125
    early_timeout: bool = False
    early_timeout_margin: float = 1.0  # predicted time is multiplied by this
    max_num_waiting: int = 1024  # `is_full()` above this many waiting requests

    def __post_init__(self) -> None:
        positive = ("max_num_batched_tokens", "max_num_seqs", "max_adapters_per_step")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_headroom_blocks < 0:
            raise ConfigError(f"kv_headroom_blocks must be >= 0, got {self.kv_headroom_blocks}")
        if not 0.0 <= self.bulk_token_share < 1.0:
            raise ConfigError(f"bulk_token_share must be in [0, 1), got {self.bulk_token_share}")
        if self.bulk_min_ttft <= 0 or self.early_timeout_margin <= 0:
            raise ConfigError("bulk_min_ttft and early_timeout_margin must be > 0")
        if self.max_num_waiting < 1:
            raise ConfigError(f"max_num_waiting must be >= 1, got {self.max_num_waiting}")

    @property
    def num_bulk_reserved_tokens(self) -> int:
        return int(self.max_num_batched_tokens * self.bulk_token_share)
