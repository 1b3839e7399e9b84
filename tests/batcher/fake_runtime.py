"""A runtime without a model, for simulated-clock tests of the batcher.

It keeps real KV bookkeeping (gpu_runtime's `BlockManager`, chained hashes
with the adapter key) and "samples" a token that depends only on the
sequence's own tokens, so a request's output is the same whatever it is
batched with, preempted or not. `execute` advances a `SimClock` by a cost
model, so deadlines can be tested exactly.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from gpu_runtime.block_manager import BlockManager, block_hash
from gpu_runtime.errors import (
    ContextTooLongError,
    InvalidRequestError,
    OutOfBlocksError,
    SchedulingError,
)
from gpu_runtime.sequence import (
    SamplingParams,
    SeqOutput,
    Sequence,
    SequenceStatus,
    StepOutput,
    StepPlan,
)


class SimClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per step: fixed cost + per token computed."""

    step_s: float = 0.01
    token_s: float = 0.0005


class StepFailure(RuntimeError):
    """An injected failure attributable to one sequence."""

    code = "internal"

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"injected failure of {seq_id}")
        self.seq_id = seq_id


def fake_next_token(token_ids: Seq[int], vocab: int) -> int:
    h = 17
    for t in token_ids[-4:]:
        h = (h * 31 + t) % 1_000_003
    return (h + len(token_ids)) % vocab


def run_alone(
    prompt: Seq[int], max_tokens: int, vocab: int, stop: int | None, capacity: int = 1 << 30
) -> list[int]:
    """What the fake runtime generates for `prompt` alone (`capacity`: KV tokens)."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens and len(tokens) < capacity:
        t = fake_next_token(tokens, vocab)
        tokens.append(t)
        out.append(t)
        if t == stop:
            break
    return out


class FakeRuntime:
    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        *,
        clock: SimClock | None = None,
        cost: CostModel | None = None,
        vocab: int = 100,
        eos: int | None = None,
    ) -> None:
        self.block_manager = BlockManager(num_blocks, block_size)
        self.clock = clock or SimClock()
        self.cost = cost or CostModel()
        self.vocab = vocab
        self.eos = eos
        self.sequences: dict[str, Sequence] = {}
        self.plans: list[dict[str, int]] = []
        self.fail_seq: str | None = None  # raise StepFailure for it once
        self.fail_step = False  # raise a step-wide error once
        self.poison: str | None = None  # raise a step-wide error whenever it is in a step

    def num_cached_tokens(self, token_ids: Seq[int], adapter_key: str | None = None) -> int:
        return self.block_manager.num_cached_tokens(token_ids, adapter_key)

    def num_blocks_needed(self, num_scheduled_tokens: dict[str, int]) -> int:
        bm = self.block_manager
        return sum(
            bm.num_blocks_needed(
                self.sequences[i].block_table, self.sequences[i].num_computed_tokens + n
            )
            for i, n in num_scheduled_tokens.items()
        )

    def add_sequence(
        self,
        seq_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        adapter_key: str | None = None,
    ) -> int:
        params = params or SamplingParams()
        prompt = list(prompt_token_ids)
        if seq_id in self.sequences:
            raise InvalidRequestError(f"{seq_id} already running")
        if not prompt or any(not 0 <= t < self.vocab for t in prompt):
            raise InvalidRequestError("bad prompt")
        if len(prompt) >= self.block_manager.num_blocks * self.block_manager.block_size:
            raise ContextTooLongError("prompt too long")
        stops = frozenset() if self.eos is None else frozenset({self.eos})
        seq = Sequence(seq_id, prompt, len(prompt), params, adapter_key, stops)
        self.sequences[seq_id] = seq
        seq.num_cached_prompt_tokens = self._take_prefix(seq)
        return seq.num_cached_prompt_tokens

    def _take_prefix(self, seq: Sequence) -> int:
        bm = self.block_manager
        seq.block_table = bm.allocate_prefix(seq.token_ids, seq.adapter_key)
        seq.num_computed_tokens = len(seq.block_table) * bm.block_size
        seq.block_hashes = bm.prefix_hashes(
            seq.token_ids[: seq.num_computed_tokens], seq.adapter_key
        )
        return seq.num_computed_tokens

    def remove_sequence(self, seq_id: str) -> bool:
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq.block_table)
        return True

    def preempt(self, seq_id: str) -> None:
        seq = self.sequences[seq_id]
        self.block_manager.free(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0
        seq.status = SequenceStatus.PREEMPTED

    def resume(self, seq_id: str) -> int:
        seq = self.sequences[seq_id]
        if seq.status is not SequenceStatus.PREEMPTED:
            raise SchedulingError(f"{seq_id} not preempted")
        seq.status = SequenceStatus.RUNNING
        return self._take_prefix(seq)

    def execute(self, plan: StepPlan) -> StepOutput:
        counts = plan.num_scheduled_tokens
        for seq_id, n in counts.items():
            seq = self.sequences.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                raise SchedulingError(f"{seq_id} is not running")
            if not 1 <= n <= seq.num_uncomputed:
                raise SchedulingError(f"{seq_id}: {n} scheduled, {seq.num_uncomputed} left")
        if not self.block_manager.can_allocate(self.num_blocks_needed(counts)):
            raise OutOfBlocksError("out of blocks")
        if self.fail_seq in counts:
            seq_id, self.fail_seq = self.fail_seq, None
            raise StepFailure(seq_id)
        if self.fail_step:
            self.fail_step = False
            raise RuntimeError("injected device failure")
        if self.poison in counts:
            raise RuntimeError("injected fault on one request's data")
        self.plans.append(dict(counts))
        self.clock.advance(self.cost.step_s + self.cost.token_s * sum(counts.values()))
        outputs, computed = [], {}
        for seq_id, n in counts.items():
            seq = self.sequences[seq_id]
            sample = n == seq.num_uncomputed
            self.block_manager.append(seq.block_table, seq.num_computed_tokens + n)
            seq.num_computed_tokens += n
            self._cache_blocks(seq)
            computed[seq_id] = seq.num_computed_tokens
            if sample:
                outputs.append(self._sample(seq))
        return StepOutput(outputs, computed)

    def _cache_blocks(self, seq: Sequence) -> None:
        bm, bs = self.block_manager, self.block_manager.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens, seq.adapter_key)
            bm.cache_block(seq.block_table[i], h, tokens)
            seq.block_hashes.append(h)

    def _sample(self, seq: Sequence) -> SeqOutput:
        token = fake_next_token(seq.token_ids, self.vocab)
        seq.token_ids.append(token)
        reason = None
        if token in seq.stop_token_ids:
            reason = "stop"
        else:
            capacity = self.block_manager.num_blocks * self.block_manager.block_size
            if seq.num_generated >= seq.params.max_tokens or seq.num_tokens >= capacity:
                reason = "length"
        out = SeqOutput(
            seq.seq_id, token, reason is not None, reason, None,
            seq.num_cached_prompt_tokens, seq.num_generated,
        )  # fmt: skip
        if reason is not None:
            self.remove_sequence(seq.seq_id)
        return out

    def check_no_leaks(self) -> None:
        self.block_manager.check_invariants([s.block_table for s in self.sequences.values()])
