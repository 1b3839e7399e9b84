"""`sluice worker`: one model replica serving one model's request topic.

One asyncio loop (uvloop) holds the consumer, the producer, the database pool
and the engine loop; the model step runs in the engine's thread. Pieces:

- `DeploymentWatcher` follows `sluice.control`; placement changes apply at
  once (max_ttft, pools); compute-config changes drain, reload and resume.
- `RequestIngest` reads records, checks them and submits `batcher.Request`s.
- The event pump turns engine events into wire events (`ResultWriter`).
- The commit loop commits, per partition, the lowest unfinished offset.

Every background task is watched: one that fails (or a loop that returns) is
logged with its traceback, `/readyz` turns false and the worker stops at once
with `fatal` set (exit code 3), so its supervisor restarts it; requests it held
stay uncommitted and are served again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import asyncpg
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from batcher import types as bt
from batcher.config import BatcherConfig
from batcher.engine import Engine, StepStats
from batcher.errors import EngineClosedError
from batcher.types import Request
from gpu_runtime import RankFailure, Runtime, RuntimeConfig, SamplingParams
from gpu_runtime.planner import available_device_bytes
from ingest.consumer import Accepted, RequestIngest
from ingest.offsets import OffsetTracker
from ingest.permissions import PermissionChecker
from ingest.prompting import IncrementalDecoder, PromptBuilder
from results.context import InFlight
from results.writer import ResultWriter
from schemas import ErrorCode, ModelDeployment
from sluice.capacity import heartbeat
from sluice.db import create_pool
from sluice.deployments import DeploymentWatcher
from sluice.kafka_security import connect, explain
from sluice.metrics import MetricsServer, WorkerMetrics
from sluice.served_adapters import ServedAdapters
from sluice.settings import Settings

log = logging.getLogger(__name__)

# How often a worker checks that Kafka still lets it see its request topic.
ACCESS_CHECK_EVERY_S = 30.0
# Compute-config fields whose change needs the model reloaded.
RELOAD_FIELDS = ("kv_cache_len", "tp", "quantization", "max_adapters", "max_lora_rank", "dtype")


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    model: str
    device: str = "cpu"
    tp: int | None = None  # None: the model's compute config decides
    replica: int = 0
    instance_id: str | None = None
    max_num_batched_tokens: int = 512
    memory_budget_bytes: int | None = None
    adapter_slots: int | None = None  # None: the compute config's max_adapters
    wait_for_model_s: float = 600.0


RuntimeFactory = Callable[[str, RuntimeConfig], Runtime]


class WorkerTaskFailed(RuntimeError):
    """A task the worker cannot serve without died."""


class Worker:
    def __init__(self, settings: Settings, options: WorkerOptions,
                 runtime_factory: RuntimeFactory = Runtime):
        self.settings = settings
        self.options = options
        # A seam for fault-injection tests: they wrap the runtime's `execute`.
        self._runtime_factory = runtime_factory
        self.model = options.model
        self.instance_id = options.instance_id or (
            f"{settings.pool}-{socket.gethostname()}-{options.replica}"
        )
        self.tracker = OffsetTracker()
        self.metrics = WorkerMetrics(options.model, settings.pool)
        self.metrics_server: MetricsServer | None = None
        self.in_flight: dict[str, InFlight] = {}
        self.deployment: ModelDeployment | None = None
        self.runtime: Runtime | None = None
        self.engine: Engine | None = None
        self.ingest: RequestIngest | None = None
        self.writer: ResultWriter | None = None
        self._serving = asyncio.Event()  # this pool is in the model's placement
        self._reload = asyncio.Event()
        self._stopping = asyncio.Event()
        self.num_reloads = 0
        self.fatal: BaseException | None = None
        self.adapters = ServedAdapters(self.model)
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        watcher = DeploymentWatcher(self.settings, self.model)
        pool = await create_pool(self.settings, max_size=4)
        checker = PermissionChecker(pool, self.settings.db_schema,
                                    call_timeout_s=self.settings.client.timeout_secs)
        self.writer = ResultWriter(self.settings, self.tracker.finish, self.model, self.metrics)
        self._serve_metrics()
        try:
            self._watch(checker.start(), "permission listener")
            self._spawn(self._heartbeat(pool), "heartbeat")
            await connect(self.writer.start(), self.settings, "the worker's producer")
            await connect(watcher.start(self._on_deployment), self.settings,
                          f"reading {self.settings.topic('control')}")
            self._spawn(watcher.run(), "deployment watcher")
            self.deployment = await self._until_stopped(
                watcher.wait_for_deployment(self.options.wait_for_model_s))
            if self.deployment is None:
                return
            self._apply_placement(self.deployment)
            await self._load(self.deployment)
            self.ingest = self._make_ingest(checker)
            await connect(self.ingest.start(), self.settings,
                          f"reading {self.settings.requests_topic(self.model)}")
            self._spawn(self._consume(), "request consumer")
            self._spawn(self._pump_events(), "event pump")
            self._spawn(self._commit_loop(), "offset commits")
            self._spawn(self._gauges(), "gauges")
            if not self._stopping.is_set():
                self.metrics.set_ready(True)
            await self._stopping.wait()
        finally:
            await self._shutdown(watcher, checker, pool)

    def stop(self) -> None:
        self._stopping.set()

    async def _until_stopped(self, work: Coroutine[Any, Any, Any]) -> Any:
        """`work`'s result, or None if the worker is stopped (or fails) first."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
        return task.result()

    # ---- watched tasks -----------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, Any], name: str, *,
               runs_forever: bool = True) -> asyncio.Task[Any]:
        return self._watch(asyncio.create_task(work, name=name), name,
                           runs_forever=runs_forever)

    def _watch(self, task: asyncio.Task[Any], name: str, *,
               runs_forever: bool = True) -> asyncio.Task[Any]:
        """Stop the worker if `task` fails, or ends while it should run forever."""
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_ended, name, runs_forever))
        return task

    def _task_ended(self, name: str, runs_forever: bool, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None and (not runs_forever or self._stopping.is_set()):
            return
        self._fail(f"worker task {name!r} " + ("failed" if exc is not None
                                                else "ended unexpectedly"), exc)

    def _fail(self, what: str, exc: BaseException | None) -> None:
        why = ""
        if exc is not None:
            why = ": " + (explain(exc, self.settings.kafka) or f"{type(exc).__name__}: {exc}")
        log.error("%s%s; stopping the worker (exit code 3) so that its supervisor restarts "
                  "it", what, why, exc_info=exc)
        self.metrics.set_ready(False)
        if self.fatal is None:
            self.fatal = WorkerTaskFailed(what + why)
        self._stopping.set()

    async def _shutdown(self, watcher: DeploymentWatcher, checker: PermissionChecker,
                        pool: object) -> None:
        self.metrics.set_ready(False)
        if self.engine is not None and self.fatal is None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(30):
                    await self.engine.drain()
        if self.fatal is None:
            await asyncio.sleep(0.2)  # let the pump write the last events
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.writer is not None:
            await self.writer.stop()
        if self.ingest is not None:
            await self.ingest.commit()
            await self.ingest.stop()
        if self.engine is not None:
            await self.engine.stop()
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.close)
        await watcher.stop()
        await checker.close()
        await pool.close()  # type: ignore[attr-defined]
        if self.metrics_server is not None:
            self.metrics_server.close()

    def _serve_metrics(self) -> None:
        try:
            self.metrics_server = self.metrics.serve(self.settings.metrics_port)
        except OSError as exc:  # serving matters more than being scraped
            log.error("metrics endpoint not started on port %d: %s",
                      self.settings.metrics_port, exc)
            return
        log.info("metrics on port %d", self.metrics_server.port)

    # ---- deployment ------------------------------------------------------------------

    def _adapter_slots(self, dep: ModelDeployment) -> int:
        if self.options.adapter_slots is not None:
            return self.options.adapter_slots
        return dep.compute_config.max_adapters

    def _runtime_config(self, dep: ModelDeployment) -> RuntimeConfig:
        cc = dep.compute_config
        return RuntimeConfig(
            device=self._device(dep), dtype=None if cc.dtype == "auto" else cc.dtype,
            kv_cache_len=cc.kv_cache_len, quantization=cc.quantization,
            memory_budget_bytes=self.options.memory_budget_bytes,
            max_num_batched_tokens=self.options.max_num_batched_tokens,
            max_adapters=self._adapter_slots(dep), max_lora_rank=cc.max_lora_rank,
            tp=self._tp(dep),
        )

    def _tp(self, dep: ModelDeployment) -> int:
        return self.options.tp or dep.compute_config.tp

    def _device(self, dep: ModelDeployment) -> str:
        """Replica k of a GPU host uses GPUs k*tp .. k*tp + tp - 1."""
        if self.options.device == "cuda":
            return f"cuda:{self.options.replica * self._tp(dep)}"
        return self.options.device

    async def _load(self, dep: ModelDeployment) -> None:
        started = time.monotonic()
        runtime = await asyncio.to_thread(self._runtime_factory, dep.path,
                                          self._runtime_config(dep))
        self.runtime = runtime
        self.adapters = ServedAdapters(self.model)
        await self.adapters.load(runtime, dep.adapters)
        slots = self._adapter_slots(dep)
        self.engine = Engine(runtime, BatcherConfig(
            max_num_batched_tokens=self.options.max_num_batched_tokens,
            max_adapters_per_step=max(1, slots),
        ), adapters=runtime.adapters if slots > 0 else None, on_step=self._on_step,
            fatal_errors=(RankFailure,))
        await self.engine.start()
        self._spawn(self._watch_engine(self.engine), "engine watch", runs_forever=False)
        if self.ingest is not None:
            self.ingest.adapters = frozenset(self.adapters.names)
        log.info("loaded %s (revision %d, adapters %s) in %.1f s", dep.model, dep.revision,
                 sorted(self.adapters.names), time.monotonic() - started)

    async def _watch_engine(self, engine: Engine) -> None:
        """A replica whose runtime broke for good stops at once, without answering
        its in-flight requests: their offsets stay uncommitted and another replica
        serves them again (attempt + 1)."""
        await engine.failed.wait()
        if engine is self.engine:
            self.fatal = engine.fatal
            log.error("replica down: %s", engine.fatal)
            self.metrics.set_ready(False)
            self._stopping.set()

    async def _sync_adapters(self, dep: ModelDeployment) -> None:
        """Adapters added or removed while serving: no reload needed."""
        engine, runtime = self.engine, self.runtime
        if engine is None or runtime is None or self._reload.is_set():
            return
        await self.adapters.sync(runtime, engine, dep.adapters)
        if self.ingest is not None:
            self.ingest.adapters = frozenset(self.adapters.names)

    def _apply_placement(self, dep: ModelDeployment) -> None:
        if self.settings.pool in dep.placement.compute_pools:
            self._serving.set()
        else:
            self._serving.clear()
        if self.ingest is not None:
            self.ingest.max_ttft_ms = dep.placement.max_ttft_ms

    async def _on_deployment(self, dep: ModelDeployment | None) -> None:
        if dep is None:
            # Removed from the registry: stop serving (as if no pool held it) until a
            # new registration arrives.
            log.warning("model %s was removed: leaving its consumer group until it is "
                        "registered again", self.model)
            self._serving.clear()
            return
        previous = self.deployment
        self.deployment = dep
        self._apply_placement(dep)
        if previous is None:
            return
        old, new = previous.compute_config, dep.compute_config
        if any(getattr(old, f) != getattr(new, f) for f in RELOAD_FIELDS) or (
            previous.path != dep.path
        ):
            self._reload.set()
        elif previous.adapters != dep.adapters:
            self._spawn(self._sync_adapters(dep), "adapter sync", runs_forever=False)

    def _make_ingest(self, checker: PermissionChecker) -> RequestIngest:
        assert self.runtime is not None and self.writer is not None and self.deployment
        prompts = PromptBuilder.for_model(self.deployment.path, self.runtime.tokenizer,
                                          self.runtime.model_config.vocab_size)
        ingest = RequestIngest(
            self.settings, model=self.model, instance_id=self.instance_id,
            tracker=self.tracker, writer=self.writer, checker=checker, prompts=prompts,
            submit=self._submit, on_revoked=self._on_revoked,
            on_misrouted=lambda _partition: self.metrics.observe_misrouted_key(),
        )
        ingest.max_ttft_ms = self.deployment.placement.max_ttft_ms
        ingest.adapters = frozenset(self.adapters.names)
        return ingest

    # ---- requests in -----------------------------------------------------------------

    async def _consume(self) -> None:
        assert self.ingest is not None
        while not self._stopping.is_set():
            if self._reload.is_set():
                await self._drain_and_reload()
            if not self._serving.is_set():
                # Never subscribed when the pool is not in the placement: joining and at
                # once leaving races the client's group coordinator.
                if self.ingest.subscribed:
                    await self._leave_group()
                await self._serving.wait()
            if not self.ingest.subscribed:
                self.ingest.subscribe()
            self._backpressure()
            # Paused partitions still heartbeat; polling serves rebalances and reads
            # partitions assigned meanwhile (never left unread, and then paused).
            await self.ingest.poll(max_records=256)

    def _backpressure(self) -> None:
        """Pause every partition while the engine is full, resume when it is not."""
        assert self.ingest is not None and self.engine is not None
        consumer = self.ingest.consumer
        if self.engine.is_full():
            unpaused = consumer.assignment() - consumer.paused()
            if unpaused:
                consumer.pause(*unpaused)
        elif consumer.paused():
            consumer.resume(*consumer.paused())

    async def _leave_group(self) -> None:
        """This pool left the model's placement: finish what we hold, then hand the
        partitions to the workers of the pools that remain."""
        assert self.ingest is not None
        log.info("pool %s is no longer in the placement of %s: leaving the group",
                 self.settings.pool, self.model)
        deadline = time.monotonic() + 30
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.writer is not None:
            await self.writer.flush()
        await self.ingest.commit()
        self.ingest.consumer.unsubscribe()
        for tp in list(self.tracker.partitions):
            self.tracker.revoke(tp)
            self.metrics.forget_partition(tp.partition)

    async def _submit(self, accepted: Accepted) -> None:
        assert self.writer is not None and self.runtime is not None and self.engine is not None
        req = accepted.request
        ctx = InFlight(
            request=req, topic_partition=accepted.tp, offset=accepted.offset,
            reply_topic=accepted.reply_topic, attempt=accepted.attempt,
            arrival_time=accepted.arrival_time, max_ttft_ms=accepted.max_ttft_ms,
            decoder=IncrementalDecoder(self.runtime.tokenizer, []),
            num_prompt_tokens=len(accepted.token_ids),
        )
        if accepted.expired:
            waited = (time.time() - accepted.arrival_time) * 1000
            await self.writer.timeout(ctx, waited, "permission database unavailable until "
                                      "the request's max_ttft_ms passed")
            return
        key = f"{req.request_id}#{accepted.tp.partition}:{accepted.offset}"
        if key in self.in_flight:
            return
        params = SamplingParams(
            max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, seed=req.seed, stop=tuple(req.stop),
        )
        self.in_flight[key] = ctx
        try:
            self.engine.submit(Request(
                request_id=key, token_ids=tuple(accepted.token_ids), params=params,
                arrival_time=accepted.arrival_time, max_ttft=accepted.max_ttft_ms / 1000,
                adapter_key=req.adapter, attempt=accepted.attempt, origin=ctx,
            ))
        except EngineClosedError:
            # Shutting down: leave it unanswered and uncommitted for the next owner.
            del self.in_flight[key]
        except Exception as exc:
            del self.in_flight[key]
            await self.writer.error(ctx, ErrorCode.INVALID_REQUEST, str(exc))

    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        """Partitions move away: finish their requests (bounded), else cancel them."""
        gone = set(revoked)
        started = time.monotonic()
        deadline = started + 20
        while time.monotonic() < deadline and any(
            c.topic_partition in gone for c in self.in_flight.values()
        ):
            await asyncio.sleep(0.05)
        if self.engine is not None:
            for key, ctx in list(self.in_flight.items()):
                if ctx.topic_partition in gone:
                    self.engine.cancel(key)
        if self.ingest is not None:
            await self.ingest.commit()
        log.info("partitions %s revoked; handed over after %.2f s",
                 sorted(tp.partition for tp in gone), time.monotonic() - started)

    async def _drain_and_reload(self) -> None:
        assert self.engine is not None and self.ingest is not None and self.deployment
        self._reload.clear()
        self.metrics.set_ready(False)
        log.info("compute config changed: draining %d requests", self.engine.num_unfinished)
        await self.engine.drain()
        await asyncio.sleep(0.1)
        if self.writer is not None:
            await self.writer.flush()
        await self.ingest.commit()
        await self.engine.stop()
        if self.runtime is not None:
            # Only one tensor-parallel runtime may exist per process: close first.
            await asyncio.to_thread(self.runtime.close)
        await self._load(self.deployment)
        self.num_reloads += 1
        self.metrics.set_ready(True)

    # ---- events out ------------------------------------------------------------------

    async def _pump_events(self) -> None:
        assert self.writer is not None
        while True:
            engine = self.engine
            assert engine is not None
            try:
                async with asyncio.timeout(0.2):
                    event = await engine.next_event()
            except TimeoutError:
                continue  # the engine may have been swapped by a reload
            try:
                await self._write(event)
            except Exception:
                log.exception("writing an event failed")

    async def _write(self, event: bt.Event) -> None:
        assert self.writer is not None
        if not isinstance(event, bt.TokenEvent):
            self.in_flight.pop(event.request_id, None)
        await self.writer.write(event)

    def _on_step(self, stats: StepStats) -> None:
        self.metrics.observe_step(stats.num_seqs, stats.num_tokens, stats.seconds)
        if stats.num_adapter_loads:
            self.metrics.add_adapter_swaps(stats.num_adapter_loads)

    async def _gauges(self) -> None:
        """Queue, KV and consumer-lag gauges, once a second; and now and then whether
        Kafka still lets this worker see its request topic (an ACL revoked while it
        runs would otherwise leave it reading nothing, silently)."""
        checked = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            engine, runtime, ingest = self.engine, self.runtime, self.ingest
            if engine is None or runtime is None or ingest is None:
                continue
            if time.monotonic() - checked > ACCESS_CHECK_EVERY_S:
                checked = time.monotonic()
                with contextlib.suppress(TimeoutError, KafkaConnectionError):
                    await asyncio.wait_for(ingest.check_access(), 10)
            if self.adapters.has_retired:
                await self.adapters.drop_retired(runtime, engine)
            self.metrics.set_queue(engine.scheduler.num_waiting, engine.scheduler.num_running)
            bm = runtime.block_manager
            self.metrics.set_kv(bm.num_blocks - bm.num_free_blocks, bm.num_free_blocks)
            for tp in ingest.consumer.assignment():
                high, point = ingest.consumer.highwater(tp), self.tracker.commit_point(tp)
                if high is not None:  # lag = records not yet finished
                    self.metrics.set_lag(tp.partition, high - (point[0] if point else high))

    async def _heartbeat(self, pool: asyncpg.Pool) -> None:
        """Tell the control plane where we run and how much memory a model may use."""
        capacity = self.options.memory_budget_bytes or await asyncio.to_thread(
            available_device_bytes, self.options.device)
        await heartbeat(pool, instance_id=self.instance_id, model=self.model,
                        pool_name=self.settings.pool, device=self.options.device,
                        device_memory_bytes=capacity)

    async def _commit_loop(self) -> None:
        assert self.ingest is not None
        while True:
            await asyncio.sleep(0.1)
            await self.ingest.commit()
