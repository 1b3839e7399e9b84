"""`sluice replay --model M --from TIME|OFFSETS -o OUT.jsonl`: re-run logged requests.

The requests recorded on model M's request topic are read back — as a plain
reader: partitions assigned, no consumer group (the serving group's offsets
are never touched), `read_committed` — and each is sent again, with the
replayer's own API key, to another model (`as_model`) or adapter, so a new
adapter can be tried on real traffic. Each output line pairs the original with
the new answer and, when the original reply topic is read too, with the
original answer (each answer is its request's outcome by `schemas.Outcome`: a
`done` or `error` of any attempt, never a re-served attempt's later `timeout`):

    {"request_id": <original id>, "source": {"topic", "partition", "offset", "timestamp"},
     "replay_request_id": ..., "model": ..., "adapter": ...,
     "response": <done event> | null, "error": <error or timeout event> | null,
     "original": <original done event> | null, "changed": true | false | null}

The range: `--from` is a time (ISO-8601, epoch ms, or `-24h`-style relative),
`earliest`, or offsets `P:O,P:O` (only the partitions named are replayed);
`--to` (exclusive) is a time or offsets too (partitions it does not name read to
their end), and is always capped at the end offsets of the moment replay
starts, so requests produced meanwhile — replays onto the same model included
— are not chased.

The original API key (the record's `authorization` header) is never read. A
replayed request gets a new id derived from the source record and the target
(stable across runs), the target model and adapter, the loose bulk deadline
of `sluice batch` (replays must not take priority over live traffic) and no
`reply_topic`; every other field the producer set is kept as it was set.

Resumable as `sluice batch`: a re-run skips records answered in OUT and
retries those whose line is an error or a timeout (their old lines are
replaced); output lines are appended and flushed one by one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka.structs import ConsumerRecord
from pydantic import BaseModel, ConfigDict

from common.safe_fetch import Unreadable
from schemas import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    InferenceRequest,
    TimeoutEvent,
)
from schemas.names import check_name
from sluice.batch import (
    BULK_MAX_TTFT_MS,
    answered_ids,
    append_line,
    drop_lines,
    drop_torn_tail,
    run_lanes,
    terminal_event,
)
from sluice.client import Client
from sluice.errors import RequestTimeoutError, UnknownModelError
from sluice.replay_source import (
    Position,
    RangeReader,
    Ranges,
    ReplayInputError,
    format_offsets,
    parse_request,
    read_originals,
)

REPLAY_ID_PREFIX = "replay-"
OUT_KEY = "replay_request_id"  # the field OUT's lines are keyed by, for resuming
# Original replies are read from this long before the first replayed request: reply
# topics may carry their producers' clocks, not the broker's.
ORIGINALS_MARGIN_MS = 5 * 60 * 1000


def replay_id(topic: str, partition: int, offset: int, model: str, adapter: str | None) -> str:
    """A replayed request's id: the same source record replayed onto the same target gets
    the same id in every run (resuming), another target another one."""
    source = f"{topic}\0{partition}\0{offset}\0{model}\0{adapter or ''}"
    return REPLAY_ID_PREFIX + hashlib.sha256(source.encode()).hexdigest()[:32]


class ReplaySource(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    topic: str
    partition: int
    offset: int
    timestamp: int


class ReplayLine(BaseModel):
    """One line of OUT."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    source: ReplaySource
    replay_request_id: str
    model: str
    adapter: str | None
    response: DoneEvent | None
    error: ErrorEvent | TimeoutEvent | None
    original: DoneEvent | None
    changed: bool | None


@dataclass(slots=True)
class ReplaySummary:
    num_offsets: int = 0  # offsets in the range (records, transaction markers, aborted ones)
    num_records: int = 0  # records read in the range
    num_handled: int = 0  # records finished this run, whatever became of them
    num_cancels: int = 0  # skipped: cancel records
    num_invalid: int = 0  # skipped: not an InferenceRequest (or unreadable)
    num_replays: int = 0  # skipped: themselves replays
    num_answered: int = 0  # skipped: answered in OUT by an earlier run
    num_retried: int = 0  # errors of an earlier run, sent again
    num_done: int = 0
    num_errors: int = 0
    num_unanswered: int = 0  # no terminal event within the client's deadline
    num_completion_tokens: int = 0
    originals_read: bool = False
    num_originals: int = 0  # original `done` events found on the reply topic
    num_changed: int = 0
    num_same: int = 0
    num_no_original: int = 0
    num_originals_cancelled: int = 0  # not compared: the original was cut short
    seconds: float = 0.0
    # partition -> (start, stop): the range as offsets, to continue exactly it.
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_replayed(self) -> int:
        return self.num_done + self.num_errors + self.num_unanswered

    @property
    def num_skipped(self) -> int:
        return self.num_cancels + self.num_invalid + self.num_replays

    @property
    def tokens_per_s(self) -> float:
        return self.num_completion_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def failed(self) -> bool:
        """Some replayed request has no answer: an error, a timeout, or none at all."""
        return bool(self.num_errors or self.num_unanswered)

    def resume_flags(self) -> str:
        """`--from ... --to ...` naming exactly this run's range."""
        todo = {p: r for p, r in self.ranges.items() if r[0] < r[1]}
        if not todo:
            return ""
        return (f"--from {format_offsets({p: r[0] for p, r in todo.items()})} "
                f"--to {format_offsets({p: r[1] for p, r in todo.items()})}")

    def line(self) -> str:
        unanswered = (f", {self.num_unanswered} without an answer in time"
                      if self.num_unanswered else "")
        retried = (f", {self.num_retried} retried (errors of an earlier run)"
                   if self.num_retried else "")
        text = (
            f"replay: {self.num_replayed} replayed ({self.num_done} done, {self.num_errors} "
            f"errors{unanswered}), {self.num_skipped} skipped ({self.num_cancels} cancels, "
            f"{self.num_invalid} invalid, {self.num_replays} replays), {self.num_answered} "
            f"already answered{retried} of {self.num_records} records in {self.seconds:.1f} s"
        )
        if self.originals_read:
            cancelled = (f", {self.num_originals_cancelled} originals cancelled"
                         if self.num_originals_cancelled else "")
            text += (f"; vs originals: {self.num_changed} changed, {self.num_same} same, "
                     f"{self.num_no_original} originals not found{cancelled}")
        return (text + f"; {self.num_completion_tokens} tokens, "
                f"{self.tokens_per_s:.1f} tokens/s")


def replayed_fields(request: InferenceRequest, adapter: str | None) -> dict[str, Any]:
    """The fields of the replayed request, less its id and model: every field the
    producer set, except the reply topic (the replayer's own), the deadline (bulk) and
    streaming (only the answer is kept)."""
    fields = request.model_dump(mode="json", exclude_unset=True, exclude={
        "v", "request_id", "model", "adapter", "reply_topic", "stream", "max_ttft_ms"})
    # Left out when unset, so sampling defaults stay the model's, as for the original.
    fields["adapter"] = adapter
    fields["max_ttft_ms"] = BULK_MAX_TTFT_MS
    return fields


def changed(new: DoneEvent, old: DoneEvent | None) -> bool | None:
    """Whether the answer differs from the original's; None when there is nothing to
    compare with: no original, or one cut short by a cancel."""
    if old is None or old.finish_reason == "cancelled":
        return None
    if new.token_ids is not None and old.token_ids is not None \
            and new.token_ids != old.token_ids:
        return True
    return new.text != old.text


def _retry_ids(out_path: Path, topic: str, ranges: Ranges, target: str) -> set[str]:
    """Ids of OUT's error lines that this run replays again: same topic and target, a
    source inside the range. Error lines of other ranges are left as they are."""
    inside = {tp.partition: r for tp, r in ranges.items()}
    retry: set[str] = set()
    if not out_path.exists():
        return retry
    for raw in out_path.read_bytes().splitlines():
        try:
            line = orjson.loads(raw)
            if line.get("response") is not None:
                retry.discard(str(line[OUT_KEY]))  # answered later in the file
                continue
            source = line["source"]
            p, o = int(source["partition"]), int(source["offset"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue
        start, stop = inside.get(p, (0, 0))
        if source.get("topic") == topic and start <= o < stop and line[OUT_KEY] == replay_id(
                topic, p, o, target, line.get("adapter")):
            retry.add(str(line[OUT_KEY]))
    return retry


async def run_replay(client: Client, out_path: Path, *, model: str, start: Position,
                     stop: Position | None = None, as_model: str | None = None,
                     adapter: str | None = None, base: bool = False,
                     original_replies: str | None = None, api_key: str | None = None,
                     concurrency: int = 64, timeout_s: float | None = None,
                     summary: ReplaySummary | None = None,
                     on_phase: Callable[[str, int | None], None] | None = None,
                     on_progress: Callable[[int], None] | None = None) -> ReplaySummary:
    """Replay model `model`'s recorded requests in [start, stop) onto `as_model` (default
    `model`) with `adapter` (or the base model with `base`, else each request's own).
    `summary` (if given) is kept up to date, so an interrupted caller can say how far it
    got; `on_phase(description, total)` names each phase and its size in offsets."""
    if adapter is not None and base:
        raise ReplayInputError("give an adapter or the base model, not both")
    summary = summary if summary is not None else ReplaySummary()
    target = check_name("model", as_model or model)
    check_name("model", model)
    if adapter is not None:
        check_name("adapter", adapter)

    def adapter_of(original: str | None) -> str | None:
        return None if base else adapter if adapter is not None else original

    settings = client.settings
    topic = settings.requests_topic(model)
    await client.check_model(target)  # an unknown target fails here, not on every record
    reader = RangeReader(settings, topic)
    started = time.monotonic()
    try:
        if not await reader.start():
            raise UnknownModelError(model, topic,
                                    secured=settings.kafka.security_protocol != "PLAINTEXT")
        ranges = await reader.ranges(start, stop)
        summary.ranges = {tp.partition: r for tp, r in ranges.items()}
        summary.num_offsets = sum(max(0, b - a) for a, b in ranges.values())

        originals: dict[str, DoneEvent] = {}
        if original_replies is not None:
            if on_phase is not None:
                on_phase("reading original replies", None)
            first = await reader.first_timestamp(ranges)
            summary.originals_read = True
            if first is not None:
                originals = await read_originals(settings, original_replies, model,
                                                 first - ORIGINALS_MARGIN_MS)
            summary.num_originals = len(originals)

        drop_torn_tail(out_path)
        retry = _retry_ids(out_path, topic, ranges, target)
        drop_lines(out_path, retry, key=OUT_KEY)
        summary.num_retried = len(retry)
        answered = answered_ids(out_path, key=OUT_KEY)
        if on_phase is not None:
            on_phase("replay", summary.num_offsets)
        out_path.parent.mkdir(parents=True, exist_ok=True)

        def advance(n: int) -> None:
            if on_progress is not None and n > 0:
                on_progress(n)

        with out_path.open("ab") as out:

            async def one(item: ConsumerRecord | Unreadable) -> None:
                await replay_one(item)
                summary.num_handled += 1  # not when cancelled (Ctrl-C): it was not handled
                advance(1)

            async def replay_one(item: ConsumerRecord | Unreadable) -> None:
                summary.num_records += 1
                request = "invalid" if isinstance(item, Unreadable) else parse_request(item.value)
                if request == "cancel":
                    summary.num_cancels += 1
                    return
                if not isinstance(request, InferenceRequest):
                    summary.num_invalid += 1
                    return
                if request.request_id.startswith(REPLAY_ID_PREFIX):
                    summary.num_replays += 1  # an earlier replay onto this model
                    return
                assert isinstance(item, ConsumerRecord)
                new_adapter = adapter_of(request.adapter)
                new_id = replay_id(topic, item.partition, item.offset, target, new_adapter)
                if new_id in answered:
                    summary.num_answered += 1
                    return
                fields = replayed_fields(request, new_adapter)
                fields["request_id"] = new_id
                try:
                    event = await terminal_event(client, target, api_key, fields, timeout_s)
                except RequestTimeoutError:
                    summary.num_unanswered += 1  # no line: the next run retries it
                    return
                except ValueError as exc:  # the SDK refused it as a request
                    event = ErrorEvent(request_id=new_id, code=ErrorCode.INVALID_REQUEST,
                                       message=str(exc))
                original = originals.get(request.request_id)
                response, error, difference = None, None, None
                if isinstance(event, DoneEvent):
                    response, difference = event, changed(event, original)
                    summary.num_done += 1
                    summary.num_completion_tokens += event.usage.completion_tokens
                    if summary.originals_read:
                        if original is None:
                            summary.num_no_original += 1
                        elif difference is None:
                            summary.num_originals_cancelled += 1
                        elif difference:
                            summary.num_changed += 1
                        else:
                            summary.num_same += 1
                else:
                    error = event
                    summary.num_errors += 1
                line = ReplayLine(
                    request_id=request.request_id,
                    source=ReplaySource(topic=topic, partition=item.partition,
                                        offset=item.offset, timestamp=item.timestamp),
                    replay_request_id=new_id, model=target, adapter=new_adapter,
                    response=response, error=error, original=original, changed=difference)
                append_line(out, line.model_dump(mode="json"))

            await run_lanes(reader.read(ranges, on_gap=advance), one, concurrency)
    finally:
        summary.seconds = time.monotonic() - started
        await reader.stop()
    return summary
