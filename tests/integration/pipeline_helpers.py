"""Helpers for end-to-end tests: a served tiny model with a worker subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaConsumer

from common.settings import Settings

if TYPE_CHECKING:
    import openai

TERMINAL = {"done", "error", "timeout"}


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def wait_for_log(self, text: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"worker never logged {text!r}:\n{self.log()}")
            time.sleep(0.2)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)


def kafka_env(settings: Settings) -> dict[str, str]:
    """`settings.kafka` (security, compression) as SLUICE_KAFKA__* variables."""
    from pydantic import SecretStr

    out = {}
    for name, value in settings.kafka:
        if value is None or value == type(settings.kafka).model_fields[name].default:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        out[f"SLUICE_KAFKA__{name.upper()}"] = str(value)
    return out


def settings_env(settings: Settings, pool: str = "default") -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_KAFKA__")}
    return {
        **inherited,
        "SLUICE_KAFKA_BOOTSTRAP": str(settings.kafka_bootstrap),
        "SLUICE_DATABASE_URL": str(settings.database_url),
        "SLUICE_DB_SCHEMA": settings.db_schema,
        "SLUICE_TOPIC_PREFIX": settings.topic_prefix,
        "SLUICE_POOL": pool,
        "SLUICE_METRICS_PORT": "0",  # several workers share this host
        **kafka_env(settings),
    }


@contextlib.contextmanager
def worker_process(settings: Settings, model: str, log_dir: Path, *, pool: str = "default",
                   replica: int | None = 0, extra: list[str] | None = None,
                   env: dict[str, str] | None = None) -> Iterator[WorkerProcess]:
    """`sluice worker` as a subprocess (`replica=None`: without --replica)."""
    log_path = log_dir / f"worker-{pool}-{replica}-{time.monotonic_ns()}.log"
    flags = [] if replica is None else ["--replica", str(replica)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "worker", "--model", model, *flags,
             *(extra or [])],
            env={**settings_env(settings, pool), **(env or {})}, stdout=log,
            stderr=subprocess.STDOUT,
        )
    worker = WorkerProcess(proc, log_path)
    try:
        yield worker
    finally:
        worker.kill(signal.SIGTERM)
        worker.kill(signal.SIGKILL)


def register_tiny(settings: Settings, model_dir: Path, *, tenant: str = "acme",
                  compute_config: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Register the model at `model_dir` as `tiny`; (client, a key of `tenant` granted it)."""
    import sluice

    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(model_dir), compute_config=compute_config)
    key = client.keys.create(tenant=tenant)
    client.keys.grant(key, model="tiny")
    return client, key


@contextlib.asynccontextmanager
async def served_gateway(settings: Settings, api_key: str, instance_id: str, timeout_s: float
                         ) -> AsyncIterator[tuple[openai.AsyncOpenAI, int]]:
    """`sluice gateway` in this loop on a free port, once ready, and an `openai` client of
    it with `api_key` that never retries; (client, port). Closes both on exit."""
    import openai

    from gateway.app import serve
    from tests.conftest import free_port

    port = free_port()
    ready = asyncio.Event()
    gateway = asyncio.create_task(serve(settings, "127.0.0.1", port, instance_id, ready=ready))
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key,
                             max_retries=0, timeout=timeout_s)
    try:
        await asyncio.wait_for(ready.wait(), 60)
        yield api, port
    finally:
        await api.close()
        gateway.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gateway


def tiny_with_adapter(settings: Settings, model_dir: Path, adapters_dir: Path
                      ) -> tuple[Any, str]:
    """Register the tiny model with one adapter `a0`; (client, a key of tenant acme
    granted both)."""
    import sluice
    from gpu_runtime.tiny import make_tiny_adapters

    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(model_dir),
                           compute_config={"kv_cache_len": 4096})
    adapter_dir = make_tiny_adapters(model_dir, adapters_dir, 1)[0]
    client.adapters.register(model="tiny", name="a0", path=str(adapter_dir))
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")
    client.keys.grant(key, model="tiny", adapter="a0")
    return client, key


def scrape_metrics(worker: WorkerProcess) -> str:
    """The worker's Prometheus exposition (its port is in its log)."""
    import re
    import urllib.request

    worker.wait_for_log("metrics on port")
    port = int(re.search(r"metrics on port (\d+)", worker.log_path.read_text()).group(1))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


async def drop_schema(settings: Settings) -> None:
    """Remove a test's database schema (its registry, keys and grants)."""
    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.db_schema}" CASCADE')
    finally:
        await conn.close()


async def terminal_events(settings: Settings, topic: str, request_ids: set[str],
                          timeout_s: float = 60, settle_s: float = 1.0) -> Counter[str]:
    """Terminal events per request id seen by a `read_committed` reader of `topic` from
    its start: until every id has one, then `settle_s` more (a duplicate would show)."""
    attempts = await terminal_attempts(settings, topic, request_ids, timeout_s, settle_s)
    return Counter({request_id: len(seen) for request_id, seen in attempts.items()})


async def terminal_attempts(settings: Settings, topic: str, request_ids: set[str],
                            timeout_s: float = 60, settle_s: float = 1.0
                            ) -> dict[str, list[int]]:
    """The attempt of each terminal event per request id, as `terminal_events` reads."""
    consumer = AIOKafkaConsumer(topic, **settings.kafka_options(),
                                auto_offset_reset="earliest", isolation_level="read_committed")
    await consumer.start()
    attempts: dict[str, list[int]] = {}
    try:
        async with asyncio.timeout(timeout_s):
            settled_at: float | None = None
            while settled_at is None or time.monotonic() < settled_at:
                batch = await consumer.getmany(timeout_ms=200)
                for record in (r for rs in batch.values() for r in rs):
                    event = orjson.loads(record.value)
                    if event.get("type") in TERMINAL and event["request_id"] in request_ids:
                        attempts.setdefault(event["request_id"], []).append(
                            event.get("attempt", 0))
                if settled_at is None and request_ids <= attempts.keys():
                    settled_at = time.monotonic() + settle_s
    finally:
        await consumer.stop()
    return attempts
