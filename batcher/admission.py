"""Admission: does a request fit this step? A budget that answers with an enum.

Three resources bound a step: the token budget (decodes and prefill chunks
share it), the sequence count, and KV blocks. Adapters add a fourth: distinct
non-base adapters among running requests never exceed the device's slots, and
a request whose adapter is not resident waits (others go ahead).

Blocks are counted twice over. `num_free_blocks` is what the runtime can hand
out *this step*; a new request is admitted only if the blocks for its whole
uncached prompt plus `headroom` fit in what is left after the prompts already
running are promised theirs, so admitted prompts are not preempted half-way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class AddResult(enum.Enum):
    OK = "ok"
    NO_TOKENS = "no_tokens"
    NO_SEQS = "no_seqs"
    NO_BLOCKS = "no_blocks"
    NO_ADAPTER_SLOT = "no_adapter_slot"  # slots full, or adapter not resident yet


@dataclass(slots=True)
class StepBudget:
    num_tokens_left: int
    num_seqs_left: int
    num_admittable_blocks: int  # free blocks not promised to running prompts
    max_adapters: int
    adapters: set[str]  # non-base adapters held by running requests
    resident: frozenset[str] | None  # None: every adapter is loadable at once
    wanted_adapters: list[str] = field(default_factory=list)

    def check_adapter(self, adapter_key: str | None) -> AddResult:
        if adapter_key is None or adapter_key in self.adapters:
            return AddResult.OK
        if len(self.adapters) >= self.max_adapters:
            return AddResult.NO_ADAPTER_SLOT
        if self.resident is not None and adapter_key not in self.resident:
            if adapter_key not in self.wanted_adapters:
                self.wanted_adapters.append(adapter_key)
            return AddResult.NO_ADAPTER_SLOT
        return AddResult.OK

    def check_admit(self, adapter_key: str | None, num_blocks: int, headroom: int) -> AddResult:
        """May a waiting request needing `num_blocks` for its uncached tokens start?"""
        if self.num_seqs_left < 1:
            return AddResult.NO_SEQS
        if self.num_tokens_left < 1:
            return AddResult.NO_TOKENS
        if num_blocks + headroom > self.num_admittable_blocks:
            return AddResult.NO_BLOCKS
        return self.check_adapter(adapter_key)

    def admit(self, adapter_key: str | None, num_blocks: int) -> None:
        self.num_admittable_blocks -= num_blocks
        if adapter_key is not None:
            self.adapters.add(adapter_key)

    def take(self, num_tokens: int) -> None:
        self.num_tokens_left -= num_tokens
        self.num_seqs_left -= 1
