"""Penalties, biases and min_tokens change only the rows that ask, by the rules of
transformers (repetition) and OpenAI (presence, frequency, logit_bias)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from gpu_runtime.penalties import process
from gpu_runtime.sequence import SamplingParams, Sequence


def _seq(prompt: list[int], generated: list[int], **params: object) -> Sequence:
    return Sequence("s", prompt + generated, len(prompt), SamplingParams(**params), None,
                    frozenset({0}))


def test_rows_that_do_not_ask_are_untouched() -> None:
    logits = torch.randn(2, 10)
    assert process(logits, [_seq([1], [2]), _seq([3], [])]) is logits
    out = process(logits, [_seq([1], [2]), _seq([3], [4], logit_bias=((5, 2.0),))])
    assert torch.equal(out[0], logits[0]) and out[1, 5] == logits[1, 5] + 2


def test_repetition_penalty_is_transformers_rule() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 32)
    prompt, generated = [3, 7, 7, 12], [20, 3]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor([prompt + generated]), logits.clone())
    got = process(logits, [_seq(prompt, generated, repetition_penalty=1.3)])
    assert torch.allclose(got, expected)


def test_presence_and_frequency_follow_openai() -> None:
    logits = torch.zeros(1, 8)
    got = process(logits, [_seq([5, 6], [1, 1, 2], presence_penalty=0.5,
                                frequency_penalty=0.25)])
    # token 1: generated twice -> 0.5 + 2 * 0.25; token 2: once; prompt tokens untouched
    assert got[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_min_tokens_forbids_the_end_until_reached() -> None:
    logits = torch.zeros(1, 4)
    early = process(logits, [_seq([1], [2], min_tokens=3)])
    assert early[0, 0] == float("-inf") and early[0, 1:].eq(0).all()
    assert process(logits, [_seq([1], [2, 3, 2], min_tokens=3)]) is logits
