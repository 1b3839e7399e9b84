"""Helpers shared by CLI commands: settings from flags, errors as one clear line, and
the progress bar of the bulk commands."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 1) -> typer.Exit:
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def friendly_errors(func: F) -> F:
    """Turn sluice's own errors into a one-line message and exit code 1 (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from aiokafka.errors import KafkaError
        from pydantic import ValidationError

        from infra.common import InfraError
        from sluice.errors import SluiceError

        try:
            return func(*args, **kwargs)
        except ValidationError as exc:
            raise fail(_validation_line(exc)) from None
        except (SluiceError, InfraError, FileNotFoundError) as exc:
            raise fail(str(exc)) from None
        except KafkaError as exc:
            raise fail(f"Kafka: {type(exc).__name__}: {exc}") from None
        except OSError as exc:
            raise fail(f"could not reach a dependency: {exc or type(exc).__name__}") from None

    return wrapper  # type: ignore[return-value]


def _validation_line(exc: Any) -> str:
    """A pydantic ValidationError as one line: `where: what; ...`."""
    problems = []
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    return f"invalid {exc.title}: " + "; ".join(problems)


def parse_assignments(pairs: list[str]) -> dict[str, Any]:
    """`["kv_cache_len=300000", "quantization=fp8"]` -> {"kv_cache_len": 300000, ...}."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise fail(f"--set expects NAME=VALUE, got {pair!r}", 2)
        value: Any = raw
        if raw.lstrip("-").isdigit():
            value = int(raw)
        out[name.strip()] = value
    return out


def progress_bar() -> Any:
    """The bulk commands' bar (`sluice batch`, `sluice replay`): done of total, time left."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    return Progress("[progress.description]{task.description}", BarColumn(),
                    MofNCompleteColumn(), TimeRemainingColumn())
