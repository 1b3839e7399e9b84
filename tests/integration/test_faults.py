"""Faults: a request that breaks the model step, a broker restart, a database outage."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

import sluice
from common.settings import Settings
from gpu_runtime import Runtime, StepOutput, StepPlan
from gpu_runtime.tiny import make_tiny_model
from sluice.errors import RequestError
from tests.conftest import free_port
from tests.integration.pipeline_helpers import drop_schema, register_tiny, settings_env
from worker.worker import Worker, WorkerOptions

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POISON = 7  # a prompt holding this token id makes the injected fault fire
STEP_SECONDS = 0.01  # 512 tokens then take over 5 s, so the healthy requests overlap


class FaultyRuntime(Runtime):
    """The real runtime, whose step raises — without saying for whom, as a kernel
    fault would — whenever a sequence whose prompt holds POISON is in it.

    Each step also takes at least STEP_SECONDS: the tiny model decodes 512 tokens in
    about 0.3 s, less than the gap between the first request a consumer fetch hands
    the worker and the rest, so six requests were never all running at once."""

    def execute(self, plan: StepPlan) -> StepOutput:
        for seq_id in plan.num_scheduled_tokens:
            if POISON in self.get_sequence(seq_id).token_ids[:8]:
                raise RuntimeError("injected fault in the model step")
        time.sleep(STEP_SECONDS)
        return super().execute(plan)





async def test_a_request_that_breaks_the_step_fails_alone(settings, tmp_path) -> None:
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"))
    worker = Worker(settings, WorkerOptions(model="tiny", instance_id="faulty-0"),
                    runtime_factory=lambda path, cfg: FaultyRuntime(path, cfg))
    task: asyncio.Task[None] | None = None
    try:
        async def healthy(i: int) -> int:
            done = await client.complete(model="tiny", api_key=key, max_tokens=512,
                                         ignore_eos=True, prompt_token_ids=[11, 12, 13 + i])
            return done.usage.completion_tokens

        task = asyncio.create_task(worker.run())
        good = [asyncio.create_task(healthy(i)) for i in range(6)]
        # The poisoned request arrives while the healthy ones decode (512 tokens each),
        # so it shares their steps: the failing step names no culprit and must be
        # isolated. (Sent together before the worker ran, it could be read first and
        # fail in a step of its own.)
        async with asyncio.timeout(60):
            while worker.engine is None or worker.engine.scheduler.num_running < 6:
                await asyncio.sleep(0.01)
        poisoned = asyncio.create_task(client.complete(
            model="tiny", api_key=key, max_tokens=16, prompt_token_ids=[POISON, 12, 13]))
        with pytest.raises(RequestError) as info:
            await asyncio.wait_for(poisoned, 120)
        assert info.value.code == "internal" and "injected fault" in str(info.value)
        assert all(n == 512 for n in await asyncio.wait_for(asyncio.gather(*good), 120))
        assert task is not None and not task.done()
        assert worker.engine is not None
        assert worker.engine.scheduler.stats.num_isolated_failures >= 1
    finally:
        worker.stop()
        if task is not None:
            await task
        await client.aclose()
        await drop_schema(settings)


def _private_infra(tmp_path: Path):
    from infra.common import InfraConfig

    return InfraConfig.from_env(state_dir=tmp_path / "infra", kafka_port=free_port(),
                                kafka_controller_port=free_port(), postgres_port=free_port())


def _worker(settings: Settings, log: Path, model: str = "tiny") -> subprocess.Popen[bytes]:
    env = settings_env(settings)
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--model", model],
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_stuck_shutdown_still_ends_the_process_in_time(settings, tmp_path) -> None:
    """A worker told to stop whose shutdown hangs (here its runtime never finishes
    closing) exits all the same once its watchdog's deadline passes, naming the step it
    was stuck in: a stopped worker must never look alive to its supervisor."""
    deadline_s = 3.0
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"))
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.stuck_worker", "tiny", str(deadline_s)],
            env=settings_env(settings), stdout=out, stderr=subprocess.STDOUT)
    try:
        done = await asyncio.wait_for(client.complete(
            model="tiny", api_key=key, prompt="hello", max_tokens=2), 120)
        assert done.finish_reason in ("stop", "length")
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
        took = time.monotonic() - stopped
        text = log.read_text()
        assert code == 0, text[-3000:]
        assert "stuck in: closing the model runtime" in text
        assert deadline_s <= took < deadline_s + 20, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await client.aclose()
        await drop_schema(settings)


async def test_database_outage_delays_but_never_skips_the_check(endpoints, unique_name,
                                                                  tmp_path) -> None:
    from infra import postgres

    cfg = _private_infra(tmp_path)
    url = str(postgres.up(cfg)["url"])
    settings = Settings(kafka_bootstrap=endpoints.kafka_bootstrap, database_url=url,
                        db_schema=unique_name, topic_prefix=unique_name, request_partitions=2)
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"))
    client.close()
    worker = _worker(settings, tmp_path / "worker.log")
    try:
        warm = await asyncio.wait_for(client.complete(
            model="tiny", api_key=key, prompt="warm", max_tokens=2), 120)
        assert warm.finish_reason in ("stop", "length")
        # off the loop: the client's reply consumer keeps running while the server stops
        assert await asyncio.to_thread(postgres.down, cfg)
        await asyncio.sleep(3)  # the worker notices and stops trusting its cache

        patient = asyncio.create_task(client.complete(
            model="tiny", api_key=key, prompt="I can wait", max_tokens=3, max_ttft_ms=60_000))
        hasty = asyncio.create_task(client.complete(
            model="tiny", api_key=key, prompt="I cannot", max_tokens=3, max_ttft_ms=2_000))
        with pytest.raises(sluice.RequestTimeoutError):
            await asyncio.wait_for(hasty, 30)
        assert not patient.done()  # no first token without a permission check

        await asyncio.to_thread(postgres.up, cfg)
        done = await asyncio.wait_for(patient, 60)
        assert done.usage.completion_tokens >= 1
        assert worker.poll() is None
        log = (tmp_path / "worker.log").read_text()
        assert "waiting for the permission database" in log
    finally:
        _end(worker)
        await client.aclose()
        postgres.purge(cfg)


async def test_broker_restart_under_load_loses_nothing(endpoints, unique_name,
                                                       tmp_path) -> None:
    from infra import kafka_broker

    cfg = _private_infra(tmp_path)
    bootstrap = str((await asyncio.to_thread(kafka_broker.up, cfg))["bootstrap"])
    settings = Settings(kafka_bootstrap=bootstrap, database_url=endpoints.database_url,
                        db_schema=unique_name, topic_prefix=unique_name, request_partitions=2)
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"))
    worker = _worker(settings, tmp_path / "worker.log")

    async def one(i: int) -> str:
        done = await client.complete(model="tiny", api_key=key, prompt=f"item {i}",
                                     max_tokens=24, request_id=f"br-{i}")
        return done.request_id

    try:
        await asyncio.wait_for(one(-1), 120)
        first = [asyncio.create_task(one(i)) for i in range(20)]
        await asyncio.sleep(0.3)
        await asyncio.to_thread(kafka_broker.down, cfg)
        later = [asyncio.create_task(one(i)) for i in range(20, 30)]  # sent while it is down
        await asyncio.sleep(2)
        await asyncio.to_thread(kafka_broker.up, cfg)
        ids = await asyncio.wait_for(asyncio.gather(*first, *later), 240)
        assert sorted(ids) == sorted(f"br-{i}" for i in range(30))
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        _end(worker)
        await client.aclose()
        kafka_broker.purge(cfg)
        await drop_schema(settings)


async def test_a_terminal_event_sent_while_the_broker_is_away_lands_when_it_returns(
    tmp_path, unique_name
) -> None:
    """The broker is away for several times the producer's request timeout: the
    terminal event is not acknowledged meanwhile and its input offset is not marked
    finished (the commit point must not pass it); once the broker is back the
    event lands, exactly once, and only then is the offset finished."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from infra import kafka_broker
    from results.writer import ResultWriter
    from schemas import ErrorCode
    from worker.options import results_options

    cfg = _private_infra(tmp_path)
    bootstrap = str((await asyncio.to_thread(kafka_broker.up, cfg))["bootstrap"])
    settings = Settings(kafka_bootstrap=bootstrap, database_url="postgresql://unused",
                        topic_prefix=unique_name, client={"timeout_secs": 2})
    reply_topic = f"{unique_name}.replies"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(reply_topic, 1, 1)])
    await admin.close()
    finished: list[tuple[object, int]] = []
    writer = ResultWriter(results_options(settings, "tiny"),
                          lambda tp, offset: finished.append((tp, offset)))
    await writer.start()
    request_tp = TopicPartition(f"{unique_name}.requests.tiny", 0)
    try:
        await writer.refusal(tp=request_tp, offset=0, reply_topic=reply_topic,
                                           request_id="before", code=ErrorCode.INTERNAL,
                                           message="sent while the broker is up")
        await writer.flush()
        assert finished == [(request_tp, 0)]

        await asyncio.to_thread(kafka_broker.down, cfg)
        await writer.refusal(tp=request_tp, offset=1, reply_topic=reply_topic,
                                           request_id="during", code=ErrorCode.INTERNAL,
                                           message="sent while the broker is away")
        await asyncio.sleep(6)  # three request timeouts
        assert finished == [(request_tp, 0)]  # not acknowledged: not finished
        await asyncio.to_thread(kafka_broker.up, cfg)
        await asyncio.wait_for(writer.flush(), 120)
        assert finished == [(request_tp, 0), (request_tp, 1)]
    finally:
        await asyncio.to_thread(kafka_broker.up, cfg)  # stopping the producer needs it
        await writer.stop()

    consumer = AIOKafkaConsumer(reply_topic, bootstrap_servers=bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        seen: list[str] = []
        async with asyncio.timeout(60):
            while len(seen) < 2:
                for records in (await consumer.getmany(timeout_ms=1000)).values():
                    seen += [orjson.loads(r.value)["request_id"] for r in records]
        assert seen == ["before", "during"]
    finally:
        await consumer.stop()
        await asyncio.to_thread(kafka_broker.purge, cfg)


async def test_a_worker_task_that_fails_stops_the_worker(settings, tmp_path, caplog) -> None:
    """A worker started after its compute config changed loads the newest revision
    once (no reload at start). Then one of its background tasks raises: the worker
    logs it with its traceback, stops being ready and stops within seconds with
    `fatal` set (the CLI exits 3), rather than living on without it."""
    import logging

    from worker.worker import WorkerTaskFailed

    model_dir = make_tiny_model(tmp_path / "tiny")
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(model_dir))
    client.models.update_compute_config(model="tiny", compute_config={"kv_cache_len": 3072})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")
    worker = Worker(settings, WorkerOptions(model="tiny", instance_id="task-fault-0"))
    task = asyncio.create_task(worker.run())
    try:
        done = await asyncio.wait_for(client.complete(
            model="tiny", api_key=key, prompt_token_ids=[3, 4, 5], max_tokens=2), 120)
        assert done.usage.completion_tokens >= 1
        assert worker.metrics.ready
        assert worker.num_reloads == 0 and worker.deployment.revision == 2

        def broken_gauge(num_waiting: int, num_running: int) -> None:
            raise ValueError("injected gauge failure")

        worker.metrics.set_queue = broken_gauge  # type: ignore[method-assign]
        caplog.set_level(logging.ERROR, logger="worker.worker")
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(asyncio.shield(task), 30)
        assert asyncio.get_running_loop().time() - started < 15
        assert isinstance(worker.fatal, WorkerTaskFailed)
        assert "'gauges' failed" in str(worker.fatal) and "injected" in str(worker.fatal)
        assert not worker.metrics.ready
        failures = [r for r in caplog.records if "'gauges' failed" in r.getMessage()]
        assert failures and failures[0].exc_info is not None  # with its traceback
    finally:
        worker.stop()
        await task
        await client.aclose()
        await drop_schema(settings)
