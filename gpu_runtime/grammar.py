"""Constrained decoding: JSON output (`response_format`) as a per-row token mask.

llguidance, chosen by measurement (benchmarks/README.md): no dependencies, its
tokenizer info comes straight from the model's `tokenizers` JSON with special
tokens excluded, a schema compiles in ~1 ms, and a row's mask fills in ~8 µs.
A request's grammar is compiled once (`Grammars.compile`, off the step thread,
cached); each constrained sequence holds its own matcher. In a step, only the
constrained rows are masked (tokens the grammar forbids at -inf), so
constrained and free requests share steps; after sampling, each matcher takes
its row's token, and a matcher that has stopped (only the end could follow)
ends its sequence.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import torch

from gpu_runtime.errors import InvalidSequenceError

# At most this many whitespace characters between JSON tokens: a model may not pad
# its way to max_tokens.
WHITESPACE = r"[ \n]{0,8}"


class GrammarError(InvalidSequenceError):
    """A response_format that cannot be compiled (an invalid or unsupported schema)."""


class Grammars:
    """Compiles response formats against one model's tokenizer; makes matchers."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._lltok: Any = None

    def _tokenizer(self) -> Any:
        import llguidance

        with self._lock:  # built once per model (~0.25 s for a 49k vocabulary)
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos)
            return self._lltok

    def compile(self, response_format: dict[str, Any]) -> str | None:
        """The grammar of an OpenAI-style response_format (None for plain text);
        GrammarError when it cannot be served."""
        return _compile(self, orjson.dumps(response_format, option=orjson.OPT_SORT_KEYS))

    def matcher(self, grammar: str) -> Any:
        import llguidance

        return llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)


@functools.lru_cache(maxsize=256)
def _compile(grammars: Grammars, key: bytes) -> str | None:
    import llguidance

    response_format = orjson.loads(key)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "lark":  # a grammar made elsewhere (a forced tool call's)
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(response_format["grammar"])
        except (ValueError, TypeError, KeyError) as exc:
            raise GrammarError(f"tool call grammar: {exc}") from None
        return _validated(grammar, grammars, "tool call grammar")
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError("response_format json_schema needs json_schema.schema, an object")
    else:
        raise GrammarError(f"response_format type {kind!r} is not one of text, json_object, "
                           "json_schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_pattern": WHITESPACE})
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"response_format schema: {exc}") from None
    return _validated(grammar, grammars, "response_format schema")


def _validated(grammar: str, grammars: Grammars, what: str) -> str:
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar, grammars._tokenizer())
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(f"{what}: {problem}")
    return grammar


def mask_rows(logits: torch.Tensor, matchers: Sequence[Any]) -> torch.Tensor:
    """`logits` [B, V] with each constrained row's forbidden tokens at -inf (a copy;
    rows whose matcher is None are left as they are)."""
    import llguidance.numpy

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bitmask = np.full((len(rows), (vocab + 31) // 32), -1, dtype=np.int32)
    for j, row in enumerate(rows):
        llguidance.numpy.fill_next_token_bitmask(matchers[row], bitmask, j)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = torch.from_numpy(allowed == 0).to(logits.device)
    masked = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    masked[index] = masked[index].masked_fill(forbidden, float("-inf"))
    return masked
