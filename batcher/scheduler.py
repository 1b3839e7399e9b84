"""The deadline-aware continuous batcher: `schedule() -> plan`, `update(plan, output) -> events`.

There are no prefill or decode phases: each request has `num_computed_tokens`
and a step says how many more to compute, under one token budget. A step is
built in this order:

1. decodes of running requests (one token each), so long prompts never stall them;
2. a slice of `bulk_token_share` of the budget for the oldest bulk request;
3. running prompt chunks and waiting requests, merged in EDF order; a waiting
   request starts only if `StepBudget` admits it (tokens, sequences, KV blocks
   for its whole uncached prompt + headroom, adapter slots);
4. what budget is left tops up that bulk request.

Bulk vs interactive: EDF alone serves the tightest deadline first, so
interactive work is never held behind bulk (bulk deadlines are far away and
bulk is preempted first). But under a steady interactive stream EDF alone lets
a bulk request wait until its loose deadline nearly passes, and then time out.
A reserved share for the *oldest* bulk request (admitted first, never picked
for preemption while another victim exists) bounds how long bulk stalls,
costs interactive work at most that share of a step, and keeps bulk's KV
footprint to what it actually uses. Deadline aging is already EDF's own
behaviour; the reserve is what guarantees progress before the deadline.

Preemption: when a running request needs a block and none is free, the running
request latest in order (latest deadline) not yet in this step is preempted
(recomputed later; its full blocks stay cached, so its prefix may survive).
A waiting request at the head of the order may also preempt running requests
with later deadlines to get in. A request can never fit only if its prompt
exceeds the cache: that is rejected at once with `context_too_long`.

Deadlines: a request whose deadline passes before its first token is sampled
is removed and gets one `timeout` event; a first token sampled after the
deadline is not sent. With `early_timeout`, a waiting request that cannot get
its first token in time even if started now (measured prefill speed) times
out at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from batcher import outcomes
from batcher.config import BatcherConfig
from batcher.errors import DuplicateRequestError
from batcher.policy import order, order_key, pick_victim
from batcher.runtime_port import AdapterSlots, RuntimePort
from batcher.state import RequestState, RequestStatus
from batcher.step_builder import StepBuilder
from batcher.types import Event, Request, RequestClass, SchedulerStats
from gpu_runtime.errors import OutOfBlocksError
from gpu_runtime.sequence import SeqOutput, StepOutput, StepPlan
from schemas import ErrorCode

_RATE_SMOOTHING = 0.3  # weight of the newest step in the prefill-speed average


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One step: the runtime's plan plus what the engine does around it."""

    step: StepPlan | None  # None: nothing to compute now
    events: list[Event]  # decided while planning: timeouts, rejections, cancellations
    adapter_keys: frozenset[str]  # non-base adapters this step uses (keep them loaded)
    adapters_to_load: tuple[str, ...]  # wanted by waiting requests, not resident
    scheduled_time: float

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.step.num_scheduled_tokens.values()) if self.step else 0


class Scheduler:
    def __init__(
        self,
        runtime: RuntimePort,
        config: BatcherConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.config = config or BatcherConfig()
        self.stats = SchedulerStats()
        self._rt = runtime
        self._clock = clock
        self._adapters = adapters
        self._states: dict[str, RequestState] = {}
        self._outbox: list[Event] = []
        self._num_submitted = 0
        self._prefill_rate: float | None = None  # tokens / s, measured on busy steps
        # Requests of a step that failed without naming a culprit: each runs alone
        # until it either succeeds (cleared) or fails alone (it was the culprit).
        self._suspects: set[str] = set()

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    @property
    def num_waiting(self) -> int:
        return sum(s.status is not RequestStatus.RUNNING for s in self._states.values())

    @property
    def num_running(self) -> int:
        return sum(s.status is RequestStatus.RUNNING for s in self._states.values())

    def has_work(self) -> bool:
        return bool(self._states or self._outbox)

    def is_full(self) -> bool:
        return self.num_waiting >= self.config.max_num_waiting

    def next_deadline(self) -> float | None:
        """Earliest deadline of a request still without its first token."""
        pending = [s.deadline for s in self._states.values() if not s.has_first_token]
        return min(pending, default=None)

    def get_state(self, key: str) -> RequestState | None:
        return self._states.get(key)

    # ---- intake ----------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request. Bad input ends it with an `error` event at the next step."""
        if request.key in self._states:
            raise DuplicateRequestError(f"request {request.key!r} is already in flight")
        cls = request.request_class or (
            RequestClass.BULK
            if request.ttft_allowance >= self.config.bulk_min_ttft
            else RequestClass.INTERACTIVE
        )
        state = RequestState(request, cls, self._num_submitted)
        self._num_submitted += 1
        now = self._clock()
        if now >= state.deadline:
            # Its first token is already late (it waited elsewhere, e.g. for the permission
            # database): a timeout, whatever its content.
            self._outbox.append(outcomes.finish(state, outcomes.timeout_event(state, now)))
            self.stats.num_timeouts += 1
            return
        problem = self._reject_reason(request)
        if problem is not None:
            code, message = problem
            self._outbox.append(outcomes.finish(state, outcomes.error_event(state, code, message)))
            self.stats.num_errors += 1
            return
        self._states[request.key] = state

    def _reject_reason(self, request: Request) -> tuple[str, str] | None:
        if not request.key:
            return ErrorCode.INVALID_REQUEST, "key is empty"
        if not request.token_ids:
            return ErrorCode.INVALID_REQUEST, "the prompt is empty"
        if not request.ttft_allowance > 0:
            return ErrorCode.INVALID_REQUEST, (
                f"the deadline must come after the arrival, got {request.ttft_allowance:g} s")
        bm = self._rt.block_manager
        capacity = bm.num_blocks * bm.block_size
        if len(request.token_ids) >= capacity:
            return ErrorCode.CONTEXT_TOO_LONG, (
                f"prompt has {len(request.token_ids)} tokens; the KV cache holds {capacity}"
            )
        return None

    def cancel(self, key: str, *, answer: bool = False) -> bool:
        """Cancel a request; its `cancelled` event comes with the next plan or update.
        With `answer` (a client's cancel) it ends with a `done` event instead, its
        finish_reason "cancelled" and the tokens generated so far."""
        state = self._states.get(key)
        if state is None or state.cancel_requested or state.status is RequestStatus.FINISHED:
            return False
        state.cancel_requested = True
        state.cancel_answered = answer
        return True

    # ---- the step --------------------------------------------------------------------

    def schedule(self) -> BatchPlan:
        now = self._clock()
        events, self._outbox = self._outbox, []
        self._end_cancelled(events, now)
        self._expire(now, events)
        policy = self.config.ordering
        live = [s for s in self._states.values() if s.status is not RequestStatus.FINISHED]
        running = order((s for s in live if s.status is RequestStatus.RUNNING), policy)
        resident = self._adapters.resident_adapters() if self._adapters is not None else None
        builder = StepBuilder(
            self._rt, self.config, running, resident, self._protected_bulk(), self.stats, now
        )
        waiting = [s for s in live if s.status is not RequestStatus.RUNNING]
        waiting = order(waiting, policy, builder.num_cached_tokens)
        builder.make_room(waiting)
        events.extend(builder.build(waiting))
        for event in events:
            self._forget(event.key)
        self._count_plan(builder)
        plan = self._isolate(builder.scheduled)
        return BatchPlan(
            StepPlan(dict(plan)) if plan else None,
            events,
            frozenset(builder.step_adapters()),
            tuple(builder.budget.wanted_adapters),
            now,
        )

    def _isolate(self, plan: dict[str, int]) -> dict[str, int]:
        """While suspects remain, a step runs exactly one of them, alone."""
        self._suspects &= self._states.keys()
        for seq_id in plan:
            if seq_id in self._suspects:
                return {seq_id: plan[seq_id]}
        return {k: n for k, n in plan.items() if k not in self._suspects}

    def update(self, plan: BatchPlan, output: StepOutput) -> list[Event]:
        """Apply a step's output; returns token and terminal events."""
        if plan.step is not None:
            self._suspects -= plan.step.num_scheduled_tokens.keys()
        now = self._clock()
        self._measure(plan, now)
        events: list[Event] = []
        for seq_id, num_computed in output.num_computed_tokens.items():
            state = self._states.get(seq_id)
            if state is not None:
                state.num_computed_tokens = num_computed
        for out in output.outputs:
            state = self._states.get(out.seq_id)
            if state is not None:
                events.extend(self._apply_output(state, out, now))
                self._forget(out.seq_id)
        return events

    def _apply_output(self, state: RequestState, out: SeqOutput, now: float) -> list[Event]:
        if state.cancel_requested or (not state.has_first_token and now > state.deadline):
            if not out.finished:  # the runtime already dropped finished sequences
                self._rt.remove_sequence(state.key)
            if state.cancel_requested:
                self.stats.num_cancelled += 1
                return [outcomes.finish(state, outcomes.cancelled_event(state, now))]
            self.stats.num_timeouts += 1  # a first token sampled too late is not sent
            return [outcomes.finish(state, outcomes.timeout_event(state, now))]
        if not state.has_first_token:
            state.first_token_time = now
        state.output_token_ids.append(out.token_id)
        if out.logprob is not None:
            state.output_logprobs.append((out.logprob, out.top_logprobs))
        events: list[Event] = [outcomes.token_event(state, out.token_id)]
        if out.finished:
            state.num_cached_prompt_tokens = out.num_cached_prompt_tokens
            self.stats.num_finished += 1
            reason = out.finish_reason or "stop"
            events.append(outcomes.finish(state, outcomes.done_event(state, reason, now)))
        return events

    def fail_step(self, plan: BatchPlan, exc: BaseException) -> list[Event]:
        """The runtime raised while executing `plan`; end whom it concerns, keep the rest.

        An error naming one sequence (`exc.seq_id`) fails that request only: the
        runtime's plan check changed nothing. `OutOfBlocksError` fails nobody
        (a request is preempted instead). Anything else may have left the
        runtime half-updated, so every request it holds fails with `internal`.
        """
        if isinstance(exc, OutOfBlocksError):
            victim = pick_victim(
                (s for s in self._states.values() if s.status is RequestStatus.RUNNING),
                self.config.ordering,
                None,
            )
            if victim is not None:
                self._rt.preempt(victim.key)
                victim.status = RequestStatus.PREEMPTED
                self.stats.num_preemptions += 1
            return []
        seq_id = getattr(exc, "seq_id", None)
        if plan.step is not None and seq_id in plan.step.num_scheduled_tokens:
            state = self._states.get(seq_id)
            return self._fail([state] if state is not None else [], exc)
        scheduled = list(plan.step.num_scheduled_tokens) if plan.step is not None else []
        if len(scheduled) > 1:
            # No culprit named: the forward pass changed no bookkeeping, so every
            # request of the step can run again — alone, to find the one that fails.
            self._suspects.update(scheduled)
            self.stats.num_isolated_failures += 1
            return []
        targets = [self._states[s] for s in scheduled if s in self._states]
        self._suspects.difference_update(scheduled)
        return self._fail(targets, exc)

    def fail_all(self, exc: BaseException) -> list[Event]:
        """The scheduler itself failed: end every unfinished request with `internal`."""
        return self._fail(list(self._states.values()), exc)

    def _fail(self, targets: list[RequestState], exc: BaseException) -> list[Event]:
        events: list[Event] = []
        message = f"step failed: {type(exc).__name__}: {exc}"
        for state in targets:
            if state.in_runtime:
                with contextlib.suppress(Exception):  # the runtime may be the broken part
                    self._rt.remove_sequence(state.key)
            events.append(
                outcomes.finish(state, outcomes.error_event(state, ErrorCode.INTERNAL, message))
            )
            self.stats.num_errors += 1
            self._forget(state.key)
        return events

    def abandon(self) -> list[Request]:
        """Forget every unfinished request without an event (engine stop; redelivered later)."""
        dropped = []
        for state in list(self._states.values()):
            if state.in_runtime:
                self._rt.remove_sequence(state.key)
            dropped.append(state.request)
        self._states.clear()
        return dropped

    # ---- helpers ---------------------------------------------------------------------

    def _forget(self, key: str) -> None:
        state = self._states.get(key)
        if state is not None and state.status is RequestStatus.FINISHED:
            del self._states[key]

    def _end_cancelled(self, events: list[Event], now: float) -> None:
        for state in list(self._states.values()):
            if state.cancel_requested and state.status is not RequestStatus.FINISHED:
                if state.in_runtime:
                    self._rt.remove_sequence(state.key)
                events.append(outcomes.finish(state, outcomes.cancelled_event(state, now)))
                self.stats.num_cancelled += 1

    def _expire(self, now: float, events: list[Event]) -> None:
        for state in self._states.values():
            if state.status is RequestStatus.FINISHED or state.has_first_token:
                continue
            early = not now >= state.deadline and self._misses_deadline(state, now)
            if now >= state.deadline or early:
                if state.in_runtime:
                    self._rt.remove_sequence(state.key)
                events.append(
                    outcomes.finish(state, outcomes.timeout_event(state, now, early=early))
                )
                self.stats.num_timeouts += 1
                self.stats.num_early_timeouts += early

    def _misses_deadline(self, state: RequestState, now: float) -> bool:
        """Early timeout: even started now, prefill at the measured speed ends too late."""
        if not self.config.early_timeout or self._prefill_rate is None:
            return False
        if state.status is RequestStatus.RUNNING:
            return False  # already being computed; let it try
        margin = self.config.early_timeout_margin / self._prefill_rate
        if now + state.num_tokens * margin <= state.deadline:
            return False
        cached = self._rt.num_cached_tokens(state.all_token_ids, state.request.adapter_key)
        return now + (state.num_tokens - cached) * margin > state.deadline

    def _protected_bulk(self) -> RequestState | None:
        if self.config.num_bulk_reserved_tokens < 1:
            return None
        bulk = [s for s in self._states.values() if s.request_class is RequestClass.BULK]
        return min(bulk, key=lambda s: order_key(s, self.config.ordering), default=None)

    def _count_plan(self, builder: StepBuilder) -> None:
        if builder.scheduled:
            self.stats.num_steps += 1
            self.stats.num_scheduled_tokens += sum(builder.scheduled.values())
            self.stats.max_adapters_in_step = max(
                self.stats.max_adapters_in_step, len(builder.step_adapters())
            )

    def _measure(self, plan: BatchPlan, now: float) -> None:
        elapsed = now - plan.scheduled_time
        tokens = plan.num_scheduled_tokens
        if elapsed <= 0 or tokens < self.config.max_num_batched_tokens // 2:
            return  # small steps are bound by weight reads, not by prompt tokens
        rate = tokens / elapsed
        old = self._prefill_rate
        self._prefill_rate = rate if old is None else old + _RATE_SMOOTHING * (rate - old)
