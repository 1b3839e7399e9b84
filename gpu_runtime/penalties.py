"""Per-row changes to the logits before sampling: penalties, biases, a minimum length.

Only the rows that ask are touched (a copy of the logits is made once, when any
row does), so the other requests of a step sample from the model's own logits;
log probabilities stay those of the model's distribution.

- `repetition_penalty` (transformers' rule): every token seen in the prompt or the
  output has its logit divided by the penalty when positive, multiplied when not;
- `presence_penalty` / `frequency_penalty` (OpenAI's rule): each token already
  generated loses `presence` once and `frequency` per time it was generated;
- `logit_bias`: added to the named tokens' logits;
- `min_tokens`: the end-of-sequence tokens are forbidden until that many tokens are
  generated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_runtime.sequence import Sequence as Seq


def needs_processing(seq: Seq) -> bool:
    p = seq.params
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or p.logit_bias or (p.min_tokens and seq.num_generated < p.min_tokens))


def process(logits: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
    """`logits` [B, V] with each asking row's changes applied (a copy; unchanged when no
    row asks)."""
    rows = [i for i, s in enumerate(seqs) if needs_processing(s)]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for row in rows:
        seq, p = seqs[row], seqs[row].params
        line = out[row]  # [V], a view
        generated = torch.tensor(seq.token_ids[seq.num_prompt_tokens:], dtype=torch.long,
                                 device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long,
                                device=logits.device)
            values = line[seen]
            line[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                     values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and generated.numel():
            counts = torch.bincount(generated, minlength=vocab)[:vocab].to(line.dtype)
            line -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long,
                               device=logits.device)
            line[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=line.dtype,
                                      device=logits.device)
        if p.min_tokens and seq.num_generated < p.min_tokens and seq.stop_token_ids:
            line[torch.tensor(sorted(seq.stop_token_ids), device=logits.device)] = float("-inf")
    return out
