"""Streaming an answer that may be tool calls, as OpenAI streams it.

Token events carry the model's raw text, call markup included (the `done` event
has the parsed calls). While a streamed answer's text may be the start of a call —
it begins with, or ends in the first characters of, a marker of some model family's
call format — `ToolCallStream` holds it back; text that turns out not to be one is
released as content. At the end, `finish` gives what is left of the content and, for
an answer with calls, the calls as OpenAI's `delta.tool_calls` pieces: per call its
index, id, type and name first, then its arguments in fragments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas import DoneEvent

# Markers that open a call in the formats sluice parses (common.tool_formats); a bare
# "{" opens one only at the very start of an answer (Llama 3 JSON calls).
MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
ARGUMENT_FRAGMENT_CHARS = 32


@dataclass(slots=True)
class ToolCallStream:
    text: str = ""  # every token text so far
    released: int = 0  # characters of `text` already given out as content
    holding: bool = False  # a marker was seen: the rest waits for `finish`

    def push(self, delta: str) -> str:
        """The content that may go out now."""
        self.text += delta
        if self.holding:
            return ""
        start = self._marker_at()
        if start is not None:
            self.holding = True
            return self._release(start)
        return self._release(len(self.text) - self._maybe_marker())

    def finish(self, done: DoneEvent) -> tuple[str, list[list[dict[str, Any]]]]:
        """(the content not given out yet, the calls' delta pieces, one list per call)."""
        if not done.tool_calls:
            return done.text[self.released:], []
        content = done.content or ""
        rest = content[self.released:] if content.startswith(self.text[:self.released]) else ""
        pieces = []
        for index, call in enumerate(done.tool_calls):
            head = {"index": index, "id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": ""}}
            arguments = call.function.arguments
            tail = [{"index": index, "function": {"arguments": arguments[i:i + n]}}
                    for n in (ARGUMENT_FRAGMENT_CHARS,)
                    for i in range(0, len(arguments), n)]
            pieces.append([head, *tail])
        return rest, pieces

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out = self.text[self.released:upto]
        self.released = upto
        return out

    def _marker_at(self) -> int | None:
        found = [i for i in (self.text.find(m) for m in MARKERS) if i >= 0]
        if self.text.lstrip().startswith("{"):
            found.append(len(self.text) - len(self.text.lstrip()))
        return min(found) if found else None

    def _maybe_marker(self) -> int:
        """How many of the text's last characters could begin a marker (a whole answer
        of only whitespace so far could still begin a bare-JSON call)."""
        if not self.text.strip():
            return len(self.text)
        held = 0
        for marker in MARKERS:
            for n in range(min(len(marker) - 1, len(self.text)), held, -1):
                if self.text.endswith(marker[:n]):
                    held = n
                    break
        return held
