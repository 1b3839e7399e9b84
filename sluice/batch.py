"""`sluice batch IN.jsonl --model KEY -o OUT.jsonl`: an offline bulk job over Kafka.

Each input line is `{"custom_id": ..., "body": {<request fields>}}`; each output
line `{"custom_id": ..., "response": <done event> | null, "error": <error or
timeout event> | null}` (`SluiceFormat`; `gateway.openai_batch.OpenAIFormat` reads
and writes OpenAI Batch API lines instead, through the same job). A line holds the
request's outcome by `schemas.Outcome`: an answer of any attempt, never a timeout of
a re-served attempt that came after it. Output lines
are appended and flushed one by one, so a job killed midway loses nothing it
wrote. A re-run skips every custom_id already answered in OUT and retries those
whose line is an error or a timeout (their old lines are removed first, so every
custom_id ends with exactly one line) unless `keep_errors`. A request with no
terminal event within the client's deadline gets no line: the next run retries
it. Bulk requests carry a loose `max_ttft_ms` by default so interactive traffic
keeps priority.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import os
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson

from schemas import DoneEvent, ErrorCode, ErrorEvent, Outcome, ReplyEvent
from schemas.outcome import Terminal
from sluice.client import Client
from sluice.errors import RequestTimeoutError

BULK_MAX_TTFT_MS = 24 * 3600 * 1000

T = TypeVar("T")
# Sends one request's fields (request id and bulk deadline added) and returns its outcome
# (a terminal event, by `schemas.Outcome`); RequestTimeoutError when none comes in time,
# InvalidRequestError (a ValueError) when the fields are not a valid request.
Send = Callable[[dict[str, Any]], Awaitable[Terminal]]


class BatchInputError(ValueError):
    pass


@dataclass(slots=True)
class BatchSummary:
    num_lines: int = 0
    num_skipped: int = 0  # answered by an earlier run
    num_retried: int = 0  # errors of an earlier run, sent again
    num_kept_errors: int = 0  # errors of an earlier run, kept (keep_errors)
    num_todo: int = 0
    num_done: int = 0
    num_errors: int = 0
    num_unanswered: int = 0  # no terminal event within the client's deadline
    num_completion_tokens: int = 0
    seconds: float = 0.0
    invalid_lines: list[str] = field(default_factory=list)
    peak_in_flight: int = 0  # the most requests in flight at once

    @property
    def tokens_per_s(self) -> float:
        return self.num_completion_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def num_finished(self) -> int:
        return self.num_done + self.num_errors + self.num_unanswered

    @property
    def failed(self) -> bool:
        """Some line ended without an answer: an error, a timeout, none at all, or it
        could not be read."""
        return bool(self.num_errors or self.num_kept_errors or self.num_unanswered
                    or self.invalid_lines)

    def line(self) -> str:
        earlier = f"{self.num_skipped} skipped (already answered)"
        if self.num_retried:
            earlier += f", {self.num_retried} retried (errors of an earlier run)"
        if self.num_kept_errors:
            earlier += f", {self.num_kept_errors} earlier errors kept"
        unanswered = (f", {self.num_unanswered} without an answer in time"
                      if self.num_unanswered else "")
        return (
            f"batch: {self.num_done} done, {self.num_errors} errors{unanswered}, {earlier} "
            f"of {self.num_lines} lines in {self.seconds:.1f} s; "
            f"{self.num_completion_tokens} tokens, {self.tokens_per_s:.1f} tokens/s"
            + (f", up to {self.peak_in_flight} in flight" if self.peak_in_flight else "")
        )


def drop_torn_tail(out_path: Path) -> None:
    """Cut a last line left half-written by a killed run, so appends start clean."""
    if not out_path.exists():
        return
    data = out_path.read_bytes()
    if data and not data.endswith(b"\n"):
        with out_path.open("r+b") as out:
            out.truncate(data.rfind(b"\n") + 1)


# The resumable-output helpers below key OUT's lines by one field: `custom_id` for
# `sluice batch`, `replay_request_id` for `sluice replay`.


def has_response(line: dict[str, Any]) -> bool:
    """A line of `sluice batch` / `sluice replay` is an answer when it has a response."""
    return line.get("response") is not None


IsAnswered = Callable[[dict[str, Any]], bool]


def _outcomes(out_path: Path, key: str = "custom_id",
              is_answered: IsAnswered = has_response) -> dict[str, bool]:
    """id -> whether its (last) line in OUT is an answer; a torn last line
    (killed mid-write) is ignored."""
    outcomes: dict[str, bool] = {}
    if not out_path.exists():
        return outcomes
    for raw in out_path.read_bytes().splitlines():
        try:
            line = orjson.loads(raw)
            outcomes[str(line[key])] = is_answered(line)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            continue
    return outcomes


def answered_ids(out_path: Path, key: str = "custom_id",
                 is_answered: IsAnswered = has_response) -> set[str]:
    """ids answered (a `done` response) in OUT."""
    return {cid for cid, ok in _outcomes(out_path, key, is_answered).items() if ok}


def failed_ids(out_path: Path, key: str = "custom_id",
               is_answered: IsAnswered = has_response) -> set[str]:
    """ids whose line in OUT is an error or a timeout."""
    return {cid for cid, ok in _outcomes(out_path, key, is_answered).items() if not ok}


def drop_lines(out_path: Path, custom_ids: set[str], key: str = "custom_id") -> None:
    """Rewrite OUT without the lines of `custom_ids` (atomically: a crash leaves the old
    file or the new one, never half of one)."""
    if not custom_ids or not out_path.exists():
        return
    kept = []
    for raw in out_path.read_bytes().splitlines(keepends=True):
        try:
            if str(orjson.loads(raw)[key]) in custom_ids:
                continue
        except (orjson.JSONDecodeError, KeyError, TypeError):
            pass
        kept.append(raw)
    tmp = out_path.with_name(out_path.name + ".rewrite")
    with tmp.open("wb") as out:
        out.write(b"".join(kept))
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(out_path)


def append_line(out: Any, line: dict[str, Any]) -> None:
    """One output line, flushed at once: a run killed midway loses nothing it wrote."""
    out.write(orjson.dumps(line) + b"\n")
    out.flush()


class InFlightWindow:
    """How many requests a bulk job keeps in flight.

    Fixed when the caller says so (`--concurrency N`); else sized by Little's law from
    the rate answers come back at: what the workers answer in a queue time of
    QUEUE_FACTOR times the quickest answer of the last RATE_WINDOW_S (about one
    request's own service time, without queueing), within QUEUE_S. Deep enough that
    the workers' batches never run dry (their own backpressure keeps the rest waiting
    on the topic), and no deeper: a longer queue only adds work per step and moves no
    answer sooner, and no request waits anywhere near its deadline. It starts at
    START and stays between FLOOR and CEILING."""

    START = 256
    FLOOR = 16
    CEILING = 4096
    QUEUE_FACTOR = 4.0
    QUEUE_S = (2.0, 20.0)  # the queue time aimed at, at least and at most
    RATE_WINDOW_S = 5.0

    def __init__(self, fixed: int | None = None) -> None:
        self.fixed = fixed
        self.limit = fixed if fixed is not None else self.START
        self._started = time.monotonic()
        self._ends: collections.deque[float] = collections.deque()
        # (when, took) with `took` increasing: the quickest of the window at its front
        self._quickest: collections.deque[tuple[float, float]] = collections.deque()

    def finished(self, now: float, took_s: float) -> None:
        """One request answered at `now` (monotonic), `took_s` after it was sent."""
        if self.fixed is not None:
            return
        since = now - self.RATE_WINDOW_S
        self._ends.append(now)
        while self._ends[0] < since:
            self._ends.popleft()
        while self._quickest and self._quickest[-1][1] >= took_s:
            self._quickest.pop()
        self._quickest.append((now, took_s))
        while self._quickest[0][0] < since:
            self._quickest.popleft()
        observed = min(self.RATE_WINDOW_S, now - self._started)
        if observed < 1.0:
            return  # too early to tell a rate
        rate = len(self._ends) / observed
        quickest = self._quickest[0][1]
        low, high = self.QUEUE_S
        queue_s = max(low, min(high, self.QUEUE_FACTOR * quickest))
        self.limit = max(self.FLOOR, min(self.CEILING, math.ceil(rate * queue_s)))


async def run_window(items: Iterable[T], handle: Callable[[T], Awaitable[None]],
                     window: InFlightWindow, summary: BatchSummary | None = None) -> None:
    """`handle` every item, as many at once as `window.limit` says when each starts. The
    first failure is raised as itself (the others are cancelled)."""
    in_flight = 0
    room = asyncio.Event()

    async def run(item: T) -> None:
        nonlocal in_flight
        sent = time.monotonic()
        try:
            await handle(item)
        finally:
            in_flight -= 1
            now = time.monotonic()
            window.finished(now, now - sent)
            room.set()

    try:
        async with asyncio.TaskGroup() as group:
            for item in items:
                while in_flight >= window.limit:
                    room.clear()
                    await room.wait()
                in_flight += 1
                if summary is not None:
                    summary.peak_in_flight = max(summary.peak_in_flight, in_flight)
                group.create_task(run(item))
    except BaseExceptionGroup as failed:  # the first failure, as itself
        raise failed.exceptions[0] from None


async def run_lanes(items: Iterable[T] | AsyncIterable[T],
                    handle: Callable[[T], Awaitable[None]], lanes: int) -> None:
    """`handle` every item, `lanes` at once: each lane takes the next item when it is
    free. The first failure is raised as itself (the other lanes are cancelled)."""
    if isinstance(items, AsyncIterable):
        source = aiter(items)
        turn = asyncio.Lock()  # an async iterator may not be advanced by two lanes at once

        async def lane() -> None:
            while True:
                async with turn:
                    try:
                        item = await anext(source)
                    except StopAsyncIteration:
                        return
                await handle(item)
    else:
        shared = iter(items)

        async def lane() -> None:
            for item in shared:  # lanes share the iterator: `lanes` at once
                await handle(item)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(max(1, lanes)):
                group.create_task(lane())
    except BaseExceptionGroup as failed:  # the first failure, as itself
        raise failed.exceptions[0] from None


def read_lines(in_path: Path, item_of: Callable[[dict[str, Any]], T]
               ) -> tuple[list[tuple[str, T]], list[str]]:
    """(custom_id, item_of(line)) of every line of IN, and the problems of the lines that
    have no output line of their own: not JSON, no custom_id, a duplicate custom_id, or
    `item_of` raising KeyError/TypeError."""
    items, problems, seen = [], [], set()
    for number, raw in enumerate(in_path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = orjson.loads(raw)
            custom_id, item = str(line["custom_id"]), item_of(line)
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            problems.append(f"line {number}: {exc}")
            continue
        if custom_id in seen:
            problems.append(f"line {number}: duplicate custom_id {custom_id!r}")
            continue
        seen.add(custom_id)
        items.append((custom_id, item))
    return items, problems


def _body(line: dict[str, Any]) -> dict[str, Any]:
    body = line["body"]
    if not isinstance(body, dict):
        raise TypeError("body must be an object")
    return body


def read_input(in_path: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    return read_lines(in_path, _body)


@dataclass(frozen=True, slots=True)
class LineResult:
    """One input line's output line, and whether that line is an answer."""

    line: dict[str, Any]
    answered: bool
    completion_tokens: int = 0


class LineFormat(Protocol):
    """A batch file format: how IN is read, how one line is answered, which OUT lines
    count as answers (the rest are retried by a re-run)."""

    errors_hint: str  # where a failed line's reason is, for the closing message

    def read(self, in_path: Path) -> tuple[list[tuple[str, Any]], list[str]]: ...

    def is_answered(self, line: dict[str, Any]) -> bool: ...

    async def answer(self, custom_id: str, item: Any, request_id: str,
                     send: Send) -> LineResult:
        """The output line of one input item; RequestTimeoutError (from `send`) when it
        has no answer in time: it then gets no line and the next run retries it."""
        ...


class SluiceFormat:
    """`{"custom_id", "body": {<request fields>}}` in; `{"custom_id", "response": <done
    event> | null, "error": <error or timeout event> | null}` out."""

    errors_hint = "their `error`"

    def read(self, in_path: Path) -> tuple[list[tuple[str, Any]], list[str]]:
        return read_input(in_path)

    def is_answered(self, line: dict[str, Any]) -> bool:
        return has_response(line)

    async def answer(self, custom_id: str, item: Any, request_id: str,
                     send: Send) -> LineResult:
        fields = {k: v for k, v in item.items() if k not in ("model", "v", "stream")}
        try:
            event: Terminal = await send(fields)
        except ValueError as exc:  # the body did not validate as a request
            event = ErrorEvent(request_id=request_id, code=ErrorCode.INVALID_REQUEST,
                               message=str(exc))
        if isinstance(event, DoneEvent):
            return LineResult({"custom_id": custom_id, "response": event.model_dump(mode="json"),
                               "error": None}, True, event.usage.completion_tokens)
        return LineResult({"custom_id": custom_id, "response": None,
                           "error": event.model_dump(mode="json")}, False)


async def run_batch(client: Client, in_path: Path, out_path: Path, *, model: str,
                    api_key: str | None, concurrency: int | None = None,
                    timeout_s: float | None = None, keep_errors: bool = False,
                    summary: BatchSummary | None = None,
                    on_progress: Callable[[int], None] | None = None,
                    on_total: Callable[[int], None] | None = None,
                    line_format: LineFormat | None = None) -> BatchSummary:
    """Run every line not yet answered; `summary` (if given) is kept up to date as
    lines finish, so an interrupted caller can still say how far it got. `concurrency`:
    requests in flight at once; None sizes it from the answers' rate (`InFlightWindow`)."""
    line_format = line_format if line_format is not None else SluiceFormat()
    items, problems = line_format.read(in_path)
    summary = summary if summary is not None else BatchSummary()
    summary.num_lines, summary.invalid_lines = len(items), problems
    await client.check_model(model)  # an unknown model fails here, not on every line
    drop_torn_tail(out_path)
    done_ids = answered_ids(out_path, is_answered=line_format.is_answered)
    earlier_errors = (failed_ids(out_path, is_answered=line_format.is_answered)
                      & {cid for cid, _ in items})
    if keep_errors:
        summary.num_kept_errors = len(earlier_errors)
        done_ids |= earlier_errors
    else:
        summary.num_retried = len(earlier_errors)
        drop_lines(out_path, earlier_errors)
    todo = [(cid, item) for cid, item in items if cid not in done_ids]
    summary.num_skipped = len(items) - len(todo) - summary.num_kept_errors
    summary.num_todo = len(todo)
    if on_total is not None:
        on_total(len(todo))
    started = time.monotonic()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    run_tag = uuid.uuid4().hex[:8]
    try:
        with out_path.open("ab") as out:

            async def one(custom_id: str, item: Any) -> None:
                digest = hashlib.sha256(custom_id.encode()).hexdigest()[:20]
                request_id = f"batch-{run_tag}-{digest}"

                async def send(fields: dict[str, Any]) -> Terminal:
                    fields = {"max_ttft_ms": BULK_MAX_TTFT_MS, **fields,
                              "request_id": request_id}
                    return await terminal_event(client, model, api_key, fields, timeout_s)

                try:
                    result = await line_format.answer(custom_id, item, request_id, send)
                except RequestTimeoutError:
                    summary.num_unanswered += 1  # no line: the next run retries it
                else:
                    if result.answered:
                        summary.num_done += 1
                        summary.num_completion_tokens += result.completion_tokens
                    else:
                        summary.num_errors += 1
                    append_line(out, result.line)
                if on_progress is not None:
                    on_progress(1)

            await run_window(todo, lambda item: one(*item), InFlightWindow(concurrency),
                             summary)
    finally:
        summary.seconds = time.monotonic() - started
    return summary


async def terminal_event(client: Client, model: str, api_key: str | None,
                         fields: dict[str, Any], timeout_s: float | None) -> Terminal:
    """Send one request (not streamed) and return its outcome; RequestTimeoutError when
    none comes within the client's deadline."""
    return await outcome_of_stream(client.stream(model=model, api_key=api_key, stream=False,
                                                 timeout=timeout_s, **fields))


async def outcome_of_stream(events: AsyncIterator[ReplyEvent]) -> Terminal:
    """The request's outcome by `schemas.Outcome`'s rule (an answer of any attempt beats
    a timeout of a re-served one), its stream read to the end."""
    outcome = Outcome()
    async for event in events:
        outcome.add(event)
    if outcome.event is None:
        raise RuntimeError("reply stream ended without a terminal event")
    return outcome.event
