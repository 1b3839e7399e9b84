"""A model served through the real broker and PostgreSQL, with a worker in this process.

`served_model(...)` is what the `kafka` and `bulk` scenarios share: it reuses
`SLUICE_KAFKA_BOOTSTRAP` / `SLUICE_DATABASE_URL` when both are set, else
starts the local infrastructure (`infra.local.up`). Every run gets its own
topic prefix and database schema; the schema and the topics are dropped
afterwards, so runs never see each other's data.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from common.settings import Settings
from common.tracing import Tracing
from sluice.client import Client
from worker.worker import Worker, WorkerOptions

MODEL = "bench"
KV_CACHE_LEN = 16384
MAX_NUM_BATCHED_TOKENS = 512  # the worker's default budget; the in-process engine uses it too


@dataclass(frozen=True, slots=True)
class Served:
    settings: Settings
    client: Client
    api_key: str
    model_dir: Path


def endpoints() -> tuple[str, str]:
    bootstrap = os.environ.get("SLUICE_KAFKA_BOOTSTRAP")
    url = os.environ.get("SLUICE_DATABASE_URL")
    if bootstrap and url:
        return bootstrap, url
    from infra import local
    from infra.common import InfraConfig

    started = local.up(InfraConfig.from_env())
    return bootstrap or str(started["kafka"]["bootstrap"]), url or str(started["postgres"]["url"])


def _setup(client: Client, model_dir: Path) -> str:
    client.models.register(model=MODEL, path=str(model_dir),
                           compute_config={"kv_cache_len": KV_CACHE_LEN})
    key = client.keys.create(tenant="bench")
    client.keys.grant(key, model=MODEL)
    return key


async def _drop(settings: Settings) -> None:
    import asyncpg
    from aiokafka.admin import AIOKafkaAdminClient

    conn = await asyncpg.connect(settings.database_dsn())
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.db_schema}" CASCADE')
    finally:
        await conn.close()
    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        mine = [t for t in await admin.list_topics() if t.startswith(settings.topic_prefix + ".")]
        if mine:
            await admin.delete_topics(mine)
    finally:
        await admin.close()


async def _register_twin(served: Served, name: str, compute: dict[str, object]) -> None:
    """Register `name` on the served weights (with `compute` config changes) and grant
    the bench's key to it."""
    def setup() -> None:
        served.client.models.register(model=name, path=str(served.model_dir),
                                      compute_config={"kv_cache_len": KV_CACHE_LEN, **compute})
        served.client.keys.grant(served.api_key, model=name)

    await asyncio.to_thread(setup)


async def _first_answer(served: Served, name: str) -> None:
    """One request, so measurements see a joined, warmed-up worker."""
    async with asyncio.timeout(180):
        await served.client.complete(model=name, api_key=served.api_key,
                                     prompt_token_ids=[5, 6, 7], max_tokens=1)


@contextlib.asynccontextmanager
async def twin_model(served: Served, name: str, device: str, *,
                     tracing: Tracing | None = None, **compute: object) -> AsyncIterator[str]:
    """A second model on the same weights, with `compute` config changes (exactly-once
    delivery, say) and its own worker in this process: the same run measures both.
    `tracing`: the twin's (default: as the OTEL_* variables say)."""
    settings = served.settings
    await _register_twin(served, name, compute)
    worker = Worker(settings, WorkerOptions(
        model=name, device=device, instance_id=f"{settings.topic_prefix}-{name}",
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, compile=False), tracing=tracing)
    task = asyncio.create_task(worker.run())
    try:
        await _first_answer(served, name)
        yield name
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            await task


@contextlib.asynccontextmanager
async def served_model(model_dir: Path, device: str) -> AsyncIterator[Served]:
    bootstrap, url = await asyncio.to_thread(endpoints)
    tag = f"bench_{uuid.uuid4().hex[:10]}"
    settings = Settings(kafka_bootstrap=bootstrap, database_url=url, db_schema=tag,
                        topic_prefix=tag, request_partitions=1)
    client = Client(settings)
    worker_task: asyncio.Task[None] | None = None
    worker: Worker | None = None
    try:
        key = await asyncio.to_thread(_setup, client, model_dir)
        # Eager steps, like the in-process baseline's runtime: these scenarios measure
        # what Kafka adds, not the compiled step (`sluice bench runtime` does).
        worker = Worker(settings, WorkerOptions(
            model=MODEL, device=device, instance_id=tag,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, compile=False))
        worker_task = asyncio.create_task(worker.run())
        # One request first, so the measurements see a joined, warmed-up worker.
        async with asyncio.timeout(180):
            await client.complete(model=MODEL, api_key=key, prompt_token_ids=[5, 6, 7],
                                  max_tokens=1)
        yield Served(settings, client, key, model_dir)
    finally:
        if worker is not None and worker_task is not None:
            worker.stop()
            with contextlib.suppress(Exception):
                await worker_task
        await client.aclose()
        with contextlib.suppress(Exception):
            await _drop(settings)


@contextlib.asynccontextmanager
async def twin_model_process(served: Served, name: str, device: str,
                             log_path: Path) -> AsyncIterator[str]:
    """A second model on the same weights served by `sluice worker` in a process of its
    own, as deployments run it: its engine does not share this process's interpreter
    (and GIL) with the client that produces and reads. Stopped with SIGTERM, then
    SIGKILL if it has not exited within 30 s."""
    settings = served.settings
    await _register_twin(served, name, {})
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env = {**inherited, "SLUICE_KAFKA_BOOTSTRAP": str(settings.kafka_bootstrap),
           "SLUICE_DATABASE_URL": str(settings.database_url),
           "SLUICE_DB_SCHEMA": settings.db_schema, "SLUICE_TOPIC_PREFIX": settings.topic_prefix,
           "SLUICE_METRICS_PORT": "0"}
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sluice", "worker", "--model", name, "--device", device,
            "--no-compile", "--max-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--instance-id", f"{settings.topic_prefix}-{name}",
            env=env, stdout=log, stderr=asyncio.subprocess.STDOUT)
    try:
        await _first_answer(served, name)
        yield name
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
