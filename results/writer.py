"""Answering requests: each outcome translated (`translate`), written (`delivery`), counted.

The worker calls one method per outcome of a request: `tokens`, `done`,
`error`, `timeout` for an in-flight one; `refusal` and `dead_letter` for a
record that never became one. Building a terminal event that fails (a
detokenizer error, say) still ends the request: with `error` `internal`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from common.tracing import Headers
from results.delivery import Delivery, OnFinished
from results.inflight import InFlight
from results.producer import KafkaProducerPort, ProducerPort
from results.transactions import PartitionTransactions
from results.translate import Translator
from schemas import ErrorCode, Timing

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResultsOptions:
    """Plain values results works with (the worker builds them from the settings)."""

    model: str
    timeouts_topic: str
    deadletter_topic: str
    producer_options: Mapping[str, Any]  # aiokafka producer options (bootstrap, security)
    request_timeout_s: float  # of each send (SLUICE_CLIENT__TIMEOUT_SECS)


class ResultsMetrics(Protocol):
    """What results reports (the worker's Prometheus metrics)."""

    def add_generated_tokens(self, num_tokens: int) -> None: ...

    def observe_inter_token(self, seconds: float) -> None: ...

    def observe_ttft(self, seconds: float) -> None: ...

    def observe_end_to_end(self, seconds: float) -> None: ...

    def observe_prompt(self, num_prompt_tokens: int, num_cached_prompt_tokens: int) -> None: ...

    def observe_terminal(self, kind: Any, code: str | None = None) -> None: ...

    def observe_dead_letter(self) -> None: ...


class ResultWriter:
    def __init__(self, options: ResultsOptions, on_finished: OnFinished,
                 metrics: ResultsMetrics | None = None, producer: ProducerPort | None = None):
        self.options = options
        self.metrics = metrics
        self.translate = Translator(options.model, options.timeouts_topic,
                                    options.deadletter_topic)
        self.delivery = Delivery(
            producer or KafkaProducerPort(options.producer_options, options.request_timeout_s),
            on_finished, self.translate.undeliverable,
            on_dead_letter=metrics.observe_dead_letter if metrics is not None else None)
        self._last_token_at: dict[str, float] = {}
        self.num_terminal = 0

    async def start(self) -> None:
        await self.delivery.start()

    async def stop(self) -> None:
        await self.delivery.stop()

    async def flush(self) -> None:
        await self.delivery.flush()

    async def use_transactions(self, group_id: str | None) -> PartitionTransactions | None:
        """Exactly-once delivery (transactions of the model's consumer group `group_id`,
        one producer per owned partition: `open_partitions` makes them) or at-least-once
        (None) from now on; returns the transactions in use. Only between requests."""
        current = self.delivery.transactions
        if current is not None and (group_id is None or current.group_id != group_id):
            await self.delivery.use_transactions(None)
            await current.close_all()
            current = None
        if group_id is not None and current is None:
            current = PartitionTransactions(self.options.producer_options,
                                            self.options.request_timeout_s, group_id)
            await self.delivery.use_transactions(current)
        return current

    # ---- in-flight requests -----------------------------------------------------------

    async def tokens(self, ctx: InFlight, token_ids: list[int],
                     logprobs: Sequence[Any] | None = None) -> None:
        try:
            record = self.translate.tokens(ctx, token_ids, logprobs)
        except Exception:
            log.exception("a token event could not be built; the done event carries every "
                          "token", extra={"request_id": ctx.request_id})
            return
        self._observe_tokens(ctx, token_ids)
        if record is not None:
            await self.delivery.best_effort(record)

    async def done(self, ctx: InFlight, *, finish_reason: str, token_ids: list[int],
                   num_cached_prompt_tokens: int, timing: Timing, adapter: str | None,
                   logprobs: Sequence[Any] | None = None) -> None:
        try:
            records = self.translate.done(
                ctx, finish_reason=finish_reason, token_ids=token_ids,
                num_cached_prompt_tokens=num_cached_prompt_tokens, timing=timing,
                adapter=adapter, logprobs=logprobs)
        except Exception as exc:
            log.exception("a done event could not be built", extra={"request_id": ctx.request_id})
            await self.error(ctx, ErrorCode.INTERNAL,
                             f"the reply could not be built: {type(exc).__name__}: {exc}")
            return
        if self.metrics is not None:
            self.metrics.observe_ttft(timing.ttft_ms / 1000)
            self.metrics.observe_end_to_end(timing.total_ms / 1000)
            self.metrics.observe_prompt(ctx.num_prompt_tokens, num_cached_prompt_tokens)
        self._observe_end(ctx.request_id, "done")
        *tail, terminal = records
        for record in tail:
            await self.delivery.best_effort(record)
        self.num_terminal += 1
        await self.delivery.terminal(terminal, ctx)

    async def error(self, ctx: InFlight, code: ErrorCode, message: str) -> None:
        self._observe_end(ctx.request_id, "error", code.value)
        self.num_terminal += 1
        await self.delivery.terminal(self.translate.error(ctx, code, message), ctx)

    async def timeout(self, ctx: InFlight, waited_ms: float, reason: str) -> None:
        log_record, terminal = self.translate.timeout(ctx, waited_ms, reason)
        await self.delivery.best_effort(log_record, tp=ctx.topic_partition)
        self._observe_end(ctx.request_id, "timeout")
        self.num_terminal += 1
        await self.delivery.terminal(terminal, ctx)

    # ---- records that never became in-flight requests ----------------------------------

    async def refusal(self, *, tp: Any, offset: int, reply_topic: str, request_id: str,
                      code: ErrorCode, message: str, headers: Headers | None = None) -> None:
        """An error for a record that never became an in-flight request (`headers`: the
        record's trace context, passed on)."""
        self._observe_end(request_id, "error", code.value)
        await self.delivery.finishing(
            self.translate.refusal(reply_topic, request_id, code, message, headers), tp,
            offset)

    async def dead_letter(self, *, tp: Any, offset: int, key: bytes | None, value: bytes,
                          reason: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_dead_letter()
        record = self.translate.dead_letter(topic=tp.topic, partition=tp.partition,
                                            offset=offset, key=key, value=value, reason=reason)
        await self.delivery.finishing(record, tp, offset)

    # ---- metrics and logs --------------------------------------------------------------

    def _observe_tokens(self, ctx: InFlight, token_ids: list[int]) -> None:
        if self.metrics is None or not token_ids:
            return
        self.metrics.add_generated_tokens(len(token_ids))
        now = time.monotonic()
        previous = self._last_token_at.get(ctx.request_id)
        if previous is not None:
            for _ in token_ids:
                self.metrics.observe_inter_token((now - previous) / len(token_ids))
        self._last_token_at[ctx.request_id] = now

    def _observe_end(self, request_id: str, kind: str, code: str | None = None) -> None:
        self._last_token_at.pop(request_id, None)
        level = logging.DEBUG if kind == "done" else logging.INFO
        log.log(level, "request ended: %s%s", kind, f" ({code})" if code else "",
                extra={"request_id": request_id})
        if self.metrics is not None:
            self.metrics.observe_terminal(kind, code)
