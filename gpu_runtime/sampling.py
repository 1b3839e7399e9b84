"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

One set of tensor ops for the whole batch. Sampling uses the exponential race
(argmax of p / E with E ~ Exp(1), equivalent to drawing from p) so that the
only per-row work is filling a seeded row's noise from that request's own
`torch.Generator`: a seeded request draws the same tokens whatever else shares
its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Argmax = Callable[[torch.Tensor], torch.Tensor]  # [B, V] float32 -> [B] int64, first maximum


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass(slots=True)
class SamplingBatch:
    # None when every row is greedy (sample needs none of them: three tensors a step saved)
    temperatures: torch.Tensor | None  # [B] float32, 0 = greedy
    top_ks: torch.Tensor | None  # [B] int64, 0 = off
    top_ps: torch.Tensor | None  # [B] float32, 1 = off
    generators: list[torch.Generator | None]  # per row; None = the shared generator
    all_greedy: bool
    any_filter: bool


def make_batch(
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    generators: list[torch.Generator | None],
    device: torch.device,
) -> SamplingBatch:
    if all(t == 0 for t in temperatures):
        return SamplingBatch(None, None, None, generators, all_greedy=True, any_filter=False)
    return SamplingBatch(
        temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
        top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
        top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
        generators=generators,
        all_greedy=False,
        any_filter=any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps),
    )


def _filter_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] -> [B, V] with tokens outside top-k / top-p set to -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(batch.top_ks > 0, batch.top_ks, vocab)[:, None]  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= batch.top_ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch, shared: torch.Generator,
           argmax: Argmax = torch_argmax) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B] int64. `argmax` may be a faster one with
    torch's rule (the CPU kernel's, `NativeDecoder.argmax`)."""
    greedy_ids = argmax(logits)
    if batch.all_greedy:
        return greedy_ids
    greedy = batch.temperatures == 0
    temps = torch.where(greedy, 1.0, batch.temperatures)[:, None]  # [B, 1]
    logits = logits / temps
    if batch.any_filter:
        logits = _filter_top_k_top_p(logits, batch)
    probs = logits.softmax(dim=-1)  # [B, V]
    noise = torch.empty_like(probs).exponential_(generator=shared)
    for row, gen in enumerate(batch.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    sampled = argmax(probs / noise)
    return torch.where(greedy, greedy_ids, sampled)
