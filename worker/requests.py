"""A request's way through the worker: admitted, held, run, answered.

- `HeldRequests`: the requests a worker holds, by engine key, from admission
  until their terminal event is handed to results. Waits for "none held" or
  "none held from these partitions" end on a change, never on a polling sleep.
- `Router`: each of ingest's verdicts to the engine (admitted) or to results
  (refused, dead-lettered).
- `EventPump`: each engine event to results; `wait_idle` returns once every
  event an engine has emitted is handed over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from batcher import types as bt
from batcher.engine import Engine
from batcher.errors import EngineClosedError
from common import tool_formats
from gpu_runtime import SamplingDefaults, SamplingParams
from ingest.verdicts import Admitted, Cancel, DeadLettered, Refused, Verdict
from results.detokenize import IncrementalDecoder
from results.inflight import InFlight
from results.writer import ResultWriter
from schemas import ErrorCode, InferenceRequest, NamedToolChoice, Timing
from worker.tracing import RequestTracer

log = logging.getLogger(__name__)

EngineOf = Callable[[], Engine]
# (partition, epoch) -> whether work read under that assignment may go on.
Owns = Callable[[object, int], bool]


def _always(_tp: object, _epoch: int) -> bool:
    return True


async def _yes() -> bool:
    return True


class HeldRequests:
    def __init__(self) -> None:
        self._held: dict[str, InFlight] = {}
        self._changed = asyncio.Condition()

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def items(self) -> Iterator[tuple[str, InFlight]]:
        return iter(list(self._held.items()))

    def get(self, key: str) -> InFlight | None:
        return self._held.get(key)

    def hold(self, key: str, ctx: InFlight) -> None:
        self._held[key] = ctx

    async def release(self, key: str) -> None:
        if self._held.pop(key, None) is not None:
            async with self._changed:
                self._changed.notify_all()

    async def wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `done()` holds (checked at each change); False on timeout."""
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(done)
        except TimeoutError:
            return False
        return True

    async def wait_empty(self, timeout_s: float) -> bool:
        return await self.wait_until(lambda: not self._held, timeout_s)

    async def wait_none_from(self, partitions: set[object], timeout_s: float) -> bool:
        return await self.wait_until(
            lambda: not any(c.topic_partition in partitions for c in self._held.values()),
            timeout_s)

    def cancel_from(self, partitions: set[object], engine: Engine | None) -> int:
        """Stop, unanswered, the requests held for `partitions` (their offsets stay
        unfinished; the partitions' next owner serves them); how many there were."""
        dropped = 0
        for key, ctx in self.items():
            if ctx.topic_partition in partitions:
                dropped += 1
                if engine is not None:
                    engine.cancel(key)
        return dropped


def engine_key(admitted: Admitted) -> str:
    """Unique per record and assignment in this worker: the request id, where it was
    read, and the epoch of the partition's assignment it was read under. A partition
    dropped and taken over again (a fenced transactional id, a rebalance giving it back)
    reads its records again while the engine may still hold the dropped ones, cancelled
    but not yet ended: under one key the record read again was taken for a duplicate and
    never served (the chaos run, leader isolations: 20 requests unanswered)."""
    return (f"{admitted.request.request_id}#{admitted.tp.partition}:{admitted.offset}"
            f"@{admitted.epoch}")


def _no_grammars(_response_format: dict[str, Any]) -> str | None:
    raise ValueError("this worker does not serve response_format")


class Router:
    def __init__(self, writer: ResultWriter, held: HeldRequests, engine_of: EngineOf,
                 tokenizer_of: Callable[[], object],
                 sampling_defaults_of: Callable[[], SamplingDefaults] = SamplingDefaults, *,
                 finished: Callable[[object, int], None] = lambda _tp, _offset: None,
                 on_cancel: Callable[[str], None] = lambda _outcome: None,
                 grammar_of: Callable[[dict[str, Any]], str | None] | None = None,
                 owns: Owns = _always, holds: Owns = _always,
                 tracer: RequestTracer | None = None):
        self._grammar_of = grammar_of or _no_grammars
        self._tracer = tracer  # None: tracing off
        # A partition being handed over (or gone) starts no new work: a verdict read
        # under an older assignment is dropped, never served beside its new owner.
        self._owns = owns
        self._holds = holds
        self._finished = finished  # a record that needs no answer (a cancel) is done
        self._on_cancel = on_cancel  # "cancelled" | "ignored" | "refused", for metrics
        self._writer = writer
        self._held = held
        self._engine_of = engine_of
        self._tokenizer_of = tokenizer_of
        self._sampling_defaults_of = sampling_defaults_of

    async def route(self, verdict: Verdict) -> None:
        if isinstance(verdict, Cancel):
            if self._holds(verdict.tp, verdict.epoch):  # its request may still be finishing
                self._cancel(verdict)
                self._finished(verdict.tp, verdict.offset)
        elif not self._owns(verdict.tp, verdict.epoch):
            log.debug("a record of partition %s read before it was revoked is left to its "
                      "new owner", verdict.tp)
        elif isinstance(verdict, DeadLettered):
            await self._writer.dead_letter(tp=verdict.tp, offset=verdict.offset,
                                           key=verdict.key, value=verdict.value,
                                           reason=verdict.reason)
        elif isinstance(verdict, Refused):
            await self._writer.refusal(tp=verdict.tp, offset=verdict.offset,
                                       reply_topic=verdict.reply_topic,
                                       request_id=verdict.request_id, code=verdict.code,
                                       message=verdict.message, headers=verdict.trace_headers)
        else:
            await self._admit(verdict)

    def _cancel(self, cancel: Cancel) -> None:
        """Stop the request named, if this worker holds it from the cancel's partition
        and the cancel's key is of the request's tenant; else ignore the cancel (the
        request finished already, or it was never here)."""
        for key, ctx in self._held.items():
            if ctx.request.request_id != cancel.request_id or (
                    ctx.topic_partition != cancel.tp):
                continue
            same_key = cancel.key_digest is not None and cancel.key_digest == ctx.key_digest
            if not same_key and (cancel.tenant is None or cancel.tenant != ctx.tenant):
                log.warning("a cancel from another tenant (or an unknown key) was ignored",
                            extra={"request_id": cancel.request_id})
                self._on_cancel("refused")
                return
            if self._engine_of().cancel(key, answer=True):
                log.info("cancelled by its client", extra={"request_id": cancel.request_id})
                self._on_cancel("cancelled")
                return
        self._on_cancel("ignored")

    async def _admit(self, admitted: Admitted) -> None:
        key = engine_key(admitted)
        if key in self._held:
            return
        req = admitted.request
        ctx = InFlight(
            request=req, topic_partition=admitted.tp, offset=admitted.offset,
            reply_topic=admitted.reply_topic, attempt=admitted.attempt,
            arrival_time=admitted.arrival_time, max_ttft_ms=admitted.max_ttft_ms,
            decoder=IncrementalDecoder(self._tokenizer_of(), [],  # type: ignore[arg-type]
                                       stops=tuple(req.stop)),
            num_prompt_tokens=len(admitted.token_ids), chat=admitted.chat,
            tenant=admitted.tenant, key_digest=admitted.key_digest, epoch=admitted.epoch,
            tool_format=admitted.tool_format, reply_headers=admitted.trace_headers,
        )
        grammar = None
        spec = _constraint(req, admitted.tool_format)
        if spec is not None:
            try:  # compiled off the loop (a new schema: milliseconds; then cached)
                grammar = await asyncio.to_thread(self._grammar_of, spec)
            except Exception as exc:
                await self._writer.error(ctx, ErrorCode.INVALID_REQUEST, str(exc))
                return
        # Sampling the request leaves out comes from the model's generation_config.json.
        given, defaults = req.model_fields_set, self._sampling_defaults_of()
        params = SamplingParams(
            max_tokens=req.max_tokens, max_tokens_asked="max_tokens" in given,
            temperature=req.temperature if "temperature" in given else defaults.temperature,
            top_p=req.top_p if "top_p" in given else defaults.top_p,
            top_k=req.top_k if "top_k" in given else defaults.top_k,
            seed=req.seed, stop=tuple(req.stop), logprobs=req.logprobs, grammar=grammar,
            ignore_eos=bool(req.ignore_eos), min_tokens=req.min_tokens or 0,
            repetition_penalty=req.repetition_penalty or 1.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=tuple((int(t), b) for t, b in (req.logit_bias or {}).items()),
        )
        if not self._owns(admitted.tp, admitted.epoch):  # revoked while it was prepared
            return
        if self._tracer is not None:
            self._tracer.begin(ctx, admitted)
        self._held.hold(key, ctx)
        try:
            self._engine_of().submit(bt.Request(
                key=key, token_ids=tuple(admitted.token_ids), params=params,
                arrival_time=admitted.arrival_time, deadline=admitted.deadline,
                adapter_key=req.adapter, attempt=admitted.attempt, origin=ctx,
            ))
        except EngineClosedError:
            # Shutting down: leave it unanswered and uncommitted for the next owner.
            if self._tracer is not None:
                self._tracer.dropped(ctx, "the engine is shutting down")
            await self._held.release(key)
        except Exception as exc:
            if self._tracer is not None:
                self._tracer.dropped(ctx, f"refused by the engine: {exc}")
            await self._held.release(key)
            await self._writer.error(ctx, ErrorCode.INVALID_REQUEST, str(exc))


def _constraint(req: InferenceRequest, tool_format: str | None) -> dict[str, Any] | None:
    """What the answer is generated to fit, as `Grammars.compile` takes it: a forced tool
    call (tool_choice required, or a named function) in the model's call format, or
    response_format's JSON; None for free text."""
    choice = req.tool_choice
    if req.tools is not None and tool_format is not None and (
            choice == "required" or isinstance(choice, NamedToolChoice)):
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f["name"] == choice.function.name]
        several = choice == "required" and req.parallel_tool_calls is True
        return {"type": "lark", "grammar": tool_formats.grammar(
            tool_format, functions, several)}  # type: ignore[arg-type]
    if req.response_format is not None and req.response_format.type != "text":
        return req.response_format.model_dump(by_alias=True, exclude_none=True)
    return None


OnDone = Callable[[InFlight, bt.Finished], None]


class EventPump:
    def __init__(self, writer: ResultWriter, held: HeldRequests, engine: Engine,
                 on_done: OnDone | None = None, holds: Owns = _always,
                 may_write: Callable[[], Awaitable[bool]] = _yes,
                 tracer: RequestTracer | None = None):
        self._writer = writer
        self._tracer = tracer
        # Events of a request whose partition was revoked (handed over, or lost while this
        # worker was paused) are dropped: its new owner answers it.
        self._holds = holds
        # False after a pause past the session (`worker.membership`): dropped too.
        self._may_write = may_write
        self._held = held
        self._engine = engine
        self._on_done = on_done  # after a done event is written (the next turn's memory)
        self._switched = asyncio.Event()
        self._handling = False
        self._progress = asyncio.Condition()

    def switch(self, engine: Engine) -> None:
        """Read a new engine's events from now on (after a reload)."""
        self._engine = engine
        self._switched.set()

    async def run(self) -> None:
        while True:
            engine = self._engine
            try:  # events already queued are taken without a wait (a step emits many)
                event = engine.events.get_nowait()
            except asyncio.QueueEmpty:
                event = await self._next_or_switch(engine)
                if event is None:
                    continue
            self._handling = True
            try:
                await self._handle(event)
            except Exception:
                log.exception("writing an event failed")
            finally:
                self._handling = False
                async with self._progress:
                    self._progress.notify_all()

    async def _next_or_switch(self, engine: Engine) -> bt.Event | None:
        """The engine's next event, or None when `switch` gave the pump another engine."""
        getter = asyncio.ensure_future(engine.next_event())
        switched = asyncio.ensure_future(self._switched.wait())
        try:
            await asyncio.wait({getter, switched}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            switched.cancel()
            if not getter.done():
                getter.cancel()
        if not getter.done() or getter.cancelled():
            self._switched.clear()
            return None
        return getter.result()

    async def wait_idle(self, engine: Engine, timeout_s: float = 30.0) -> bool:
        """Until every event `engine` has emitted is handed to results."""
        try:
            async with asyncio.timeout(timeout_s), self._progress:
                await self._progress.wait_for(
                    lambda: engine.events.empty() and not self._handling)
        except TimeoutError:
            return False
        return True

    async def _handle(self, event: bt.Event) -> None:
        ctx: InFlight = event.origin
        if not await self._may_write() or not self._holds(ctx.topic_partition, ctx.epoch):
            if not isinstance(event, bt.Tokens):
                if self._tracer is not None:
                    self._tracer.dropped(ctx, "its partition went to another worker")
                await self._held.release(event.key)
            return
        if isinstance(event, bt.Tokens):
            await self._writer.tokens(ctx, list(event.token_ids), event.logprobs)
            return
        if self._tracer is not None:
            self._tracer.ending(ctx, event)
        try:
            if isinstance(event, bt.Finished):
                t = event.latency
                await self._writer.done(
                    ctx, finish_reason=event.finish_reason, token_ids=list(event.token_ids),
                    num_cached_prompt_tokens=event.counts.num_cached_prompt_tokens,
                    timing=Timing(queue_ms=max(0.0, t.queue_ms), ttft_ms=max(0.0, t.ttft_ms),
                                  total_ms=max(0.0, t.total_ms)),
                    adapter=event.adapter_key, logprobs=event.logprobs)
                if self._on_done is not None:
                    self._on_done(ctx, event)
            elif isinstance(event, bt.Failed):
                await self._writer.error(ctx, event.code, event.message)
            elif isinstance(event, bt.Expired):
                await self._writer.timeout(ctx, event.waited_ms, _timeout_reason(ctx, event))
            # Cancelled: no terminal event; the offset stays unfinished and is served again.
        finally:
            await self._held.release(event.key)


def _timeout_reason(ctx: InFlight, event: bt.Expired) -> str:
    if event.early:
        return "predicted to miss max_ttft_ms"
    if ctx.num_prompt_tokens == 0:  # admitted unchecked: it outwaited the database
        return "permission database unavailable until the request's max_ttft_ms passed"
    return "max_ttft_ms passed before the first token"
