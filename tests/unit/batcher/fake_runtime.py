"""A runtime without a model, for simulated-clock tests of the batcher.

Its KV bookkeeping is the real runtime's own (`gpu_runtime.sequences.SequenceTable`:
blocks, chained hashes with the adapter key, preemption), so the batcher's tests
cannot drift from it; it "samples" a token that depends only on the sequence's
own tokens, so a request's output is the same whatever it is batched with,
preempted or not. `execute` advances a `SimClock` by a cost model, so deadlines
can be tested exactly.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from gpu_runtime.block_manager import BlockManager
from gpu_runtime.errors import ContextTooLongError, InvalidSequenceError
from gpu_runtime.sequence import SamplingParams, SeqOutput, Sequence, StepOutput, StepPlan
from gpu_runtime.sequences import SequenceTable


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
        self.table = SequenceTable(BlockManager(num_blocks, block_size))
        self.clock = clock or SimClock()
        self.cost = cost or CostModel()
        self.vocab = vocab
        self.eos = eos
        self.plans: list[dict[str, int]] = []
        self.fail_seq: str | None = None  # raise StepFailure for it once
        self.fail_step = False  # raise a step-wide error once
        self.poison: str | None = None  # raise a step-wide error whenever it is in a step

    @property
    def block_manager(self) -> BlockManager:
        return self.table.block_manager

    @property
    def sequences(self) -> dict[str, Sequence]:
        return self.table.sequences

    def num_cached_tokens(self, token_ids: Seq[int], adapter_key: str | None = None) -> int:
        return self.block_manager.num_cached_tokens(token_ids, adapter_key)

    def num_blocks_needed(self, num_scheduled_tokens: dict[str, int]) -> int:
        return self.table.num_blocks_needed(num_scheduled_tokens)

    def add_sequence(
        self,
        seq_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        adapter_key: str | None = None,
    ) -> int:
        params = params or SamplingParams()
        prompt = list(prompt_token_ids)
        if seq_id in self.table:
            raise InvalidSequenceError(f"{seq_id} already running")
        if not prompt or any(not 0 <= t < self.vocab for t in prompt):
            raise InvalidSequenceError("bad prompt")
        if len(prompt) >= self.table.capacity_tokens:
            raise ContextTooLongError("prompt too long")
        stops = frozenset() if self.eos is None else frozenset({self.eos})
        return self.table.add(Sequence(seq_id, prompt, len(prompt), params, adapter_key, stops))

    def remove_sequence(self, seq_id: str) -> bool:
        return self.table.remove(seq_id)

    def preempt(self, seq_id: str) -> None:
        self.table.preempt(seq_id)

    def resume(self, seq_id: str) -> int:
        return self.table.resume(seq_id)

    def execute(self, plan: StepPlan) -> StepOutput:
        work = self.table.check_plan(plan)
        counts = plan.num_scheduled_tokens
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
        for seq, n in work:
            sample = n == seq.num_uncomputed
            self.table.reserve(seq, n)
            self.table.computed(seq, n)
            computed[seq.seq_id] = seq.num_computed_tokens
            if sample:
                outputs.append(self._sample(seq))
        return StepOutput(outputs, computed)

    def _sample(self, seq: Sequence) -> SeqOutput:
        token = fake_next_token(seq.token_ids, self.vocab)
        seq.token_ids.append(token)
        reason = None
        if token in seq.stop_token_ids:
            reason = "stop"
        elif (seq.num_generated >= seq.params.max_tokens
              or seq.num_tokens >= self.table.capacity_tokens):
            reason = "length"
        out = SeqOutput(
            seq.seq_id, token, reason is not None, reason, None,
            seq.num_cached_prompt_tokens, seq.num_generated,
        )  # fmt: skip
        if reason is not None:
            self.remove_sequence(seq.seq_id)
        return out

    def check_no_leaks(self) -> None:
        self.table.check_invariants()
