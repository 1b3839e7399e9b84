"""`sluice batch IN.jsonl --model KEY -o OUT.jsonl`: an offline bulk job over Kafka.

Each input line is `{"custom_id": ..., "body": {<request fields>}}`; each output
line `{"custom_id": ..., "response": <done event> | null, "error": <error or
timeout event> | null}`. Output lines are appended and flushed one by one, so
a job killed midway loses nothing it wrote; a re-run skips every custom_id
already in OUT and never writes one twice. Bulk requests carry a loose
`max_ttft_ms` by default so interactive traffic keeps priority.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from schemas import DoneEvent, ErrorCode, ErrorEvent, TimeoutEvent
from sluice.client import Client

BULK_MAX_TTFT_MS = 24 * 3600 * 1000


class BatchInputError(ValueError):
    pass


@dataclass(slots=True)
class BatchSummary:
    num_lines: int = 0
    num_skipped: int = 0
    num_done: int = 0
    num_errors: int = 0
    num_completion_tokens: int = 0
    seconds: float = 0.0
    invalid_lines: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (
            f"batch: {self.num_done} done, {self.num_errors} errors, {self.num_skipped} skipped "
            f"(already answered) of {self.num_lines} lines in {self.seconds:.1f} s; "
            f"{self.num_completion_tokens} tokens, {self.tokens_per_s:.1f} tokens/s"
        )


def drop_torn_tail(out_path: Path) -> None:
    """Cut a last line left half-written by a killed run, so appends start clean."""
    if not out_path.exists():
        return
    data = out_path.read_bytes()
    if data and not data.endswith(b"\n"):
        with out_path.open("r+b") as out:
            out.truncate(data.rfind(b"\n") + 1)


def answered_ids(out_path: Path) -> set[str]:
    """custom_ids already in OUT; a torn last line (killed mid-write) is ignored."""
    if not out_path.exists():
        return set()
    done = set()
    for raw in out_path.read_bytes().splitlines():
        try:
            done.add(str(orjson.loads(raw)["custom_id"]))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def read_input(in_path: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    items, problems, seen = [], [], set()
    for number, raw in enumerate(in_path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = orjson.loads(raw)
            custom_id, body = str(line["custom_id"]), line["body"]
            if not isinstance(body, dict):
                raise TypeError("body must be an object")
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            problems.append(f"line {number}: {exc}")
            continue
        if custom_id in seen:
            problems.append(f"line {number}: duplicate custom_id {custom_id!r}")
            continue
        seen.add(custom_id)
        items.append((custom_id, body))
    return items, problems


async def run_batch(client: Client, in_path: Path, out_path: Path, *, model: str,
                    api_key: str | None, concurrency: int = 64,
                    on_progress: Callable[[int], None] | None = None,
                    on_total: Callable[[int], None] | None = None) -> BatchSummary:
    items, problems = read_input(in_path)
    summary = BatchSummary(num_lines=len(items), invalid_lines=problems)
    drop_torn_tail(out_path)
    done_ids = answered_ids(out_path)
    todo = [(cid, body) for cid, body in items if cid not in done_ids]
    summary.num_skipped = len(items) - len(todo)
    if on_total is not None:
        on_total(len(todo))
    started = time.monotonic()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    semaphore = asyncio.Semaphore(concurrency)
    run_tag = uuid.uuid4().hex[:8]
    with out_path.open("ab") as out:

        def write(custom_id: str, response: Any, error: Any) -> None:
            line = {"custom_id": custom_id, "response": response, "error": error}
            out.write(orjson.dumps(line) + b"\n")
            out.flush()
            if on_progress is not None:
                on_progress(1)

        async def one(custom_id: str, body: dict[str, Any]) -> None:
            async with semaphore:
                fields = {k: v for k, v in body.items() if k not in ("model", "v", "stream")}
                fields.setdefault("max_ttft_ms", BULK_MAX_TTFT_MS)
                digest = hashlib.sha256(custom_id.encode()).hexdigest()[:20]
                fields["request_id"] = f"batch-{run_tag}-{digest}"
                try:
                    event = await _complete(client, model, api_key, fields)
                except ValueError as exc:  # the body did not validate as a request
                    event = ErrorEvent(request_id=fields["request_id"],
                                       code=ErrorCode.INVALID_REQUEST, message=str(exc))
                if isinstance(event, DoneEvent):
                    summary.num_done += 1
                    summary.num_completion_tokens += event.usage.completion_tokens
                    write(custom_id, event.model_dump(mode="json"), None)
                else:
                    summary.num_errors += 1
                    write(custom_id, None, event.model_dump(mode="json"))

        await asyncio.gather(*(one(cid, body) for cid, body in todo))
    summary.seconds = time.monotonic() - started
    return summary


async def _complete(client: Client, model: str, api_key: str | None,
                    fields: dict[str, Any]) -> DoneEvent | ErrorEvent | TimeoutEvent:
    async for event in client.stream(model=model, api_key=api_key, stream=False, **fields):
        if isinstance(event, DoneEvent | ErrorEvent | TimeoutEvent):
            return event
    raise RuntimeError("reply stream ended without a terminal event")
