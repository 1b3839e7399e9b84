"""sluice's error events as OpenAI's errors: the HTTP status, the error type and code,
and for a context overflow OpenAI's own words, naming the field the request sent
(`messages`, `prompt`, `input`), since clients match those words to raise their
context-window errors."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from gateway.openai_api import OpenAIError
from schemas import ErrorCode

# sluice error code -> (HTTP status, OpenAI error type)
_STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.UNAUTHORIZED.value: (401, "authentication_error"),
    ErrorCode.UNKNOWN_MODEL.value: (404, "not_found_error"),
    ErrorCode.UNKNOWN_ADAPTER.value: (404, "not_found_error"),
    ErrorCode.INVALID_REQUEST.value: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_TOO_LONG.value: (400, "invalid_request_error"),
    ErrorCode.OVERLOADED.value: (429, "rate_limit_error"),
    ErrorCode.INTERNAL.value: (500, "server_error"),
}


class Asked(NamedTuple):
    """What a request sent, for an error told in its terms: the field that held its prompt
    (`messages`, `prompt` or `input`) and the completion tokens it asked for (None: it
    left them to sluice's default)."""

    param: str
    max_tokens: int | None


CHAT_ASKED = Asked("messages", None)
# The field that holds a request's prompt, per route.
PROMPT_PARAMS: dict[str, str] = {"chat": "messages", "completion": "prompt", "responses": "input"}


def asked_of(route: str, fields: dict[str, Any]) -> Asked:
    """What a request to `route` (chat, completion, responses) sent, from its sluice fields."""
    return Asked(PROMPT_PARAMS[route], fields.get("max_tokens"))


def error_of(code: str, message: str, asked: Asked = CHAT_ASKED) -> OpenAIError:
    """A sluice error event as OpenAI's error (context_too_long is OpenAI's
    context_length_exceeded, in OpenAI's words: `context_overflow`)."""
    status, type_ = _STATUS.get(code, (500, "server_error"))
    if code == ErrorCode.CONTEXT_TOO_LONG.value:
        return OpenAIError(status, context_overflow(message, asked), type_,
                           "context_length_exceeded", asked.param)
    return OpenAIError(status, message, type_, code)


# The worker's context_too_long messages (gpu_runtime's admission, the batcher's), and
# how each names the context: `context` is its length, `last` the longest prompt (one less).
_OVERFLOWS = (
    re.compile(r"the prompt's (?P<prompt>\d+) tokens and max_tokens=(?P<completion>\d+) make "
               r"\d+ tokens, beyond this model's context of (?P<context>\d+) tokens"),
    re.compile(r"prompt has (?P<prompt>\d+) tokens; the limit is (?P<last>\d+)"),
    re.compile(r"prompt has (?P<prompt>\d+) tokens; the KV cache holds (?P<context>\d+)"),
)


def context_overflow(message: str, asked: Asked) -> str:
    """A context_too_long message in OpenAI's words, the ones clients match to raise their
    context-window error (litellm's `ContextWindowExceededError` looks for "This model's
    maximum context length is"; langchain-openai's for the code). The numbers are the
    worker's; the completion's, where the worker does not name them, the request's own.
    A message of another shape keeps its words behind OpenAI's opening."""
    found = next((m for m in (r.search(message) for r in _OVERFLOWS) if m), None)
    if found is None:
        return f"This model's maximum context length is smaller than this request: {message}"
    numbers = found.groupdict()
    context = int(numbers["context"]) if numbers.get("context") else int(numbers["last"]) + 1
    prompt = int(numbers["prompt"])
    completion = int(numbers["completion"]) if numbers.get("completion") else asked.max_tokens
    if asked.param == "prompt":  # the legacy completions route's own wording
        return (f"This model's maximum context length is {context} tokens, however you "
                f"requested {prompt + (completion or 0)} tokens ({prompt} in your prompt; "
                f"{completion or 0} for the completion). Please reduce your prompt; or "
                "completion length.")
    if completion is None:
        return (f"This model's maximum context length is {context} tokens. However, your "
                f"messages resulted in {prompt} tokens. Please reduce the length of the "
                "messages.")
    return (f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the "
            "completion). Please reduce the length of the messages or completion.")
