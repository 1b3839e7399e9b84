"""`sluice worker`: one model replica serving one model's request topic.

The one place that assembles the rooms: ingest reads and judges records, the
router hands admitted requests to the engine (batcher + gpu_runtime) and the
rest to results, the event pump hands engine events to results, and the
commit loop commits, per partition, the lowest unfinished offset
(`worker.requests`). One asyncio loop (uvloop) holds the consumer, the
producer, the database pool and the engine loop; the model step runs in the
engine's thread.

The deployment watcher follows `sluice.control`: placement changes apply at
once (max_ttft, pools), adapter changes between steps, compute-config changes
drain, reload and resume. Every background task is watched: one that fails
(or a loop that returns) is logged with its traceback, `/readyz` turns false
and the worker stops at once with `fatal` set (exit code 3), so its
supervisor restarts it; requests it held stay uncommitted and are served
again. Waits (draining, leaving the group, a revocation, shutting down) end on
events — nothing held, the pump idle — each bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import asyncpg
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError

from batcher import types as bt
from batcher.config import BatcherConfig
from batcher.engine import Engine, StepStats
from common.db import create_pool, notify_channel
from common.kafka_connect import connect
from common.kafka_security import explain
from common.settings import Settings
from common.threads import in_own_thread
from common.timeouts import within
from gpu_runtime import RankFailure, Runtime, RuntimeConfig
from gpu_runtime.planner import available_device_bytes
from ingest.consumer import RequestIngest
from ingest.offsets import OffsetTracker
from ingest.partitioning import PartitionAudit
from ingest.permissions import PermissionChecker
from ingest.prompting import PromptBuilder
from results.inflight import InFlight
from results.transactions import PartitionTransactions, TransactionCommitter
from results.writer import ResultWriter
from schemas import ModelDeployment
from worker.deployments import DeploymentWatcher
from worker.heartbeat import Heartbeat
from worker.identity import ReplicaLock, ReplicaTakenError
from worker.membership import MembershipGate
from worker.metrics import MetricsServer, WorkerMetrics
from worker.options import WorkerOptions, ingest_options, results_options
from worker.requests import EventPump, HeldRequests, Router
from worker.served_adapters import ServedAdapters

log = logging.getLogger(__name__)

# How often a worker checks that Kafka still lets it see its request topic.
ACCESS_CHECK_EVERY_S = 30.0
# Compute-config fields whose change needs the model reloaded.
RELOAD_FIELDS = ("kv_cache_len", "tp", "quantization", "max_adapters", "max_lora_rank", "dtype",
                 "delivery")
# Bounds of the waits that end on events.
DRAIN_S = 30.0
LEAVE_GROUP_S = 30.0
HAND_OVER_S = 20.0
# A stall this long (of the session timeout's 10 s) makes the worker confirm its group
# membership before it writes again.
STALL_S = 3.0

RuntimeFactory = Callable[[str, RuntimeConfig], Runtime]
T = TypeVar("T")


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
        # The static group member id, settled in `run` once this worker holds its lock
        # (`worker.identity`): `--instance-id`, else pool-host-replica.
        self.instance_id = options.instance_id or (
            self._member_id(options.replica) if options.replica is not None else "")
        self.heartbeat: Heartbeat | None = None
        self.tracker = OffsetTracker()
        self.metrics = WorkerMetrics(options.model, settings.pool)
        self.metrics_server: MetricsServer | None = None
        self.held = HeldRequests()
        self.deployment: ModelDeployment | None = None
        self.runtime: Runtime | None = None
        self.engine: Engine | None = None
        self.ingest: RequestIngest | None = None
        self.prompts: PromptBuilder | None = None
        self.writer: ResultWriter | None = None  # made in `run`: it needs the event loop
        self.pump: EventPump | None = None
        # Exactly-once delivery: the partitions' transactions, and who closes them (None:
        # at-least-once).
        self.transactions: PartitionTransactions | None = None
        self.committer: TransactionCommitter | None = None
        self._committer_task: asyncio.Task[Any] | None = None
        self._serving = asyncio.Event()  # this pool is in the model's placement
        self._reload = asyncio.Event()
        self._stopping = asyncio.Event()
        self.num_reloads = 0
        self.fatal: BaseException | None = None
        self.adapters = ServedAdapters(self.model)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._compiling = False  # the compiled step is being built behind live serving
        # After a stall (a pause) nothing is written until the group still knows us.
        self.membership = MembershipGate(
            lambda: self.ingest.consumer._coordinator if self.ingest is not None else None,
            stall_s=STALL_S)

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        pool = await create_pool(self.settings, max_size=4)
        identity = ReplicaLock(self.settings.database_dsn(), self.settings.db_schema,
                               self.settings.topic(self.model), self.settings.client.timeout_secs)
        try:
            await self._take_identity(identity)
        except BaseException:
            await pool.close()
            raise
        self.writer = ResultWriter(results_options(self.settings, self.model),
                                   self.tracker.finish, self.metrics)
        watcher = DeploymentWatcher(self.settings, self.model)
        checker = PermissionChecker(pool, notify_channel(self.settings.db_schema),
                                    call_timeout_s=self.settings.client.timeout_secs)
        self._serve_metrics()
        try:
            self._spawn(identity.hold(), "replica lock")
            self._watch(checker.start(), "permission listener")
            await self._start_heartbeat(pool)
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
            self._spawn(self.pump.run(), "event pump")  # type: ignore[union-attr]
            self._spawn(self._commit_loop(), "offset commits")
            self._spawn(self._gauges(), "gauges")
            self._spawn(self.membership.watch(), "stall watch")
            if not self._stopping.is_set():
                self.metrics.set_ready(True)
                self._set_status(self._serving_status())
                log.info("serving %s as %s", self.model, self.instance_id)
            await self._stopping.wait()
        finally:
            await self._shutdown(watcher, checker, pool)
            await identity.release()

    def _member_id(self, replica: int) -> str:
        return f"{self.settings.pool}-{socket.gethostname()}-{replica}"

    async def _take_identity(self, identity: ReplicaLock) -> None:
        """Hold this replica's member id, or refuse to start (ReplicaTakenError): two
        live workers with one id would both serve the same partitions."""
        if self.instance_id:
            holder = await identity.take(self.instance_id)
            if holder is not None:
                flag = ("--instance-id" if self.options.instance_id
                        else f"--replica {self.options.replica}")
                raise ReplicaTakenError(
                    f"another live worker of model {self.model} already runs as "
                    f"{self.instance_id} ({holder}): two workers with one group member id "
                    f"would both answer the same requests. Start this one with another "
                    f"{flag.split()[0]}" + ("" if self.options.instance_id else
                                            ", or without --replica to take the lowest free "
                                            "index"))
            return
        replica = await identity.take_first_free(self._member_id)
        self.options = dataclasses.replace(self.options, replica=replica)
        self.instance_id = self._member_id(replica)

    async def _start_heartbeat(self, pool: asyncpg.Pool) -> None:
        """Tell the control plane where we run, what we do and how much memory a model
        may use (`sluice workers`, the gateway's /ready, capacity checks)."""
        self.heartbeat = Heartbeat(pool, instance_id=self.instance_id, model=self.model,
                                   pool_name=self.settings.pool, device=self.options.device)
        self.heartbeat.device_memory_bytes = (
            self.options.memory_budget_bytes
            or await asyncio.to_thread(available_device_bytes, self.options.device))
        self._spawn(self.heartbeat.run(), "heartbeat")

    def _set_status(self, status: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.set_status(status)

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

    async def _shutdown(self, watcher: DeploymentWatcher, checker: PermissionChecker,
                        pool: asyncpg.Pool) -> None:
        self.metrics.set_ready(False)
        self._set_status("stopping")
        if self.engine is not None and self.fatal is None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(DRAIN_S):
                    await self.engine.drain()
            if self.pump is not None:  # the drained requests' last events reach results
                await self.pump.wait_idle(self.engine)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.committer is not None:
            # The last transactions, with what the drain finished (never after one failed).
            if self.writer is not None:
                await _quietly(self.writer.flush(), "flushing the last answers")
            if self.ingest is not None and self.fatal is None:
                await _quietly(self.ingest.commit(), "the last transactions")
            self.committer.close()
        if self.transactions is not None:
            await _quietly(self.transactions.close_all(), "stopping the transactional producers")
        if self.writer is not None:
            await _quietly(self.writer.stop(), "stopping the producer")
        if self.ingest is not None:
            if self.committer is None:
                await _quietly(self.ingest.commit(), "the last offset commit")
            await _quietly(self.ingest.stop(), "leaving the consumer group")
        if self.engine is not None:
            await self.engine.stop()
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.close)
        await _quietly(watcher.stop(), "stopping the control-topic reader")
        await checker.close()
        if self.heartbeat is not None:
            self.heartbeat.set_status("stopped")
            with contextlib.suppress(Exception):
                await within(5, self.heartbeat.beat())
        await pool.close()
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

    # ---- deployment ------------------------------------------------------------------

    async def _load(self, dep: ModelDeployment) -> None:
        started = time.monotonic()
        self._set_status("warming")
        config = self.options.runtime_config(dep, self.settings.compile)
        # A thread that ends with the load (common/threads.py: why not to_thread)
        runtime = await in_own_thread(self._runtime_factory, dep.path, config)
        self.runtime = runtime
        if config.compile and config.tp > 1:
            # Every rank compiles in step (the graphs' all-reduces), which would stall the
            # live steps beside it: at tp > 1 the compile comes first.
            log.info("tp=%d: compiling the decode step of %s before serving", config.tp,
                     dep.model)
            await self._warm_up(runtime)
        self.adapters = ServedAdapters(self.model)
        await self.adapters.load(runtime, dep.adapters)
        slots = self.options.adapter_slots_for(dep)
        self.engine = Engine(runtime, BatcherConfig(
            max_num_batched_tokens=self.options.max_num_batched_tokens,
            max_adapters_per_step=max(1, slots),
        ), adapters=runtime.adapters if slots > 0 else None, on_step=self._on_step,
            fatal_errors=(RankFailure,))
        await self.engine.start()
        self._spawn(self._watch_engine(self.engine), "engine watch", runs_forever=False)
        if self.pump is None:
            assert self.writer is not None
            self.pump = EventPump(self.writer, self.held, self.engine,
                                  on_done=self._remember_turn, holds=self.tracker.holds,
                                  may_write=self.membership.confirmed)
        else:
            self.pump.switch(self.engine)
        if self.ingest is not None:
            self.ingest.adapters = frozenset(self.adapters.names)
        await self._use_delivery(dep)
        log.info("loaded %s (revision %d, adapters %s) in %.1f s", dep.model, dep.revision,
                 sorted(self.adapters.names), time.monotonic() - started)
        if config.compile and config.tp == 1:
            # Serve first: eager steps answer at once, and the compiled graphs are swapped
            # in between steps when the warm-up (in a thread of its own) has built them.
            self._spawn(self._warm_up(runtime), "compile warm-up", runs_forever=False)
        self._set_status(self._serving_status())

    async def _warm_up(self, runtime: Runtime) -> None:
        """Build the compiled decode step; any failure leaves the runtime eager."""
        self._compiling = True
        self._set_status(self._serving_status())
        try:
            seconds = await _in_background_thread(runtime.warm_up)
        except Exception as exc:
            log.error("building the compiled decode step of %s failed; serving with eager "
                      "steps", self.model, exc_info=exc)
            seconds = None
        finally:
            self._compiling = False
        if runtime is not self.runtime:
            return  # reloaded meanwhile
        if runtime.compile_failure is not None:
            log.warning("serving %s with eager steps: %s", self.model, runtime.compile_failure)
        elif seconds is not None:
            log.info("compiled the decode step of %s in %.1f s; decode steps take it from "
                     "now on", self.model, seconds)
        self._set_status(self._serving_status())

    def _serving_status(self) -> str:
        if self.ingest is None or not self.metrics.ready:
            return "warming"
        if not self._serving.is_set():
            return "idle"
        runtime = self.runtime
        if runtime is not None and runtime.compiled_ready:
            return "serving (compiled)"
        return "serving (compiling)" if self._compiling else "serving"

    async def _use_delivery(self, dep: ModelDeployment) -> None:
        """At-least-once, or exactly-once: terminal records and offsets in transactions,
        one transactional id per input partition, taken over by each new owner of the
        partition (`results.transactions`: the broker fences the old one)."""
        assert self.writer is not None
        exactly_once = dep.compute_config.delivery == "exactly_once"
        if not exactly_once:
            if self.committer is not None:
                self.committer.close()
                if self._committer_task is not None:
                    self._committer_task.cancel()
                self.committer = self._committer_task = None
                await self.writer.use_transactions(None)
                self.transactions = None
                log.info("delivery: at least once")
            if self.ingest is not None:
                self.ingest.transactions = None
                self.ingest.defer_assignment = None
            return
        group_id = self.settings.topic(self.model)
        self.transactions = await self.writer.use_transactions(group_id)
        assert self.transactions is not None
        if self.ingest is not None:  # a reload: the partitions owned now get theirs
            await self._open_transactions(list(self.ingest.consumer.assignment()))
        if self.committer is None:
            self.committer = TransactionCommitter(
                self.transactions, self._pending_offsets, self.tracker.mark_committed,
                on_lost=self._on_partition_fenced, on_commit=self.metrics.observe_transaction)
            self._committer_task = self._spawn(self.committer.run(), "transaction commits")
            log.info("delivery: exactly once (transactional ids %s.partition-N)", group_id)
        if self.ingest is not None:
            self.ingest.transactions = self.committer
            self.ingest.defer_assignment = self._take_over

    async def _open_transactions(self, tps: list[Any]) -> None:
        """Take over the transactional ids of partitions just assigned, fencing their
        earlier holders, before their committed offsets are read. Retried while the
        broker is away; a worker that cannot is stopped (it may not serve them)."""
        if self.transactions is None or not tps:
            return
        deadline = time.monotonic() + self.settings.client.timeout_secs
        while True:
            try:
                await self.transactions.open(tps)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self._fail(f"the transactional ids of partitions "
                               f"{sorted(tp.partition for tp in tps)} could not be taken "
                               "over", exc)
                    raise
                log.warning("taking over the transactional ids of partitions %s failed "
                            "(%s: %s); trying again", sorted(tp.partition for tp in tps),
                            type(exc).__name__, exc)
                await asyncio.sleep(1.0)

    def _on_partition_fenced(self, tp: Any, why: str) -> None:
        """A partition's transactional id was taken over: another worker owns the
        partition now (this one was paused, or cut off, past its session). Nothing more
        is written or committed for it; what this worker held of it is dropped."""
        self.tracker.revoke(tp)
        dropped = self._drop_held({tp})
        log.warning("%s (this worker was paused or cut off past its session timeout): "
                    "its %d requests here are dropped unanswered, served by their new "
                    "owner; nothing of it was committed from here", why, dropped)
        if self.transactions is not None:
            self._spawn(self.transactions.release([tp]),
                        f"stopping partition {tp.partition}'s producer", runs_forever=False)

    def _pending_offsets(self) -> dict[Any, tuple[int, str]]:
        return dict(self.ingest.pending_offsets()) if self.ingest is not None else {}

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
        self._set_status(self._serving_status())

    async def _on_deployment(self, dep: ModelDeployment | None) -> None:
        if dep is None:
            # Removed from the registry: stop serving (as if no pool held it) until a
            # new registration arrives.
            log.warning("model %s was removed: leaving its consumer group until it is "
                        "registered again", self.model)
            self._serving.clear()
            self._set_status(self._serving_status())
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

    async def _drain_and_reload(self) -> None:
        assert self.engine is not None and self.ingest is not None and self.deployment
        assert self.pump is not None
        self._reload.clear()
        self.metrics.set_ready(False)
        log.info("compute config changed: draining %d requests", self.engine.num_unfinished)
        await self.engine.drain()
        await self.pump.wait_idle(self.engine)
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
        self._set_status(self._serving_status())

    # ---- requests in -----------------------------------------------------------------

    def _make_ingest(self, checker: PermissionChecker) -> RequestIngest:
        assert self.runtime is not None and self.deployment and self.writer is not None
        prompts = PromptBuilder.for_model(self.deployment.path, self.runtime.tokenizer,
                                          self.runtime.model_config.vocab_size)
        self.prompts = prompts
        if prompts.template_problem is not None:
            log.warning("chat requests will be refused: %s", prompts.template_problem)
        else:
            log.info("chat prompts: %s", f"the model's template ({prompts.template.origin})"
                     if prompts.template is not None else "no chat template, plain framing")
        router = Router(self.writer, self.held, self._current_engine,
                        lambda: self.runtime.tokenizer if self.runtime else None,
                        lambda: self._current_runtime().model_config.sampling_defaults,
                        finished=self.tracker.finish, on_cancel=self.metrics.observe_cancel,
                        grammar_of=lambda rf: self._current_runtime().grammars.compile(rf),
                        owns=self.tracker.owns, holds=self.tracker.holds)
        ingest = RequestIngest(
            ingest_options(self.settings, self.model, self.instance_id),
            tracker=self.tracker, checker=checker, prompts=prompts, route=router.route,
            on_revoked=self._on_revoked,
            audit=PartitionAudit(lambda _partition: self.metrics.observe_misrouted_key()),
        )
        ingest.max_ttft_ms = self.deployment.placement.max_ttft_ms
        ingest.adapters = frozenset(self.adapters.names)
        ingest.transactions = self.committer
        if self.transactions is not None:
            ingest.defer_assignment = self._take_over
        return ingest

    def _current_runtime(self) -> Runtime:
        assert self.runtime is not None
        return self.runtime

    def _remember_turn(self, ctx: InFlight, event: bt.Finished) -> None:
        """A templated chat's answer, so that its next turn is found in the KV cache."""
        if event.finish_reason == "cancelled":
            return  # the client stopped it: no turn to build on
        if ctx.chat is not None and self.prompts is not None and self.runtime is not None:
            self.prompts.remember(ctx.chat, event.token_ids, ctx.decoder.text(),
                                  self.runtime.model_config.eos_token_ids)

    def _current_engine(self) -> Engine:
        assert self.engine is not None
        return self.engine

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
        self.ingest.pause_all(self.engine.is_full())

    def _take_over(self, tps: list[Any], assignment: int) -> None:
        """Exactly-once: partitions just assigned (paused) are served once their
        transactional ids are taken over and their offsets read after that."""
        async def take_over() -> None:
            await self._open_transactions(tps)
            assert self.ingest is not None
            await self.ingest.start_partitions(tps, assignment)

        self._spawn(take_over(), "taking partitions over", runs_forever=False)

    async def _leave_group(self) -> None:
        """This pool left the model's placement: finish what we hold, then hand the
        partitions to the workers of the pools that remain."""
        assert self.ingest is not None
        log.info("pool %s is no longer in the placement of %s: leaving the group",
                 self.settings.pool, self.model)
        await self.held.wait_empty(LEAVE_GROUP_S)
        if self.writer is not None:
            await self.writer.flush()
        await self.ingest.commit()
        self.ingest.consumer.unsubscribe()
        for tp in list(self.tracker.partitions):
            self.tracker.revoke(tp)
            self.metrics.forget_partition(tp.partition)

    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        """Partitions move away (ingest has closed them: records still being judged are
        dropped): finish the requests held for them (bounded), else drop them unanswered,
        then commit and hand over. A worker the group no longer knows (paused or cut off
        past its session) hands nothing over: the partitions have new owners already, so
        it drops what it holds for them at once and commits nothing."""
        gone: set[object] = set(revoked)
        if not gone:
            return
        started = time.monotonic()
        names = sorted(tp.partition for tp in revoked)
        if self.ingest is not None and self.ingest.membership_lost():
            for tp in revoked:  # no answer, and no commit point to commit, from now on
                self.tracker.revoke(tp)
            dropped = self._drop_held(gone)
            if self.transactions is not None:  # their new owners fence these anyway
                self._spawn(self.transactions.release(list(revoked)),
                            "stopping revoked partitions' producers", runs_forever=False)
            log.warning("this worker fell out of the consumer group (paused or cut off "
                        "longer than its session timeout): partitions %s went to other "
                        "workers, which serve its %d requests of them again; dropped them "
                        "unanswered and rejoining", names, dropped)
            return
        await self.held.wait_none_from(gone, HAND_OVER_S)
        dropped = self._drop_held(gone)
        for tp in revoked:  # nothing more is answered for them, even if a step ends
            self.tracker.silence(tp)
        if self.ingest is not None:
            await self.ingest.commit()
        if self.transactions is not None:
            self._spawn(self.transactions.release(list(revoked)),
                        "stopping revoked partitions' producers", runs_forever=False)
        log.info("partitions %s revoked; handed over after %.2f s%s", names,
                 time.monotonic() - started,
                 f" ({dropped} unfinished requests left to their new owner)" if dropped else "")

    def _drop_held(self, partitions: set[object]) -> int:
        """Stop, unanswered, the requests held for `partitions` (their offsets stay
        unfinished; the partitions' next owner serves them)."""
        dropped = 0
        for key, ctx in self.held.items():
            if ctx.topic_partition in partitions:
                dropped += 1
                if self.engine is not None:
                    self.engine.cancel(key)
        return dropped

    # ---- background --------------------------------------------------------------------

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
                await self._check_access(ingest)
            if self.adapters.has_retired:
                await self.adapters.drop_retired(runtime, engine)
            self.metrics.set_queue(engine.scheduler.num_waiting, engine.scheduler.num_running)
            bm = runtime.block_manager
            self.metrics.set_kv(bm.num_blocks - bm.num_free_blocks, bm.num_free_blocks)
            for tp in ingest.consumer.assignment():
                high, point = ingest.consumer.highwater(tp), self.tracker.commit_point(tp)
                if high is not None:  # lag = records not yet finished
                    self.metrics.set_lag(tp.partition, high - (point[0] if point else high))

    async def _check_access(self, ingest: RequestIngest) -> None:
        """A denied request topic stops the worker (TopicAuthorizationFailedError); a
        broker that does not answer now (away, electing leaders) is only logged: it is
        asked again at the next check."""
        try:
            await within(10, ingest.check_access())
        except TopicAuthorizationFailedError:
            raise
        except (KafkaError, OSError, TimeoutError) as exc:
            log.warning("could not check access to %s now (%s: %s); checking again in "
                        "%g s", self.settings.requests_topic(self.model), type(exc).__name__,
                        exc, ACCESS_CHECK_EVERY_S)

    async def _commit_loop(self) -> None:
        assert self.ingest is not None
        while True:
            await asyncio.sleep(0.1)
            await self.ingest.commit()


async def _in_background_thread(work: Callable[[], T]) -> T:
    """`work`'s result, computed in a daemon thread at a lower CPU priority: a stopping
    worker does not wait for it (as it would for the loop's executor), and the live eager
    steps keep the cores (Linux nices threads one by one; the compiler's worker processes
    started from it inherit that)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            result = work()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, functools.partial(future.set_exception, exc))
        else:
            loop.call_soon_threadsafe(settle, functools.partial(future.set_result, result))

    threading.Thread(target=run, name="sluice-compile", daemon=True).start()
    return await future


async def _quietly(work: Coroutine[Any, Any, Any], what: str) -> None:
    """One step of a shutdown: its failure is logged and the shutdown goes on — also a
    cancellation raised from inside it (a client's own task cancelled under it), which
    is not this task's; a cancellation of this task still cancels."""
    try:
        await work
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("%s was cancelled from within; going on with the shutdown", what)
    except Exception as exc:
        log.warning("%s failed (%s: %s); going on with the shutdown", what,
                    type(exc).__name__, exc)
