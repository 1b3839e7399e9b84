"""SequenceTable, the runtime's sequence and KV bookkeeping, with exact block ids: a
step reserves blocks and caches the ones it filled, a session's next turn finds them,
preemption frees them (full ones stay cached), and a bad plan changes nothing."""

from __future__ import annotations

import pytest

from gpu_runtime import BlockManager
from gpu_runtime.errors import OutOfBlocksError, SchedulingError
from gpu_runtime.sequence import SamplingParams, Sequence, SequenceStatus, StepPlan
from gpu_runtime.sequences import SequenceTable


def _seq(seq_id: str, tokens: list[int], adapter: str | None = None) -> Sequence:
    return Sequence(seq_id, list(tokens), len(tokens), SamplingParams(), adapter, frozenset())


def _run(table: SequenceTable, seq_id: str) -> None:
    """Compute every token of `seq_id` in one step, as the runtime's execute does."""
    plan = StepPlan({seq_id: table.sequences[seq_id].num_uncomputed})
    for seq, n in table.check_plan(plan):
        table.reserve(seq, n)
        table.computed(seq, n)


def test_a_turn_caches_its_full_blocks_and_the_next_turn_finds_them() -> None:
    table = SequenceTable(BlockManager(num_blocks=8, block_size=4))
    first = list(range(10))
    assert table.add(_seq("t1", first)) == 0
    _run(table, "t1")
    assert table.sequences["t1"].block_table == [0, 1, 2]
    assert len(table.sequences["t1"].block_hashes) == 2  # block 2 holds only 2 tokens
    assert table.remove("t1") and not table.remove("t1")
    assert table.add(_seq("t2", [*first, 10, 11])) == 8  # blocks 0 and 1, found again
    assert table.sequences["t2"].block_table == [0, 1]
    assert table.add(_seq("other", [*first, 10, 11], adapter="a")) == 0  # adapters never share
    table.check_invariants()


def test_preempt_frees_blocks_and_resume_finds_the_full_ones() -> None:
    table = SequenceTable(BlockManager(num_blocks=8, block_size=4))
    table.add(_seq("s", list(range(9))))
    _run(table, "s")
    assert table.block_manager.num_free_blocks == 5
    table.preempt("s")
    seq = table.sequences["s"]
    assert seq.status is SequenceStatus.PREEMPTED and seq.block_table == []
    with pytest.raises(SchedulingError):
        table.check_plan(StepPlan({"s": 1}))
    assert table.resume("s") == 8
    with pytest.raises(SchedulingError):
        table.resume("s")
    table.check_invariants()


def test_a_plan_that_cannot_run_changes_nothing() -> None:
    table = SequenceTable(BlockManager(num_blocks=2, block_size=4))
    table.add(_seq("big", list(range(12))))
    free = table.block_manager.num_free_blocks
    assert table.num_blocks_needed({"big": 12}) == 3 and not table.can_schedule({"big": 12})
    with pytest.raises(OutOfBlocksError):
        table.check_plan(StepPlan({"big": 12}))
    with pytest.raises(SchedulingError):
        table.check_plan(StepPlan({"big": 13}))  # more tokens than it has
    with pytest.raises(SchedulingError):
        table.check_plan(StepPlan({"ghost": 1}))
    assert table.block_manager.num_free_blocks == free
    assert table.sequences["big"].num_computed_tokens == 0
