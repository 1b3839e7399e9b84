"""Plain data exchanged with the batcher: sampling params, sequences, plans, outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` disable those
    filters. `stop_token_ids=None` means the model's eos ids (from
    generation_config.json / config.json); `ignore_eos` drops them.
    """

    max_tokens: int = 16
    # False when max_tokens is only a default nobody asked for: then a prompt near the
    # context's end gets what room is left; an asked-for max_tokens that does not fit
    # is refused (`ContextTooLongError`), never cut short in silence.
    max_tokens_asked: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Changes to the logits before sampling (`penalties.py`); the defaults change nothing.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # None: no log probabilities; k: the sampled token's and the k most likely, from the
    # model's distribution (log-softmax of the raw logits, before temperature/top-k/p).
    logprobs: int | None = None
    # A compiled output grammar (`Runtime.grammars.compile`): tokens it forbids are
    # never sampled, and the sequence ends when it is complete.
    grammar: str | None = None


class SequenceStatus(enum.Enum):
    RUNNING = "running"  # holds blocks; may be scheduled
    PREEMPTED = "preempted"  # blocks freed; `resume` before scheduling again


@dataclass(slots=True)
class Sequence:
    """All runtime state of one request."""

    seq_id: str
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    params: SamplingParams
    adapter_key: str | None
    stop_token_ids: frozenset[int]
    status: SequenceStatus = SequenceStatus.RUNNING
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the blocks cached so far
    generator: torch.Generator | None = None  # per-request RNG when `params.seed` is set
    matcher: Any = None  # the grammar's state, when `params.grammar` is set

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Per sequence id, how many of its not-yet-computed tokens to compute this step.

    A sequence whose count reaches the end of its known tokens is sampled.
    `return_logits` adds each sampled row's float32 logits to the output (tests).
    """

    num_scheduled_tokens: dict[str, int]
    return_logits: bool = False


@dataclass(frozen=True, slots=True)
class SeqOutput:
    seq_id: str
    token_id: int
    finished: bool
    finish_reason: str | None  # "stop" | "length" | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    logprob: float | None = None  # of the sampled token, when asked for
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the k most likely (id, logprob)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Sampled tokens of the sequences that reached the end of their known tokens.

    Finished sequences are already removed from the runtime (blocks freed, full
    blocks kept cached for reuse). `num_computed_tokens` covers every scheduled one.
    """

    outputs: list[SeqOutput]
    num_computed_tokens: dict[str, int]
    logits: dict[str, torch.Tensor] | None = None  # seq_id -> [vocab] float32
