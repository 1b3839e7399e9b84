"""A model's own chat template, rendered as transformers' `apply_chat_template` does.

Where the template comes from (first found): `chat_template.jinja` in the model
directory, then `chat_template` in `tokenizer_config.json` — a string, or a list
of named templates of which `default` is used. It is rendered in jinja2's
immutable sandbox with the same settings and helpers transformers gives it
(`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, `namespace`, `dict`, the
`{% generation %}` tag) and the named special tokens of `tokenizer_config.json`
as variables (`bos_token`, `eos_token`, ...). The rendered text is tokenized
without the tokenizer's own added tokens: a template that wants a bos writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens a template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template cannot be loaded, or it refused these messages (its own words)."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    origin: str  # where it was read: "chat_template.jinja" or "tokenizer_config.json"
    special_tokens: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model's template, or None when it has none (then chat is framed plainly)."""
        model_dir = Path(model_dir)
        config = read_tokenizer_config(model_dir)
        special = special_tokens_of(config)
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), jinja_file.name, special)
        raw = config.get("chat_template")
        if raw is None:
            return None
        if isinstance(raw, str):
            return cls(raw, "tokenizer_config.json", special)
        if isinstance(raw, list):
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            if isinstance(named.get("default"), str):
                return cls(named["default"], "tokenizer_config.json (default)", special)
            raise ChatTemplateError(
                "tokenizer_config.json has several chat templates and none named 'default' "
                f"(names: {sorted(str(n) for n in named)})")
        raise ChatTemplateError("tokenizer_config.json: chat_template is neither a string "
                                "nor a list of named templates")

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        try:
            template = _compile(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from None
        try:
            return template.render(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)
        except jinja2.TemplateError as exc:  # raise_exception, undefined calls, sandbox
            raise ChatTemplateError(str(exc)) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: "
                                    f"{type(exc).__name__}: {exc}") from None


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def special_tokens_of(config: dict[str, Any]) -> dict[str, str]:
    """Named special tokens, written as strings or as AddedToken dicts ({"content": ...})."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training
    masks in transformers; rendering it is rendering its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` without underscore attributes (no way into Python's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set {name!r} on a namespace")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, and nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)
