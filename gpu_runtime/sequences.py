"""The runtime's sequences and their KV blocks, without a model.

Admission finds a sequence's cached prefix (chained block hashes, the
adapter as an extra key); a step appends blocks for the tokens it computes
and caches every block that became full; preemption frees the blocks (full
ones stay cached for its resume); removal frees the rest. Check-then-act: a
plan that cannot run raises before anything changes. `Runtime` keeps its
sequences here, and so does the batcher's fake runtime in the tests, so both
agree on blocks by construction.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpu_runtime.block_manager import BlockManager, block_hash
from gpu_runtime.errors import OutOfBlocksError, SchedulingError
from gpu_runtime.sequence import Sequence, SequenceStatus, StepPlan


class SequenceTable:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.sequences: dict[str, Sequence] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.sequences

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.sequences.values())

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    # ---- lifecycle ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> int:
        """Hold `seq` (validated by the caller); returns its prompt tokens found cached."""
        self.sequences[seq.seq_id] = seq
        seq.num_cached_prompt_tokens = self._take_cached_prefix(seq)
        return seq.num_cached_prompt_tokens

    def remove(self, seq_id: str) -> bool:
        """Drop a sequence (finished, cancelled, timed out); its full blocks stay cached."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq.block_table)
        return True

    def preempt(self, seq_id: str) -> None:
        """Free a sequence's blocks but keep its state; `resume` it later."""
        seq = self.sequences[seq_id]
        self.block_manager.free(seq.block_table)
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED

    def resume(self, seq_id: str) -> int:
        """Re-admit a preempted sequence; returns its tokens found in the cache."""
        seq = self.sequences[seq_id]
        if seq.status is not SequenceStatus.PREEMPTED:
            raise SchedulingError(f"sequence {seq_id!r} is not preempted")
        seq.status = SequenceStatus.RUNNING
        return self._take_cached_prefix(seq)

    def _take_cached_prefix(self, seq: Sequence) -> int:
        bm = self.block_manager
        seq.block_table = bm.allocate_prefix(seq.token_ids, seq.adapter_key)
        seq.num_computed_tokens = len(seq.block_table) * bm.block_size
        seq.block_hashes = bm.prefix_hashes(
            seq.token_ids[: seq.num_computed_tokens], seq.adapter_key
        )
        return seq.num_computed_tokens

    # ---- a step ---------------------------------------------------------------------------

    def num_blocks_needed(self, num_scheduled_tokens: dict[str, int]) -> int:
        """New KV blocks a plan with these counts would take."""
        bm = self.block_manager
        return sum(
            bm.num_blocks_needed(s.block_table, s.num_computed_tokens + n)
            for s, n in ((self.sequences[i], n) for i, n in num_scheduled_tokens.items())
        )

    def can_schedule(self, num_scheduled_tokens: dict[str, int]) -> bool:
        return self.block_manager.can_allocate(self.num_blocks_needed(num_scheduled_tokens))

    def check_plan(self, plan: StepPlan) -> list[tuple[Sequence, int]]:
        """The plan's (sequence, tokens) pairs; raises if it cannot run as given."""
        work = []
        for seq_id, n in plan.num_scheduled_tokens.items():
            seq = self.sequences.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                raise SchedulingError(f"sequence {seq_id!r} is not running")
            if not 1 <= n <= seq.num_uncomputed:
                raise SchedulingError(
                    f"{seq_id!r}: {n} tokens scheduled, {seq.num_uncomputed} left"
                )
            work.append((seq, n))
        needed = self.num_blocks_needed(plan.num_scheduled_tokens)
        if not self.block_manager.can_allocate(needed):
            raise OutOfBlocksError(
                f"plan needs {needed} blocks, {self.block_manager.num_free_blocks} free"
            )
        return work

    def reserve(self, seq: Sequence, n: int) -> None:
        """Blocks for `n` more tokens of `seq`, before the step computes them."""
        self.block_manager.append(seq.block_table, seq.num_computed_tokens + n)

    def computed(self, seq: Sequence, n: int) -> None:
        """`n` more tokens of `seq` are in the KV cache: cache every block now full."""
        seq.num_computed_tokens += n
        bm, bs = self.block_manager, self.block_manager.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens, seq.adapter_key)
            bm.cache_block(seq.block_table[i], h, tokens)
            seq.block_hashes.append(h)

    def check_invariants(self) -> None:
        self.block_manager.check_invariants([s.block_table for s in self.sequences.values()])
