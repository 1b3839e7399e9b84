"""`sluice worker`: one model replica serving one model's request topic.

The one place that assembles the rooms: ingest reads and judges records, the
router hands admitted requests to the engine (batcher + gpu_runtime) and the
rest to results, the event pump hands engine events to results, and the
commit loop commits, per partition, the lowest unfinished offset
(`worker.requests`). One asyncio loop (uvloop) holds the consumer, the
producer, the database pool and the engine loop; the model step runs in the
engine's thread. This file is the assembly, in the order a worker starts and
stops; each part it assembles lives beside it (the room's map: `worker/__init__.py`).

The deployment watcher follows `sluice.control`: placement changes apply at
once (max_ttft, pools), adapter changes between steps, compute-config changes
drain, reload and resume. Every background task is watched: one that fails
(or a loop that returns) is logged with its traceback, `/readyz` turns false
and the worker stops at once with `fatal` set (exit code 3), so its
supervisor restarts it; requests it held stay uncommitted and are served
again; a decided stop ends the process within STOP_DEADLINE_S. Waits (draining,
leaving the group, a revocation, shutting down) end on events — nothing held,
the pump idle — each bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Coroutine
from typing import Any

import asyncpg

from batcher.engine import Engine
from common.db import create_pool, notify_channel
from common.heap import freeze_heap
from common.kafka_connect import connect
from common.kafka_security import explain
from common.settings import Settings
from common.timeouts import within
from common.tracing import Tracing
from gpu_runtime import Runtime
from gpu_runtime.planner import available_device_bytes
from ingest.consumer import SESSION_TIMEOUT_MS, RequestIngest
from ingest.offsets import OffsetTracker
from ingest.permissions import PermissionChecker
from results.writer import ResultWriter
from schemas import ModelDeployment
from worker.delivery import Delivery
from worker.deployments import DeploymentWatcher
from worker.gauges import publish_gauges
from worker.handover import Handover
from worker.heartbeat import Heartbeat
from worker.identity import ReplicaLock, take_member_id
from worker.intake import Intake
from worker.loaded_model import LoadedModel, RuntimeFactory
from worker.membership import MembershipGate
from worker.metrics import MetricsServer, WorkerMetrics
from worker.options import WorkerOptions, results_options
from worker.requests import EventPump, HeldRequests
from worker.supervision import StopWatchdog, WatchedTasks, quietly
from worker.tracing import RequestTracer

__all__ = ["Worker", "WorkerOptions", "WorkerTaskFailed"]

log = logging.getLogger(__name__)

# Compute-config fields whose change needs the model reloaded.
RELOAD_FIELDS = ("kv_cache_len", "tp", "quantization", "max_adapters", "max_lora_rank", "dtype",
                 "delivery")
# A decided stop ends the process within STOP_DEADLINE_S (`StopWatchdog`): the drain
# may take DRAIN_S of it, the last answers' writing PUMP_IDLE_S, the rest is bounded
# shutdown steps.
STOP_DEADLINE_S = 30.0
DRAIN_S = 20.0
PUMP_IDLE_S = 5.0
# A stall this long (of the session timeout's 10 s) makes the worker confirm its group
# membership before it writes again.
STALL_S = 3.0
# No heartbeat answered this long (of the session's 10 s): the same check, for a worker
# cut off from its group coordinator.
HEARTBEAT_SILENCE_S = SESSION_TIMEOUT_MS / 1000 / 2


class WorkerTaskFailed(RuntimeError):
    """A task the worker cannot serve without died."""


class Worker:
    def __init__(self, settings: Settings, options: WorkerOptions,
                 runtime_factory: RuntimeFactory = Runtime, *,
                 watchdog: StopWatchdog | None = None, tracing: Tracing | None = None):
        self.settings = settings
        # Spans of the requests it serves, as the OTEL_* variables ask (default: off).
        self.tracing = tracing if tracing is not None else Tracing.from_env("sluice-worker")
        # Ends the process if a decided stop hangs (`sluice worker`; a worker inside
        # another program, the demo or a test, has none).
        self.watchdog = watchdog
        self.options = options
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
        self.tracer = (RequestTracer(self.tracing, self.held)
                       if self.tracing else None)
        self.tracker.watch = self.tracer
        self.deployment: ModelDeployment | None = None
        self.loaded = LoadedModel(options, settings.compile, runtime_factory, self.metrics,
                                  on_status=self._update_status,
                                  on_step=self.tracer.on_step if self.tracer else None)
        self.ingest: RequestIngest | None = None
        self.intake = Intake(self.loaded, held=self.held, tracker=self.tracker,
                             metrics=self.metrics, tracer=self.tracer)
        # Made in `run`: the producer needs the event loop.
        self.writer: ResultWriter | None = None
        self.delivery: Delivery | None = None
        self.handover: Handover | None = None
        self.pump: EventPump | None = None
        self._serving = asyncio.Event()  # this pool is in the model's placement
        self._reload = asyncio.Event()
        self._stopping = asyncio.Event()
        self.tasks = WatchedTasks(self._fail, self._stopping)
        self.num_reloads = 0
        self.num_loads = 0
        self.fatal: BaseException | None = None
        # After a stall (a pause) nothing is written until the group still knows us.
        self.membership = MembershipGate(
            lambda: self.ingest.consumer._coordinator if self.ingest is not None else None,
            stall_s=STALL_S, silence_s=HEARTBEAT_SILENCE_S)

    @property
    def runtime(self) -> Runtime | None:
        return self.loaded.runtime

    @property
    def engine(self) -> Engine | None:
        return self.loaded.engine

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        pool = await create_pool(self.settings, max_size=4)
        identity = ReplicaLock(self.settings.database_dsn(), self.settings.db_schema,
                               self.settings.topic(self.model), self.settings.client.timeout_secs)
        try:
            self.instance_id, self.options = await take_member_id(
                identity, self.model, self.options, self._member_id)
        except BaseException:
            await pool.close()
            raise
        finished = self.tracker.finish
        self.writer = ResultWriter(results_options(self.settings, self.model), finished
                                   if self.tracer is None else self.tracer.acking(finished),
                                   self.metrics)
        self.delivery = Delivery(settings=self.settings, model=self.model, writer=self.writer,
                                 tracker=self.tracker, metrics=self.metrics, tasks=self.tasks,
                                 ingest_of=lambda: self.ingest, fail=self._fail,
                                 drop_held=lambda tps: self.held.cancel_from(tps, self.engine),
                                 member_since=self.membership.member_since)
        self.handover = Handover(held=self.held, tracker=self.tracker, metrics=self.metrics,
                                 writer=self.writer, delivery=self.delivery,
                                 ingest_of=lambda: self.ingest, engine_of=lambda: self.engine)
        watcher = DeploymentWatcher(self.settings, self.model)
        checker = PermissionChecker(pool, notify_channel(self.settings.db_schema),
                                    call_timeout_s=self.settings.client.timeout_secs)
        self.metrics_server = self.metrics.serve_or_log(self.settings.metrics_port)
        spawn = self.tasks.spawn
        try:
            spawn(identity.hold(), "replica lock")
            self.tasks.watch(checker.start(), "permission listener")
            await self._start_heartbeat(pool)
            await connect(self.writer.start(), self.settings, "the worker's producer")
            await connect(watcher.start(self._on_deployment, on_wait=self._waiting),
                          self.settings, f"reading {self.settings.topic('control')}")
            spawn(watcher.run(), "deployment watcher")
            self.deployment = await self.tasks.until_stopped(
                watcher.wait_for_deployment(self.options.wait_for_model_s))
            if self.deployment is None:
                return
            self._apply_placement(self.deployment)
            await self._load(self.deployment)
            assert self.writer is not None and self.handover is not None
            self.ingest = self.intake.make_ingest(self.settings, self.instance_id,
                                                  self.deployment, self.writer, checker,
                                                  self.handover.on_revoked)
            self.delivery.wire(self.ingest)
            await connect(self.ingest.start(), self.settings,
                          f"reading {self.settings.requests_topic(self.model)}")
            spawn(self._consume(), "request consumer")
            spawn(self.pump.run(), "event pump")  # type: ignore[union-attr]
            spawn(self._commit_loop(), "offset commits")
            spawn(publish_gauges(self.loaded, lambda: self.ingest, self.metrics, self.tracker,
                                 self.settings.requests_topic(self.model)), "gauges")
            spawn(self.membership.watch(), "stall watch")
            if not self._stopping.is_set():
                self.metrics.set_ready(True)
                self._update_status()
                log.info("serving %s as %s", self.model, self.instance_id)
            await self._stopping.wait()
        finally:
            await self._shutdown(watcher, checker, pool)
            await identity.release()

    def _member_id(self, replica: int) -> str:
        return f"{self.settings.pool}-{socket.gethostname()}-{replica}"

    async def _start_heartbeat(self, pool: asyncpg.Pool) -> None:
        """Tell the control plane where we run, what we do and how much memory a model
        may use (`sluice workers`, the gateway's /ready, capacity checks)."""
        self.heartbeat = Heartbeat(pool, instance_id=self.instance_id, model=self.model,
                                   pool_name=self.settings.pool, device=self.options.device)
        self.heartbeat.device_memory_bytes = (
            self.options.memory_budget_bytes
            or await asyncio.to_thread(available_device_bytes, self.options.device))
        self.tasks.spawn(self.heartbeat.run(), "heartbeat")

    def _set_status(self, status: str) -> None:
        self.metrics.set_status(status)
        if self.heartbeat is not None:
            self.heartbeat.set_status(status)

    def _waiting(self, why: str) -> None:
        self._set_status(f"waiting ({why})")

    def _update_status(self) -> None:
        self._set_status(self._serving_status())

    def _serving_status(self) -> str:
        if self.ingest is None or not self.metrics.ready:
            return "warming"
        if not self._serving.is_set():
            return "idle"
        runtime = self.runtime
        if runtime is not None and runtime.compiled_ready:
            return "serving (compiled)"
        return "serving (compiling)" if self.loaded.compiling else "serving"

    def stop(self) -> None:
        self._decide_stop()

    def _decide_stop(self) -> None:
        """From here the process ends within the watchdog's deadline, however the
        shutdown goes."""
        self._stopping.set()
        if self.watchdog is not None:
            self.watchdog.arm()

    async def _shutdown_step(self, work: Coroutine[Any, Any, Any], what: str) -> None:
        if self.watchdog is not None:
            self.watchdog.step = what
        await quietly(work, what)

    async def _shutdown(self, watcher: DeploymentWatcher, checker: PermissionChecker,
                        pool: asyncpg.Pool) -> None:
        self.metrics.set_ready(False)
        self._set_status("stopping")
        step = self._shutdown_step
        engine = self.engine
        if engine is not None and self.fatal is None:
            await step(within(DRAIN_S, engine.drain()), "draining the requests in flight")
            if self.pump is not None:  # the drained requests' last events reach results
                await step(self.pump.wait_idle(engine, PUMP_IDLE_S), "writing their answers")
        await step(self.tasks.cancel_all(), "cancelling the background tasks")
        committer = self.delivery.committer if self.delivery is not None else None
        if committer is not None:
            # The last transactions, with what the drain finished (never after one failed).
            if self.writer is not None:
                await step(self.writer.flush(), "flushing the last answers")
            if self.ingest is not None and self.fatal is None:
                await step(self.ingest.commit(), "the last transactions")
            committer.close()
        if self.delivery is not None and self.delivery.transactions is not None:
            await step(self.delivery.transactions.close_all(),
                       "stopping the transactional producers")
        if self.writer is not None:
            await step(self.writer.stop(), "stopping the producer")
        if self.ingest is not None:
            if committer is None:
                await step(self.ingest.commit(), "the last offset commit")
            await step(self.ingest.stop(), "leaving the consumer group")
        await step(self.loaded.close(), "closing the model runtime")
        await step(watcher.stop(), "stopping the control-topic reader")
        await step(checker.close(), "closing the permission listener")
        if self.heartbeat is not None:
            self.heartbeat.set_status("stopped")
            await step(within(5, self.heartbeat.beat()), "the last heartbeat")
        await step(pool.close(), "closing the database pool")
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.tracer is not None:
            await step(self.tracer.close(), "exporting the last spans")

    def _fail(self, what: str, exc: BaseException | None) -> None:
        why = ""
        if exc is not None:
            why = ": " + (explain(exc, self.settings.kafka) or f"{type(exc).__name__}: {exc}")
        log.error("%s%s; stopping the worker (exit code 3) so that its supervisor restarts "
                  "it", what, why, exc_info=exc)
        self.metrics.set_ready(False)
        if self.fatal is None:
            self.fatal = WorkerTaskFailed(what + why)
        self._decide_stop()

    # ---- deployment ------------------------------------------------------------------

    async def _load(self, dep: ModelDeployment) -> None:
        started = time.monotonic()
        self._set_status("warming")
        engine = await self.loaded.load(dep)
        self.tasks.spawn(self._watch_engine(engine), "engine watch", runs_forever=False)
        if self.pump is None:
            assert self.writer is not None
            self.pump = EventPump(self.writer, self.held, engine,
                                  on_done=self.intake.remember_turn, holds=self.tracker.holds,
                                  may_write=self.membership.confirmed, tracer=self.tracer)
        else:
            self.pump.switch(engine)
        if self.ingest is not None:
            self.ingest.adapters = frozenset(self.loaded.adapters.names)
        assert self.delivery is not None
        await self.delivery.use(dep)
        weights = getattr(self.loaded.runtime, "weights_format", "unknown")
        log.info("loaded %s (revision %d, weights %s, adapters %s) in %.1f s", dep.model,
                 dep.revision, weights, sorted(self.loaded.adapters.names),
                 time.monotonic() - started)
        self.metrics.set_weights_format(weights)
        if self.options.freeze_heap:
            # What start-up and loading made lives as long as the model: out of the full
            # collections' walk (a reload frees the replaced model's cycles first).
            reload = self.num_loads > 0
            freeze_heap(collect_first=reload, unfreeze_first=reload)
        self.num_loads += 1
        config = self.loaded.runtime_config(dep)
        if config.compile and config.tp == 1:
            # Serve first: eager steps answer at once, and the compiled graphs are swapped
            # in between steps when the warm-up (in a thread of its own) has built them.
            self.tasks.spawn(self.loaded.warm_up(self.loaded.runtime), "compile warm-up",
                             runs_forever=False)
        self._update_status()

    async def _watch_engine(self, engine: Engine) -> None:
        """A replica whose runtime broke for good stops at once, without answering
        its in-flight requests: their offsets stay uncommitted and another replica
        serves them again, as a later attempt."""
        await engine.failed.wait()
        if engine is self.engine:
            self.fatal = engine.fatal
            log.error("replica down: %s", engine.fatal)
            self.metrics.set_ready(False)
            self._decide_stop()

    async def _sync_adapters(self, dep: ModelDeployment) -> None:
        """Adapters added or removed while serving: no reload needed."""
        if self._reload.is_set():
            return
        if await self.loaded.sync_adapters(dep) and self.ingest is not None:
            self.ingest.adapters = frozenset(self.loaded.adapters.names)

    def _apply_placement(self, dep: ModelDeployment) -> None:
        if self.settings.pool in dep.placement.compute_pools:
            self._serving.set()
        else:
            self._serving.clear()
        if self.ingest is not None:
            self.ingest.max_ttft_ms = dep.placement.max_ttft_ms
        self.metrics.set_max_ttft(dep.placement.max_ttft_ms / 1000)
        self._update_status()

    async def _on_deployment(self, dep: ModelDeployment | None) -> None:
        if dep is None:
            # Removed from the registry: stop serving (as if no pool held it) until a
            # new registration arrives.
            log.warning("model %s was removed: leaving its consumer group until it is "
                        "registered again", self.model)
            self._serving.clear()
            self._update_status()
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
            self.tasks.spawn(self._sync_adapters(dep), "adapter sync", runs_forever=False)

    async def _drain_and_reload(self) -> None:
        assert self.engine is not None and self.ingest is not None and self.deployment
        assert self.pump is not None and self.writer is not None
        self._reload.clear()
        self.metrics.set_ready(False)
        log.info("compute config changed: draining %d requests", self.engine.num_unfinished)
        await self.engine.drain()
        await self.pump.wait_idle(self.engine)
        await self.writer.flush()
        await self.ingest.commit()
        await self.loaded.close()
        await self._load(self.deployment)
        self.num_reloads += 1
        self.metrics.set_ready(True)
        self._update_status()

    # ---- requests in -----------------------------------------------------------------

    async def _consume(self) -> None:
        assert self.ingest is not None and self.handover is not None
        while not self._stopping.is_set():
            if self._reload.is_set():
                await self._drain_and_reload()
            if not self._serving.is_set():
                # Never subscribed when the pool is not in the placement: joining and at
                # once leaving races the client's group coordinator.
                if self.ingest.subscribed:
                    await self.handover.leave_group(
                        self.ingest, f"pool {self.settings.pool} is no longer in the "
                        f"placement of {self.model}")
                await self._serving.wait()
            if not self.ingest.subscribed:
                self.ingest.subscribe()
            # Backpressure: every partition paused while the engine is full. Paused
            # partitions still heartbeat; polling serves rebalances and reads partitions
            # assigned meanwhile (never left unread, and then paused).
            assert self.engine is not None
            self.ingest.pause_all(self.engine.is_full())
            await self.intake.poll(self.ingest, on_wait=self._waiting,
                                   on_reading=self._update_status)

    async def _commit_loop(self) -> None:
        assert self.ingest is not None
        while True:
            await asyncio.sleep(0.1)
            await self.ingest.commit()
