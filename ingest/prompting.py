"""From a request's `messages` / `prompt` / `prompt_token_ids` to token ids.

- `prompt_token_ids` are taken as they are (checked against the vocabulary).
- `prompt` is what the model's tokenizer makes of the text with its own
  post-processor (what `tokenizer(text)` gives in transformers): a bos only where
  the tokenizer adds one.
- `messages` are rendered with the model's own chat template (`chat_template.py`)
  and tokenized as transformers' `apply_chat_template` does; the ids of an answer
  this worker generated are kept when the conversation comes back (`turns.py`).
  A model without a template gets sluice's plain framing (`frame_message`), each
  message tokenized on its own after the bos of config.json.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from ingest.chat_template import ChatTemplate, ChatTemplateError
from ingest.turns import ChatPrompt, RememberedTurn, TurnMemory, conversation_key, splice
from schemas import InferenceRequest


class PromptError(ValueError):
    """The request's prompt cannot be turned into token ids for this model."""


def frame_message(role: str, content: str) -> str:
    """One chat message as a model without a chat template sees it."""
    return f"<|{role}|>\n{content}\n"


ASSISTANT_PREFIX = "<|assistant|>\n"


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    chat: ChatPrompt | None = None  # a templated chat prompt, for the next turn to find


@dataclass(slots=True)
class PromptBuilder:
    tokenizer: Tokenizer | None
    vocab_size: int
    bos_token_id: int | None = None  # the plain framing's first id (config.json)
    template: ChatTemplate | None = None
    template_problem: str | None = None  # a template that could not be loaded
    turns: TurnMemory = field(default_factory=TurnMemory)

    @classmethod
    def for_model(cls, model_dir: str | Path, tokenizer: Tokenizer | None,
                  vocab_size: int) -> PromptBuilder:
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        bos = config.get("bos_token_id")
        try:
            template, problem = ChatTemplate.from_dir(model_dir), None
        except ChatTemplateError as exc:
            template, problem = None, str(exc)
        return cls(tokenizer, vocab_size, bos if isinstance(bos, int) else None,
                   template, problem)

    def token_ids(self, request: InferenceRequest) -> list[int]:
        return self.build(request).token_ids

    def build(self, request: InferenceRequest) -> Prompt:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise PromptError(
                    f"prompt_token_ids holds {bad}, outside the vocabulary (size {self.vocab_size})"
                )
            return Prompt(ids)
        if request.prompt is not None:
            return Prompt(self.text_ids(request.prompt))
        messages = [(m.role, m.text) for m in request.messages or []]
        return self.chat(messages, request.adapter)

    def text_ids(self, text: str) -> list[int]:
        """A plain-text prompt, as the tokenizer (and its post-processor) makes it."""
        return self._tokenizer().encode(text, add_special_tokens=True).ids

    def chat(self, messages: Sequence[tuple[str, str]], adapter: str | None = None) -> Prompt:
        tokenizer = self._tokenizer()
        if self.template_problem is not None:
            raise PromptError(f"this model's chat template cannot be used: "
                              f"{self.template_problem}")
        if self.template is None:
            ids = [self.bos_token_id] if self.bos_token_id is not None else []
            for role, content in messages:
                ids += tokenizer.encode(frame_message(role, content),
                                        add_special_tokens=False).ids
            return Prompt(ids + tokenizer.encode(ASSISTANT_PREFIX, add_special_tokens=False).ids)
        try:
            text = self.template.render([{"role": r, "content": c} for r, c in messages])
        except ChatTemplateError as exc:
            raise PromptError(str(exc)) from None
        encoding = tokenizer.encode(text, add_special_tokens=False)
        ids = encoding.ids
        last_answer = next((i for i in range(len(messages) - 1, -1, -1)
                            if messages[i][0] == "assistant"), None)
        if last_answer is not None:
            turn = self.turns.get(conversation_key(adapter, messages[:last_answer]))
            if turn is not None and turn.answer == messages[last_answer][1]:
                ids = splice(text, ids, encoding.offsets, turn) or ids
        key = conversation_key(adapter, messages)
        return Prompt(ids, ChatPrompt(key, text, tuple(ids)))

    def remember(self, chat: ChatPrompt, generated: Sequence[int], answer: str,
                 stop_token_ids: Sequence[int]) -> None:
        """A templated chat's answer, for its next turn: the generated ids that make
        `answer` (the end-of-turn token, which the template writes itself, left out)."""
        ids = list(generated)
        if ids and ids[-1] in stop_token_ids:
            ids.pop()
        tokenizer = self.tokenizer
        if tokenizer is None or tokenizer.decode(ids, skip_special_tokens=False) != answer:
            return  # the ids do not spell the answer as sent: nothing safe to reuse
        self.turns.put(chat.key, RememberedTurn(chat.text, array("l", chat.token_ids),
                                                array("l", ids), answer))

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise PromptError(
                "this model has no tokenizer.json; send prompt_token_ids instead of text")
        return self.tokenizer
