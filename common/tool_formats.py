"""How a model writes tool calls: the text it emits, the grammar that forces one, the
parser that reads them back.

A model family has its own call format, which its chat template teaches it:

- `hermes` (Hermes, Qwen 2/2.5/3, SmolLM3 and many more):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `llama3_json` (Llama 3.1+ JSON tool calling): `{"name": ..., "parameters": {...}}`,
  after `<|python_tag|>` or alone.

`detect` tells it from the template's source. A template that knows nothing of tools
(SmolLM2's, say) gets sluice's own rendering in the hermes format: the tools listed in a
system message (`fallback_system_prompt`), earlier calls and results written into the
messages' text (`fallback_call_text`, `fallback_result_text`). `grammar` is the
llguidance Lark grammar of a forced call (tool_choice required or a named function):
the call's text with its arguments fitting the function's JSON Schema. `parse` splits a
generated text into the text around the calls and the calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

ToolFormat = Literal["hermes", "mistral", "llama3_json"]
FALLBACK_FORMAT: ToolFormat = "hermes"
# Whitespace allowed between JSON tokens of a forced call (as for response_format).
WHITESPACE = r"[ \n]{0,8}"
MAX_PARALLEL_CALLS = 8

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


def detect(template_source: str | None) -> tuple[ToolFormat, bool]:
    """(the call format, whether the template renders tools itself)."""
    if not template_source or "tools" not in template_source:
        return FALLBACK_FORMAT, False
    if _MISTRAL in template_source:
        return "mistral", True
    if _HERMES_OPEN in template_source:
        return "hermes", True
    if _PYTHON_TAG in template_source or '"parameters"' in template_source:
        return "llama3_json", True
    return FALLBACK_FORMAT, True


def markers(fmt: ToolFormat) -> tuple[str, ...]:
    """Texts that open a call in `fmt`: streamed text that may be the start of one is
    held back until it is known not to be."""
    if fmt == "hermes":
        return (_HERMES_OPEN,)
    if fmt == "mistral":
        return (_MISTRAL,)
    return (_PYTHON_TAG, "{")


def grammar(fmt: ToolFormat, functions: list[dict[str, Any]], several: bool) -> str:
    """The llguidance Lark grammar of a forced answer: one call to one of `functions`
    (OpenAI function objects), or with `several` up to MAX_PARALLEL_CALLS of them."""
    arguments_key = "parameters" if fmt == "llama3_json" else "arguments"
    options = [{"type": "object", "properties": {
        "name": {"const": f["name"]}, arguments_key: _closed(f.get("parameters")),
    }, "required": ["name", arguments_key], "additionalProperties": False}
        for f in functions]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_pattern": WHITESPACE}}
    call = "call: %json " + json.dumps(schema)
    newline, comma, semicolon = r'"\n"', '", "', '";"'

    def repeated(item: str, separator: str) -> str:
        if not several:
            return item
        return f"{item} ({separator} {item}){{0,{MAX_PARALLEL_CALLS - 1}}}"

    if fmt == "hermes":
        block = f'block: "{_HERMES_OPEN}\\n" call "\\n{_HERMES_CLOSE}"'
        return f"start: {repeated('block', newline)}\n{block}\n{call}"
    if fmt == "mistral":
        return f'start: "{_MISTRAL}[" {repeated("call", comma)} "]"\n{call}'
    return f"start: {repeated('call', semicolon)}\n{call}"


def _closed(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments schema with no properties beyond those it names, unless it
    says otherwise (a small model copies the schema's own keys into its arguments)."""
    if not schema:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def parse(fmt: ToolFormat, text: str) -> tuple[str, list[ParsedCall]]:
    """(the text around the calls, the calls) of a generated answer; no calls when none
    parses (the answer is then all text)."""
    if fmt == "hermes":
        calls = [c for c in (_call(b, "arguments") for b in _HERMES_BLOCK.findall(text)) if c]
        if not calls:
            return text, []
        return _HERMES_BLOCK.sub("", text).strip(), calls
    if fmt == "mistral":
        head, found, tail = text.partition(_MISTRAL)
        if not found:
            return text, []
        try:
            items = json.loads(tail.strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_as_call(i, "arguments") for i in items) if c]
        return (head.strip(), calls) if calls else (text, [])
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _as_call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and body[at] in " \n;":
            at += 1
    return ("", calls) if calls else (text, [])


def _call(raw: str, arguments_key: str) -> ParsedCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return _as_call(obj, arguments_key)


def _as_call(obj: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], arguments)


# ---- sluice's own rendering, for templates that know nothing of tools -------------------


def fallback_system_prompt(functions: list[dict[str, Any]], forced: str | None) -> str:
    """The tools as a system message says them to a model whose template cannot (calls in
    the hermes format). `forced`: the one function it must call, if any."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                       for f in functions)
    rule = (f"Answer with a call to {forced}." if forced else
            "Call a function when it helps to answer; otherwise answer in plain text.")
    return ("You can use these functions (JSON Schema signatures between <tools> and "
            f"</tools>):\n<tools>\n{listed}\n</tools>\n{rule} To call one, write only\n"
            f"{_HERMES_OPEN}\n{{\"name\": \"<function name>\", \"arguments\": {{<arguments "
            f"as JSON>}}}}\n{_HERMES_CLOSE}\nper call. Results come back as "
            "<tool_response> messages.")


def fallback_call_text(name: str, arguments: dict[str, Any]) -> str:
    return (f"{_HERMES_OPEN}\n" + json.dumps({"name": name, "arguments": arguments},
                                             ensure_ascii=False) + f"\n{_HERMES_CLOSE}")


def fallback_result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"
