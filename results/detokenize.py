"""From generated token ids to text, delta by delta, for streamed token events.

A stop string is never part of the text: the text ends where the first one
begins, and while the text ends with what could be the start of a stop string
(a prefix of one) that tail is held back, and released when the next tokens
show it is not one.
"""

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
    stops: tuple[str, ...] = ()  # the request's stop strings

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        text = self.text()
        if text.endswith("\ufffd"):
            return ""
        return self._delta(text[:len(text) - self._maybe_stop(text)])

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
        """The generated text so far, up to the first stop string."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text

    def _maybe_stop(self, text: str) -> int:
        """How many of the text's last characters could begin a stop string."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held
