"""What the batcher needs from the runtime, named exactly, as `typing.Protocol`s.

`gpu_runtime.Runtime` satisfies `RuntimePort` as it is; the tests' fake runtime
(simulated clock, fake tokens, the real `BlockManager`) satisfies it too. The
scheduler calls these on the event-loop thread, never while `execute` runs;
only `execute` (and adapter loading) runs in the engine's worker thread.

Contract the scheduler relies on:

- `add_sequence` validates; on error it raises an exception carrying a wire
  `code` attribute and changes nothing. It returns the prompt tokens found
  cached, which count as computed.
- `execute` removes sequences that finished (their blocks freed); a plan that
  does not fit raises and changes nothing.
- `preempt` frees a sequence's blocks but keeps its tokens; `resume` finds its
  cached prefix again and returns the tokens now computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpu_runtime.sequence import SamplingParams, StepOutput, StepPlan


class KvBlocksView(Protocol):
    """Read-only view of the paged KV cache's size."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...


class RuntimePort(Protocol):
    @property
    def block_manager(self) -> KvBlocksView: ...

    def num_cached_tokens(self, token_ids: Sequence[int], adapter_key: str | None = None) -> int:
        """Prompt tokens a request would find cached now. No side effects."""
        ...

    def num_blocks_needed(self, num_scheduled_tokens: dict[str, int]) -> int:
        """New blocks a plan with these per-sequence counts would take."""
        ...

    def add_sequence(
        self,
        seq_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        adapter_key: str | None = None,
    ) -> int: ...

    def remove_sequence(self, seq_id: str) -> bool: ...

    def preempt(self, seq_id: str) -> None: ...

    def resume(self, seq_id: str) -> int: ...

    def execute(self, plan: StepPlan) -> StepOutput: ...


class AdapterSlots(Protocol):
    """Which adapters are on the device, and loading more between steps.

    The scheduler admits a request only if its adapter is resident; the plan of
    each step lists the adapters the step uses (must stay loaded) and those that
    waiting requests want (load into free or unused slots, evicting only
    adapters the step does not use). Without an `AdapterSlots`, every adapter
    counts as resident and only `max_adapters_per_step` limits a step.
    """

    def resident_adapters(self) -> frozenset[str]: ...

    def load_adapters(self, wanted: Sequence[str], in_use: frozenset[str]) -> None: ...
