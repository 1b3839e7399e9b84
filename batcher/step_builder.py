"""Building one step: which requests compute how many tokens (see `scheduler.py`).

A `StepBuilder` lives for one `schedule()` call. It asks the runtime about
blocks, admits and preempts through it, and records the plan; ordering comes
from `policy.py`, the yes/no of admission from `admission.StepBudget`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from batcher import outcomes
from batcher.admission import AddResult, StepBudget
from batcher.config import BatcherConfig
from batcher.outcomes import error_code
from batcher.policy import order_key, pick_victim
from batcher.runtime_port import RuntimePort
from batcher.state import RequestState, RequestStatus
from batcher.types import Event, SchedulerStats


class StepBuilder:
    def __init__(
        self,
        runtime: RuntimePort,
        config: BatcherConfig,
        running: list[RequestState],
        resident: frozenset[str] | None,
        protected: RequestState | None,
        stats: SchedulerStats,
        now: float,
    ) -> None:
        self._rt = runtime
        self._config = config
        self._running = running  # in order; grows as requests are admitted
        self._protected = protected
        self._stats = stats
        self._now = now
        self._num_step_blocks = 0
        self._cached: dict[str, int] = {}
        self._preempted: set[str] = set()
        self._in_step: dict[str, RequestState] = {}
        self.scheduled: dict[str, int] = {}
        self.budget = StepBudget(
            num_tokens_left=config.max_num_batched_tokens,
            num_seqs_left=config.max_num_seqs,
            num_admittable_blocks=0,
            max_adapters=config.max_adapters_per_step,
            adapters=set(),
            resident=resident,
        )
        self._refresh_budget()

    # ---- queries ---------------------------------------------------------------------

    def num_cached_tokens(self, state: RequestState) -> int:
        cached = self._cached.get(state.key)
        if cached is None:
            cached = self._rt.num_cached_tokens(state.all_token_ids, state.request.adapter_key)
            self._cached[state.key] = cached
        return cached

    def step_adapters(self) -> set[str]:
        return {k for s in self._in_step.values() if (k := s.request.adapter_key) is not None}

    def _live_running(self) -> list[RequestState]:
        return [s for s in self._running if s.status is RequestStatus.RUNNING]

    def _num_blocks_to_admit(self, state: RequestState) -> int:
        bs = self._rt.block_manager.block_size
        return -(-state.num_tokens // bs) - self.num_cached_tokens(state) // bs

    def _headroom(self) -> int:
        return self._config.kv_headroom_blocks if self._live_running() else 0

    def _refresh_budget(self) -> None:
        """Admittable blocks = free blocks - blocks promised to running prompts."""
        running = self._live_running()
        prompts = {s.key: s.num_uncomputed for s in running if not s.is_decoding}
        prompts = {k: v for k, v in prompts.items() if v > 0}
        promised = self._rt.num_blocks_needed(prompts) if prompts else 0
        free = self._rt.block_manager.num_free_blocks - self._num_step_blocks
        self.budget.num_admittable_blocks = free - promised
        self.budget.adapters = {k for s in running if (k := s.request.adapter_key) is not None}

    # ---- building --------------------------------------------------------------------

    def make_room(self, waiting: list[RequestState]) -> None:
        """Preempt later-deadline running requests so the head waiting request fits."""
        if (
            not waiting
            or self.budget.check_adapter(waiting[0].request.adapter_key) is not AddResult.OK
        ):
            return
        head = waiting[0]
        need = self._num_blocks_to_admit(head)
        while need + self._headroom() > self.budget.num_admittable_blocks:
            policy = self._config.ordering
            later = [
                s for s in self._live_running() if order_key(s, policy) > order_key(head, policy)
            ]
            protected_id = self._protected.key if self._protected else None
            later = [s for s in later if s.key != protected_id]
            victim = pick_victim(later, policy, None)
            if victim is None:
                return
            self._preempt(victim)
            self._refresh_budget()

    def build(self, waiting: list[RequestState]) -> list[Event]:
        """Fill the step; returns terminal events of requests the runtime rejected."""
        events: list[Event] = []
        for state in [s for s in self._running if s.is_decoding]:
            if self.budget.num_seqs_left < 1:
                break
            if state.status is RequestStatus.RUNNING and state.key not in self.scheduled:
                self._schedule_running(state, 1)
        bulk = self._protected
        if bulk is not None and bulk.key not in self.scheduled:
            reserve = self._config.num_bulk_reserved_tokens
            if bulk.status is RequestStatus.RUNNING:
                self._schedule_running(bulk, min(bulk.num_uncomputed, reserve))
            elif bulk.status is not RequestStatus.FINISHED:
                self._try_admit(bulk, reserve, events)
        self._fill(waiting, events)
        self._top_up_bulk()
        return events

    def _fill(self, waiting: list[RequestState], events: list[Event]) -> None:
        policy = self._config.ordering
        prompts = [s for s in self._running if not s.is_decoding]
        merged = heapq.merge(prompts, waiting, key=lambda s: order_key(s, policy)[0])
        admitting = True
        for state in merged:
            if self.budget.num_tokens_left < 1 or self.budget.num_seqs_left < 1:
                return
            if state.key in self.scheduled or state.key in self._preempted:
                continue
            if state.status is RequestStatus.RUNNING:
                self._schedule_running(
                    state, min(state.num_uncomputed, self.budget.num_tokens_left)
                )
            elif admitting and state.status is not RequestStatus.FINISHED:
                result = self._try_admit(state, self.budget.num_tokens_left, events)
                # Strict order: a request that does not fit holds back later ones,
                # or a long prompt would wait behind a stream of short ones.
                admitting = result is not AddResult.NO_BLOCKS

    def _top_up_bulk(self) -> None:
        bulk = self._protected
        if bulk is None or bulk.key not in self.scheduled:
            return
        n = self.scheduled[bulk.key]
        extra = min(bulk.num_uncomputed - n, self.budget.num_tokens_left)
        if extra < 1:
            return
        more = self._rt.num_blocks_needed({bulk.key: n + extra})
        more -= self._rt.num_blocks_needed({bulk.key: n})
        if more <= self._rt.block_manager.num_free_blocks - self._num_step_blocks:
            self.scheduled[bulk.key] = n + extra
            self.budget.num_tokens_left -= extra
            self._num_step_blocks += more

    def _try_admit(self, state: RequestState, max_tokens: int, events: list[Event]) -> AddResult:
        key = state.request.adapter_key
        need = self._num_blocks_to_admit(state)
        result = self.budget.check_admit(key, need, self._headroom())
        if result is not AddResult.OK:
            return result
        try:
            if state.status is RequestStatus.WAITING:
                req = state.request
                computed = self._rt.add_sequence(req.key, req.token_ids, req.params, key)
                state.num_cached_prompt_tokens = computed
            else:
                computed = self._rt.resume(state.key)
        except Exception as exc:  # a bad request must not take the step down
            if state.status is RequestStatus.PREEMPTED:
                self._rt.remove_sequence(state.key)
            code = error_code(exc)
            events.append(outcomes.finish(state, outcomes.error_event(state, code, str(exc))))
            self._stats.num_errors += 1
            return AddResult.OK
        if self._rt.block_manager.num_free_blocks < self._num_step_blocks:
            # Its cached prefix came out of the free blocks this step already counts on.
            self._rt.preempt(state.key)
            state.status = RequestStatus.PREEMPTED
            self._preempted.add(state.key)
            return AddResult.NO_BLOCKS
        state.status = RequestStatus.RUNNING
        state.num_computed_tokens = computed
        self.budget.admit(key, need)
        self._running.append(state)
        n = min(state.num_uncomputed, max_tokens, self.budget.num_tokens_left)
        self._schedule_running(state, n, allow_preempt=False)
        return AddResult.OK

    def _schedule_running(self, state: RequestState, n: int, *, allow_preempt: bool = True) -> bool:
        """Put `n` tokens of a running request in the step, preempting if blocks lack."""
        if n < 1:
            return False
        policy = self._config.ordering
        protected_id = self._protected.key if self._protected else None
        while True:
            need = self._rt.num_blocks_needed({state.key: n})
            if need <= self._rt.block_manager.num_free_blocks - self._num_step_blocks:
                break
            if not allow_preempt:
                return False
            victim = pick_victim(self._victims(state), policy, protected_id)
            outranks = victim is not None and (
                state.key == protected_id
                or order_key(victim, policy) > order_key(state, policy)
            )
            self._preempt(victim if outranks else state)
            if not outranks:
                return False
        self.scheduled[state.key] = n
        self._in_step[state.key] = state
        self._num_step_blocks += need
        self.budget.take(n)
        if state.first_scheduled_time is None:
            state.first_scheduled_time = self._now
        return True

    def _victims(self, state: RequestState) -> Iterable[RequestState]:
        return (
            s
            for s in self._live_running()
            if s.key not in self.scheduled and s.key != state.key
        )

    def _preempt(self, state: RequestState) -> None:
        self._rt.preempt(state.key)
        state.status = RequestStatus.PREEMPTED
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        self._preempted.add(state.key)
        self._stats.num_preemptions += 1
