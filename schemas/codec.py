"""Encoding and decoding of wire messages, and the one error type decoding raises.

Every message is UTF-8 JSON encoded with orjson. `decode()` turns *any* bytes
into a validated model or raises `SchemaError` — never anything else — whose
message names each bad field and what is wrong with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import pydantic

MAX_MESSAGE_BYTES = 4 * 1024 * 1024

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclass(frozen=True, slots=True)
class FieldProblem:
    field: str
    problem: str

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}" if self.field else self.problem


class SchemaError(ValueError):
    """Bytes that are not a valid message.

    `parsed` is the decoded JSON object when the bytes were JSON at all (so a
    caller can still find `request_id` / `reply_topic` to answer with an error
    event); None when they were not even a JSON object.
    """

    def __init__(self, problems: list[FieldProblem], parsed: dict[str, Any] | None = None):
        self.problems = problems
        self.parsed = parsed
        super().__init__("; ".join(str(p) for p in problems) or "invalid message")

    @property
    def is_json_object(self) -> bool:
        return self.parsed is not None


def _problems(exc: pydantic.ValidationError) -> list[FieldProblem]:
    out = []
    for err in exc.errors(include_url=False, include_input=False):
        field = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        out.append(FieldProblem(field, message))
    return out


def loads_object(data: bytes | bytearray | memoryview | str, limit: int) -> dict[str, Any]:
    """Parse bytes into a JSON object, or raise SchemaError saying why not."""
    size = len(data)
    if size > limit:
        raise SchemaError([FieldProblem("", f"message is {size} bytes; the limit is {limit}")])
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SchemaError([FieldProblem("", f"not valid UTF-8 JSON: {exc}")]) from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise SchemaError([FieldProblem("", f"not valid JSON: {exc}")]) from None
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        raise SchemaError([FieldProblem("", f"expected a JSON object, got {kind}")])
    return obj


def decode(model: type[M], data: bytes | bytearray | memoryview | str,
           limit: int = MAX_MESSAGE_BYTES) -> M:
    """Validate bytes as `model`; raises SchemaError (only) on any problem."""
    obj = loads_object(data, limit)
    return validate(model, obj)


def validate(model: type[M], obj: dict[str, Any]) -> M:
    try:
        return model.model_validate(obj, strict=True)
    except pydantic.ValidationError as exc:
        raise SchemaError(_problems(exc), parsed=obj) from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise SchemaError([FieldProblem("", str(exc))], parsed=obj) from None


def encode(message: pydantic.BaseModel) -> bytes:
    """The canonical bytes of a message: field order of the model, no extra spaces
    (fields a message leaves out unless given are left out when not given)."""
    data = message.model_dump(mode="json", by_alias=True)
    for name in getattr(message, "OMITTED_UNLESS_SET", ()):
        if name not in message.model_fields_set:
            del data[name]
    return orjson.dumps(data)
