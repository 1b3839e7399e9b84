"""What each chat turn generated, so that the next turn finds it in the KV cache.

Turn n+1 of a conversation carries turn n's answer back as text inside
`messages`. Rendered and tokenized again, that text need not give the ids the
model generated (a tokenizer may split the same characters differently), and
the chained block hashes of the KV cache would stop matching at the first
difference. So the worker remembers, per conversation, the prompt it rendered
(text and ids) and the ids it generated; when a new prompt's text starts with
that prompt and that answer, the new prompt's ids start with the remembered
ids, and only the text after the answer is taken from the new tokenization.
Where nothing is remembered (another worker served turn n, or it was evicted)
the prompt is the plain tokenization: nothing is wrong, only less is reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import orjson


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat prompt, as the next turn of its conversation will look for it."""

    key: bytes  # the conversation so far (adapter and messages)
    text: str  # the rendered prompt
    token_ids: tuple[int, ...]


def conversation_key(adapter: str | None, messages: Sequence[tuple[str, str]]) -> bytes:
    """A digest of the conversation: (role, content) pairs, under one adapter."""
    raw = orjson.dumps([adapter, [list(m) for m in messages]])
    return hashlib.blake2b(raw, digest_size=16).digest()


@dataclass(slots=True)
class RememberedTurn:
    prompt_text: str
    prompt_ids: array
    answer_ids: array  # the generated ids that decode to `answer`
    answer: str

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.answer_ids)


class TurnMemory:
    """The latest turns served, least recently used evicted past `max_tokens`."""

    def __init__(self, max_tokens: int = 2_000_000):
        self.max_tokens = max_tokens
        self._turns: OrderedDict[bytes, RememberedTurn] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._turns)

    def put(self, key: bytes, turn: RememberedTurn) -> None:
        old = self._turns.pop(key, None)
        if old is not None:
            self._tokens -= old.num_tokens
        if turn.num_tokens > self.max_tokens:
            return
        self._turns[key] = turn
        self._tokens += turn.num_tokens
        while self._tokens > self.max_tokens:
            _, evicted = self._turns.popitem(last=False)
            self._tokens -= evicted.num_tokens

    def get(self, key: bytes) -> RememberedTurn | None:
        turn = self._turns.get(key)
        if turn is not None:
            self._turns.move_to_end(key)
        return turn


def splice(text: str, ids: list[int], offsets: Sequence[tuple[int, int]],
           turn: RememberedTurn) -> list[int] | None:
    """The ids of `text` (tokenized as `ids` with character `offsets`) with the
    remembered turn's prompt and answer ids in front, or None when `text` does not
    continue that turn exactly or no token boundary falls where its answer ends."""
    start = len(turn.prompt_text)
    end = start + len(turn.answer)
    if not text.startswith(turn.prompt_text) or text[start:end] != turn.answer:
        return None
    rest = next((i for i, (s, _) in enumerate(offsets) if s >= end), len(ids))
    if any(e > end for _, e in offsets[:rest]):
        return None  # a token spans the answer's end
    return [*turn.prompt_ids, *turn.answer_ids, *ids[rest:]]
