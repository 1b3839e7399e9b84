"""The request side of a worker: the model's prompts, the router and the consumer.

`RequestIngest` reads and judges records; the router hands admitted requests to
the engine of the model loaded now (the runtime may be replaced by a reload, so
it is looked up at each request); a templated chat's answer is remembered so
that its next turn is found in the KV cache; a poll's routine Kafka error is
waited out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    KafkaError,
    TopicAuthorizationFailedError,
)

from batcher import types as bt
from batcher.engine import Engine
from common.settings import Settings
from gpu_runtime import Runtime
from ingest.consumer import RequestIngest
from ingest.offsets import OffsetTracker
from ingest.partitioning import PartitionAudit
from ingest.permissions import PermissionChecker
from ingest.prompting import PromptBuilder
from results.inflight import InFlight
from results.writer import ResultWriter
from schemas import ModelDeployment
from worker.loaded_model import LoadedModel
from worker.metrics import WorkerMetrics
from worker.options import ingest_options
from worker.requests import HeldRequests, Router
from worker.tracing import RequestTracer

log = logging.getLogger(__name__)

POLL_RETRY_S = 1.0


class Intake:
    def __init__(self, loaded: LoadedModel, *, held: HeldRequests, tracker: OffsetTracker,
                 metrics: WorkerMetrics, tracer: RequestTracer | None = None):
        self._loaded = loaded
        self._tracer = tracer
        self._held = held
        self._tracker = tracker
        self._metrics = metrics
        self.prompts: PromptBuilder | None = None
        self._poll_failure: str | None = None  # why the last poll failed

    def make_ingest(self, settings: Settings, instance_id: str, dep: ModelDeployment,
                    writer: ResultWriter, checker: PermissionChecker,
                    on_revoked: Callable[[list[TopicPartition]], Awaitable[None]],
                    ) -> RequestIngest:
        runtime = self._runtime()
        # the folder the runtime serves (a .gguf file's is made beside sluice's cache)
        prompts = PromptBuilder.for_model(getattr(runtime, "model_dir", dep.path),
                                          runtime.tokenizer, runtime.model_config.vocab_size)
        self.prompts = prompts
        if prompts.template_problem is not None:
            log.warning("chat requests will be refused: %s", prompts.template_problem)
        else:
            log.info("chat prompts: %s", f"the model's template ({prompts.template.origin})"
                     if prompts.template is not None else "no chat template, plain framing")
        loaded, tracker = self._loaded, self._tracker
        router = Router(writer, self._held, self._engine,
                        lambda: loaded.runtime.tokenizer if loaded.runtime else None,
                        lambda: self._runtime().model_config.sampling_defaults,
                        finished=tracker.finish, on_cancel=self._metrics.observe_cancel,
                        grammar_of=lambda rf: self._runtime().grammars.compile(rf),
                        owns=tracker.owns, holds=tracker.holds, tracer=self._tracer)
        ingest = RequestIngest(
            ingest_options(settings, dep.model, instance_id),
            tracker=tracker, checker=checker, prompts=prompts, route=router.route,
            on_revoked=on_revoked,
            audit=PartitionAudit(lambda _partition: self._metrics.observe_misrouted_key()),
        )
        ingest.max_ttft_ms = dep.placement.max_ttft_ms
        ingest.adapters = frozenset(loaded.adapters.names)
        return ingest

    def remember_turn(self, ctx: InFlight, event: bt.Finished) -> None:
        """A templated chat's answer, so that its next turn is found in the KV cache."""
        if event.finish_reason == "cancelled":
            return  # the client stopped it: no turn to build on
        runtime = self._loaded.runtime
        if ctx.chat is not None and self.prompts is not None and runtime is not None:
            self.prompts.remember(ctx.chat, event.token_ids, ctx.decoder.text(),
                                  runtime.model_config.eos_token_ids)

    def _runtime(self) -> Runtime:
        assert self._loaded.runtime is not None
        return self._loaded.runtime

    def _engine(self) -> Engine:
        assert self._loaded.engine is not None
        return self._loaded.engine

    async def poll(self, ingest: RequestIngest, *, on_wait: Callable[[str], None],
                   on_reading: Callable[[], None]) -> None:
        """One poll. The consumer hands its group coordinator's errors to the next poll
        (an UnknownError while a leader is cut off, say) and goes on coordinating, so
        such an error is waited out, `on_wait` hearing why; only a denied topic or group
        stops the worker (it cannot serve at all). `on_reading`: reading again."""
        try:
            await ingest.poll(max_records=256)
        except (TopicAuthorizationFailedError, GroupAuthorizationFailedError):
            raise
        except KafkaError as exc:
            why = f"Kafka: {type(exc).__name__}: {exc}"
            log.warning("reading %s failed (%s); reading on in %g s",
                        ingest.options.request_topic, why, POLL_RETRY_S)
            self._poll_failure = why
            on_wait(why)
            await asyncio.sleep(POLL_RETRY_S)
            return
        if self._poll_failure is not None:
            log.info("reading %s again", ingest.options.request_topic)
            self._poll_failure = None
            on_reading()
