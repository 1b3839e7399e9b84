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

With `tools`, the template gets them as transformers passes them
(`apply_chat_template(messages, tools=...)`), and assistant messages with
`tool_calls` and `tool` messages reach it as transformers' dicts (arguments as
objects). A template that knows nothing of tools gets sluice's rendering instead
(`common.tool_formats`: the tools in the system message, calls and results written
into the messages' text, in the hermes format). The prompt says which call format
the model writes, so a forced call can be generated to fit it and any call parsed.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from common import tool_formats
from common.tool_formats import ToolFormat
from ingest.chat_template import ChatTemplate, ChatTemplateError
from ingest.turns import ChatPrompt, RememberedTurn, TurnMemory, conversation_key, splice
from schemas import ChatMessage, InferenceRequest, NamedToolChoice


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
    tool_format: ToolFormat | None = None  # how the model writes calls (tools asked for)


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
        fmt, native = tool_formats.detect(self.template.source if self.template else None)
        messages = [_as_dict(m, native) for m in request.messages or []]
        tools = None
        if request.calls_tools:
            assert request.tools is not None
            functions = [t.function.model_dump(exclude_none=True) for t in request.tools]
            if native:
                tools = [{"type": "function", "function": f} for f in functions]
            else:
                choice = request.tool_choice
                forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
                messages = _with_system(messages, tool_formats.fallback_system_prompt(
                    functions, forced))
        prompt = self.chat(messages, request.adapter, tools)
        if not request.calls_tools:
            return prompt
        return Prompt(prompt.token_ids, prompt.chat, fmt)

    def text_ids(self, text: str) -> list[int]:
        """A plain-text prompt, as the tokenizer (and its post-processor) makes it."""
        return self._tokenizer().encode(text, add_special_tokens=True).ids

    def chat(self, messages: Sequence[tuple[str, str]] | Sequence[dict[str, Any]],
             adapter: str | None = None, tools: list[dict[str, Any]] | None = None) -> Prompt:
        """A chat prompt: (role, content) pairs, or message dicts as a template takes
        them (tool calls and tool results included)."""
        tokenizer = self._tokenizer()
        if self.template_problem is not None:
            raise PromptError(f"this model's chat template cannot be used: "
                              f"{self.template_problem}")
        dicts = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]}
                 for m in messages]
        # What the turn memory keys on (a key that collides is harmless: a remembered
        # turn is used only where the rendered text starts with its prompt and answer).
        messages = [(str(m["role"]), str(m.get("content") or "")) for m in dicts]
        if self.template is None:
            ids = [self.bos_token_id] if self.bos_token_id is not None else []
            for role, content in messages:
                ids += tokenizer.encode(frame_message(role, content),
                                        add_special_tokens=False).ids
            return Prompt(ids + tokenizer.encode(ASSISTANT_PREFIX, add_special_tokens=False).ids)
        try:
            text = self.template.render(dicts, tools=tools)
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


def _as_dict(message: ChatMessage, native: bool) -> dict[str, Any]:
    """A message as a chat template takes it. With a template that renders tools
    (`native`), calls and results are transformers' dicts (arguments as objects, as its
    docs ask; OpenAI sends them as JSON strings); with one that does not, they are
    written into the text in the fallback format."""
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    calls = [(c.id, c.function.name, _arguments(c.function.arguments))
             for c in message.tool_calls or []]
    if native:
        if calls:
            out["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": a}} for i, n, a in calls]
        if message.role == "tool":
            out["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                out["name"] = message.name
        return out
    if calls:
        written = [tool_formats.fallback_call_text(n, a if isinstance(a, dict) else {})
                   for _i, n, a in calls]
        out["content"] = "\n".join(([message.text] if message.text else []) + written)
    if message.role == "tool":
        out["content"] = tool_formats.fallback_result_text(message.text)
    return out


def _arguments(raw: str) -> dict[str, Any] | str:
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw
    return parsed if isinstance(parsed, dict) else raw


def _with_system(messages: list[dict[str, Any]], instructions: str) -> list[dict[str, Any]]:
    """`instructions` at the end of the first system message, or as one of its own."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{instructions}" if first["content"] \
            else instructions
        return [first, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]
