"""From a request's `messages` / `prompt` / `prompt_token_ids` to token ids.

Chat messages are tokenized one message at a time and the ids concatenated, so
the ids of a conversation's earlier turns are identical from one turn to the
next — which is what lets the KV cache's chained block hashes find them. A
model's own Jinja chat template is not used for that reason; the plain role
markers below frame each message instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from schemas import InferenceRequest


class PromptError(ValueError):
    """The request's prompt cannot be turned into token ids for this model."""


def frame_message(role: str, content: str) -> str:
    """One chat message as a model without a chat template sees it."""
    return f"<|{role}|>\n{content}\n"


ASSISTANT_PREFIX = "<|assistant|>\n"


@dataclass(slots=True)
class PromptBuilder:
    tokenizer: Tokenizer | None
    vocab_size: int
    bos_token_id: int | None = None

    @classmethod
    def for_model(cls, model_dir: str | Path, tokenizer: Tokenizer | None,
                  vocab_size: int) -> PromptBuilder:
        """Reads the beginning-of-sequence id from the model's config.json."""
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        bos = config.get("bos_token_id")
        return cls(tokenizer, vocab_size, bos if isinstance(bos, int) else None)

    def token_ids(self, request: InferenceRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise PromptError(
                    f"prompt_token_ids holds {bad}, outside the vocabulary (size {self.vocab_size})"
                )
            return ids
        if self.tokenizer is None:
            raise PromptError(
                "this model has no tokenizer.json; send prompt_token_ids instead of text"
            )
        if request.prompt is not None:
            return self.text_ids(request.prompt)
        ids = [self.bos_token_id] if self.bos_token_id is not None else []
        for message in request.messages or []:
            ids += self._encode(frame_message(message.role, message.content))
        return ids + self._encode(ASSISTANT_PREFIX)

    def text_ids(self, text: str) -> list[int]:
        """A plain-text prompt: the model's beginning-of-sequence id, then the text."""
        if self.tokenizer is None:
            raise PromptError(
                "this model has no tokenizer.json; send prompt_token_ids instead of text"
            )
        prefix = [self.bos_token_id] if self.bos_token_id is not None else []
        return prefix + self._encode(text)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids  # type: ignore[union-attr]
