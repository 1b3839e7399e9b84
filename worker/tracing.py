"""A request's trace in a worker: moments recorded as it goes, exported when it ends.

Each admitted request gets one span, a child of the span its record's
`traceparent` names (a new trace without one), begun at the record's broker
timestamp; its reply records carry that span's `traceparent`. The rest is
recorded as plain timestamps while the request runs — a model step appends four
numbers to each request's array that rode in it — and handed to the exporter once
its offset is committed (or it ends without a commit to wait for), as one tuple
that the encoding process turns into the child spans (`common.tracing.RequestSpans`)::

    sluice.request (consumer)   record timestamp -> offset committed
      queue wait                record timestamp -> read by this worker
      admission                 read -> first scheduled: checks, permission and
                                prompt (event "submitted"), then the batcher's budget
      prefill                   first scheduled -> first token; an event per step
      decode                    first token -> last token; an event per step
      delivery                  terminal event handed to the producer -> acknowledged
      commit                    acknowledged -> offset committed (exactly-once: in the
                                transaction with the answer)

A `step` event carries the step's batch size (`sluice.step.requests`), its
duration (`sluice.step.ms`) and, for a prompt chunk, this request's tokens in it:
the batches a request rode in, without a span per token. A span keeps its first
OTEL_SPAN_EVENT_COUNT_LIMIT (128) steps; `sluice.steps` counts them all.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batcher import types as bt
from batcher.engine import StepStats
from common.tracing import Attributes, Span, Stages, Tracing
from ingest.verdicts import Admitted
from results.inflight import InFlight


@dataclass(slots=True)
class RequestTrace:
    span: Span
    arrival: float  # the record's broker timestamp
    read: float
    submitted: float = 0.0
    # Four numbers a step it rode in (`common.tracing.Stages.steps`).
    steps: array = field(default_factory=lambda: array("d"))
    ended: float = 0.0  # the engine's terminal event
    first_scheduled: float | None = None
    first_token: float | None = None
    outcome: str = ""  # done | error | timeout | cancelled
    error: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    sent: float = 0.0  # terminal event handed to the producer
    acked: float = 0.0


class RequestTracer:
    """The traces of the requests a worker holds (only made with tracing on)."""

    def __init__(self, tracing: Tracing, held: Any):
        self.tracing = tracing
        self._held = held  # key -> InFlight (`worker.requests.HeldRequests`)
        self._unacked: dict[tuple[Any, int], RequestTrace] = {}
        # Per partition: acknowledged, waiting for the commit (a heap of offsets).
        self._uncommitted: dict[Any, tuple[list[int], dict[int, RequestTrace]]] = {}

    # ---- as a request goes ------------------------------------------------------------

    def begin(self, ctx: InFlight, admitted: Admitted) -> None:
        tp = admitted.tp
        attributes = {"messaging.system": "kafka", "messaging.operation.type": "process",
                      "messaging.destination.name": tp.topic,
                      "messaging.destination.partition.id": str(tp.partition),
                      "messaging.kafka.offset": admitted.offset,
                      "messaging.message.id": admitted.request.request_id}
        if admitted.request.adapter is not None:
            attributes["sluice.adapter"] = admitted.request.adapter
        if admitted.attempt:
            attributes["sluice.attempt"] = admitted.attempt
        span = self.tracing.begin("sluice.request", admitted.trace_headers,
                                  admitted.arrival_time, kind="consumer", attributes=attributes)
        ctx.trace = RequestTrace(span, admitted.arrival_time, admitted.read_time or time.time(),
                                 submitted=time.time())
        ctx.reply_headers = span.headers

    def on_step(self, stats: StepStats) -> None:
        """A model step ended: note it for each traced request that rode in it."""
        step_of = self._held.get
        for key, num_tokens in stats.num_scheduled_tokens.items():
            ctx = step_of(key)
            if ctx is not None and ctx.trace is not None:
                ctx.trace.steps.extend((stats.started_at, stats.seconds, num_tokens,
                                        stats.num_seqs))

    def ending(self, ctx: InFlight, event: bt.Event) -> None:
        """The engine ended the request; its terminal event is written next (none for a
        silent cancel: the trace ends here)."""
        trace: RequestTrace | None = ctx.trace
        if trace is None:
            return
        now = time.time()
        trace.ended = trace.sent = now
        if isinstance(event, bt.Finished):
            t = event.latency
            trace.outcome = "done"
            trace.first_scheduled = trace.arrival + t.queue_ms / 1000
            trace.first_token = trace.arrival + t.ttft_ms / 1000
            trace.ended = trace.arrival + t.total_ms / 1000
            trace.attributes.update({
                "sluice.finish_reason": event.finish_reason,
                "gen_ai.usage.input_tokens": event.counts.num_prompt_tokens,
                "sluice.cached_prompt_tokens": event.counts.num_cached_prompt_tokens,
                "gen_ai.usage.output_tokens": event.counts.num_completion_tokens})
        elif isinstance(event, bt.Failed):
            trace.outcome, trace.error = "error", f"{event.code.value}: {event.message}"
        elif isinstance(event, bt.Expired):
            trace.outcome, trace.error = "timeout", f"waited {event.waited_ms:.0f} ms"
        else:
            trace.outcome = "cancelled"
            self._emit(trace, None)
            ctx.trace = None
            return
        self._unacked[(ctx.topic_partition, ctx.offset)] = trace

    def dropped(self, ctx: InFlight, why: str) -> None:
        """The request ends unanswered here (its partition went to another worker)."""
        trace: RequestTrace | None = ctx.trace
        if trace is not None:
            trace.ended = time.time()
            trace.outcome, trace.error = "dropped", why
            self._emit(trace, None)
            ctx.trace = None

    # ---- its offset ---------------------------------------------------------------------

    def acking(self, finish: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
        """`finish` (an offset's answer was acknowledged), telling this tracer too."""
        def finished(tp: Any, offset: int) -> None:
            finish(tp, offset)
            self.acked(tp, offset)

        return finished

    def acked(self, tp: Any, offset: int) -> None:
        """The terminal event (or the dead letter in its place) was acknowledged."""
        trace = self._unacked.pop((tp, offset), None)
        if trace is None:
            return
        trace.acked = time.time()
        heap, traces = self._uncommitted.setdefault(tp, ([], {}))
        heapq.heappush(heap, offset)
        traces[offset] = trace

    def committed(self, tp: object, offset: int) -> None:
        waiting = self._uncommitted.get(tp)
        if waiting is None:
            return
        heap, traces = waiting
        now = time.time()
        while heap and heap[0] < offset:
            self._emit(traces.pop(heapq.heappop(heap)), now)

    def released(self, tp: object) -> None:
        now = time.time()
        _heap, traces = self._uncommitted.pop(tp, ([], {}))
        for trace in traces.values():
            trace.error = trace.error or "the partition was let go of before the commit"
            self._emit(trace, None, now)
        for key in [k for k in self._unacked if k[0] == tp]:
            self._emit(self._unacked.pop(key), None, now)

    async def close(self) -> None:
        """The worker stops: what is still open ends now, uncommitted, and the spans
        still queued are exported (off the event loop: the exporter blocks)."""
        for tp in list(self._uncommitted):
            self.released(tp)
        now = time.time()
        for trace in self._unacked.values():
            self._emit(trace, None, now)
        self._unacked.clear()
        await asyncio.to_thread(self.tracing.shutdown)

    # ---- spans ------------------------------------------------------------------------

    def _emit(self, trace: RequestTrace, committed: float | None,
              end: float | None = None) -> None:
        """The request's span ended, with its stages for the child spans."""
        final = committed or end or trace.acked or trace.ended
        attributes: Attributes = {**trace.attributes, "sluice.outcome": trace.outcome,
                                  "sluice.committed": committed is not None}
        self.tracing.end(trace.span, final, attributes=attributes, error=trace.error,
                         stages=Stages(trace.arrival, trace.read, trace.submitted,
                                       trace.first_scheduled, trace.first_token, trace.ended,
                                       trace.steps, trace.sent, trace.acked, committed))
