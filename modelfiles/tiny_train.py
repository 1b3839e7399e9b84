"""Teach the tiny model (and LoRA adapters of it) a few lines, so the demo reads as text.

A random-weight model streams noise. `train_tiny_model` fits the tiny model to
a short chat — the demo's three questions and an answer to each, framed
exactly as `ingest.prompting` frames a request's messages — plus a few plain
lines, by next-token prediction with Adam through the runtime's own model
code (each step is one ragged prefill of every training sequence).
`train_tiny_adapter` then trains a rank-r LoRA on every projection of the
frozen base so the same questions get another voice's answers, and writes it
in PEFT format. It memorises; it does not generalise. Used by `sluice demo` and
`sluice models make-tiny --train-steps`.

Teaching runs on one torch thread. Its tensors are tiny (64 wide, ~1,500 tokens a
step), so a second thread gains nothing, and on two cores that are busy with
something else as well (the demo starts the broker beside it) two threads'
spin-waits lose to each other. Measured on a 2-core EPYC shared with other work:
the whole teaching 8.4 s on one thread, 8.9 s on two (load average ~1.8); one
step 40 ms on one thread, 390 ms on two (load average ~6). One thread also fixes
the order of every float sum, so a machine teaches the same weights each time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from gpu_runtime.config import ModelConfig
from gpu_runtime.loader import load_model
from gpu_runtime.lora_format import CONFIG_FILE, PROJECTIONS, WEIGHTS_FILE
from gpu_runtime.model import CausalLM
from gpu_runtime.runner import ModelRunner, ScheduledSeq
from ingest.prompting import ASSISTANT_PREFIX, frame_message

SYSTEM = "You answer in one short line."
QUESTIONS = (
    "Where does the river begin?",
    "What lives along its banks?",
    "How does the water reach the sea?",
)
BASE_ANSWERS = (
    "High in the hills, where the snow melts.",
    "Reeds, frogs and a quiet heron.",
    "It runs down the valley to the bay.",
)
# Adapter name -> its answers to QUESTIONS: the same base, other voices.
VOICES: dict[str, tuple[str, ...]] = {
    "terse": ("The hills.", "Reeds.", "Downhill."),
    "poet": ("From snow, the river is born.", "Reeds sway; a heron waits.",
             "It sings down to the bay."),
    "sailor": ("Up in the hills, arr!", "Frogs and reeds, arr.", "Down to the bay, arr!"),
}
LINES = (
    "The river runs from the hills to the sea.",
    "Requests arrive on Kafka topics and tokens stream back to the reply topic.",
)

OnStep = Callable[[int, float], None]


def training_sequences(tokenizer: Tokenizer, answers: Sequence[str],
                       lines: Sequence[str] = ()) -> list[tuple[list[int], int]]:
    """(token ids, index of the first token to learn) per sequence: every turn of
    the chat (its history, the question — given — then the answer, learned), then
    the plain lines (learned whole). An answer ends with its line's newline, as it
    does when it comes back as history, so a request that stops at "\n" gets it."""
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    sequences = []
    history = [bos, *encode(frame_message("system", SYSTEM))]
    for question, answer in zip(QUESTIONS, answers, strict=True):
        history += encode(frame_message("user", question))
        prompt = [*history, *encode(ASSISTANT_PREFIX)]
        sequences.append(([*prompt, *encode(answer + "\n")], len(prompt)))
        history += encode(frame_message("assistant", answer))
    sequences += [([bos, *encode(line), eos], 1) for line in lines]
    return sequences


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the block (see the module docstring)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@_one_thread()
def _fit(model: CausalLM, params: list[nn.Parameter],
         sequences: list[tuple[list[int], int]], steps: int, lr: float,
         on_step: OnStep | None) -> float:
    """Adam on next-token cross-entropy over the learned tokens of all `sequences`
    at once; returns the last loss."""
    block = 16
    tables, first = [], 0
    for seq, _ in sequences:
        n = -(-len(seq) // block)
        tables.append(list(range(first, first + n)))
        first += n
    runner = ModelRunner(model, first, block, max(len(s) for s, _ in sequences))
    scheduled = [ScheduledSeq(s[:-1], 0, t) for (s, _), t in zip(sequences, tables, strict=True)]
    # Row j of a sequence predicts token j + 1; the given tokens are not learned.
    targets = torch.tensor([t if j + 1 >= learn_from else -100 for s, learn_from in sequences
                            for j, t in enumerate(s[1:])])
    optimizer = torch.optim.Adam(params, lr=lr)
    # Linear decay to zero: the last steps settle instead of bouncing at full rate.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    loss_value = float("nan")
    for step in range(steps):
        # Fresh caches: the step writes K/V into them, which must not chain steps' graphs.
        runner.kv_caches = [torch.zeros_like(kv) for kv in runner.kv_caches]
        input_ids, ctx, _ = runner.build_context(scheduled)
        logits = model.compute_logits(model(input_ids, ctx))
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        if on_step is not None:
            on_step(step, loss_value)
    return loss_value


def _load(model_dir: Path) -> tuple[CausalLM, ModelConfig, Tokenizer]:
    config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return load_model(model_dir, config, torch.float32, "cpu"), config, tokenizer


def train_tiny_model(model_dir: str | Path, steps: int = 150, seed: int = 0,
                     on_step: OnStep | None = None) -> float:
    """Fit the model in `model_dir` to the base answers and rewrite its weights.

    Returns the final training loss (mean cross-entropy per predicted token).
    """
    model_dir = Path(model_dir)
    torch.manual_seed(seed)
    model, config, tokenizer = _load(model_dir)
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    # The voices' answers as plain lines too: a base that has produced every word
    # lets a small adapter steer between them (it could not lift a word whose
    # output row the base never trained).
    lines = [*LINES, *(answer for answers in VOICES.values() for answer in answers)]
    loss = _fit(model, params, training_sequences(tokenizer, BASE_ANSWERS, lines), steps,
                1e-2, on_step)
    state = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(model_dir / "model.safetensors"))
    return loss


class _TrainableLora(nn.Module):
    """base(x) + x A^T B^T: the LoRA term PEFT defines, at scale 1 (alpha = r)."""

    def __init__(self, base: nn.Module, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(
            torch.randn(rank, base.in_features, generator=generator) / base.in_features**0.5)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor, ctx: object = None) -> torch.Tensor:
        return self.base(x, ctx) + (x @ self.lora_a.t()) @ self.lora_b.t()


def train_tiny_adapter(model_dir: str | Path, out_dir: str | Path, answers: Sequence[str],
                       rank: int = 8, steps: int = 100, lr: float = 2e-2, seed: int = 0,
                       on_step: OnStep | None = None) -> float:
    """Train a LoRA (all seven projections, rank `rank`) of the frozen model in
    `model_dir` to give `answers`; write it to `out_dir` in PEFT format.

    lr 2e-2: at 1e-2 the sailor's second answer came out as its third (seed 0); at
    2e-2 every voice gave all three of its answers on seeds 0, 1 and 2."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    generator = torch.Generator().manual_seed(seed)
    model, _, tokenizer = _load(model_dir)
    wrapped: dict[str, _TrainableLora] = {}
    for i, layer in enumerate(model.model.layers):
        for proj in PROJECTIONS:
            group_name = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            group = getattr(layer, group_name)
            lora = _TrainableLora(getattr(group, proj), rank, generator)
            setattr(group, proj, lora)
            wrapped[f"base_model.model.model.layers.{i}.{group_name}.{proj}"] = lora
    params = [p for lora in wrapped.values() for p in (lora.lora_a, lora.lora_b)]
    loss = _fit(model, params, training_sequences(tokenizer, answers), steps, lr, on_step)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    for prefix, lora in wrapped.items():
        state[f"{prefix}.lora_A.weight"] = lora.lora_a.detach().contiguous()
        state[f"{prefix}.lora_B.weight"] = lora.lora_b.detach().contiguous()
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "target_modules": list(PROJECTIONS), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": str(model_dir.resolve()),
    }  # fmt: skip
    (out_dir / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return loss
