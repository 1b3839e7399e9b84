"""From generated token ids to text, delta by delta, for streamed token events."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer


@dataclass(slots=True)
class IncrementalDecoder:
    """Turns a growing list of generated ids into text deltas.

    Text that ends in an incomplete UTF-8 sequence (shown as U+FFFD) is held
    back until the next token completes it; `flush` hands out whatever is left
    at the end, so the deltas always add up to the whole text.
    """

    tokenizer: Tokenizer | None
    ids: list[int]
    emitted: str = ""  # the text handed out so far, delta by delta

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        text = self.text()
        if text.endswith("\ufffd"):
            return ""
        return self._delta(text)

    def flush(self) -> str:
        """The text not handed out yet (a held-back tail included): the last delta."""
        if self.tokenizer is None:
            return ""
        return self._delta(self.text())

    def _delta(self, text: str) -> str:
        delta = text[len(self.emitted):]
        self.emitted += delta
        return delta

    def text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)
