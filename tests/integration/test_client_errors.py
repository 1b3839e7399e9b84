"""Clear, fast failures from the SDK and CLI: unknown models, no worker (client
deadlines), typos, placements without workers, and removing a model."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import orjson
import pytest

import sluice
from common.settings import Settings
from sluice.errors import InvalidRequestError, RequestTimeoutError, UnknownModelError
from tests.integration.pipeline_helpers import drop_schema, settings_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _cli(settings: Settings, *args: str, stdin: str = "", key: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = {**settings_env(settings), "COLUMNS": "200"}
    if key is not None:
        env["SLUICE_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "sluice", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=120)


def _one_clear_line(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output and "not found in cluster metadata" not in output, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert all(fragment in errors[0] for fragment in fragments), output
    assert len(output.splitlines()) <= 4, output


async def test_unknown_model_fails_fast_and_clearly(settings, tmp_path: Path) -> None:
    client = sluice.Client(settings)
    try:
        started = time.monotonic()
        with pytest.raises(UnknownModelError) as info:
            await asyncio.wait_for(client.complete(model="nosuch", prompt="hi"), 30)
        assert time.monotonic() - started < 10
        assert "nosuch" in str(info.value) and "sluice models register" in str(info.value)
        with pytest.raises(UnknownModelError):
            async for _ in client.stream(model="nosuch", prompt="hi"):
                pass
    finally:
        await client.aclose()
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "body": {"prompt": "hi"}}\n')
    results = await asyncio.gather(
        asyncio.to_thread(_cli, settings, "batch", str(src), "--model", "nosuch",
                          "-o", str(tmp_path / "out.jsonl")),
        asyncio.to_thread(_cli, settings, "chat", "--model", "nosuch", stdin="hello\n"))
    for result in results:
        _one_clear_line(result, "'nosuch' is not registered", "sluice models register")
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


async def test_no_worker_means_a_client_deadline_not_a_hang(settings, tiny_model,
                                                            tmp_path: Path) -> None:
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(tiny_model))
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")
    try:
        for call in ("complete", "stream"):
            started = time.monotonic()
            with pytest.raises(RequestTimeoutError) as info:
                if call == "complete":
                    await client.complete(model="tiny", api_key=key, prompt="hi", timeout=2)
                else:
                    async for _ in client.stream(model="tiny", api_key=key, prompt="hi",
                                                 timeout=2):
                        pass
            assert 2 <= time.monotonic() - started < 15
            assert info.value.client_deadline and info.value.max_ttft_ms is None
            assert "no terminal event within 2 s" in str(info.value)
            assert "sluice workers --model tiny" in str(info.value)

        # The default deadline comes from SLUICE_CLIENT__REQUEST_TIMEOUT_SECS.
        quick = sluice.Client(settings.model_copy(update={
            "client": settings.client.model_copy(update={"request_timeout_secs": 1.5})}))
        try:
            with pytest.raises(RequestTimeoutError, match=r"within 1\.5 s"):
                await asyncio.wait_for(quick.complete(model="tiny", api_key=key,
                                                      prompt="hi"), 20)
        finally:
            await quick.aclose()

        with pytest.raises(InvalidRequestError, match="temprature"):
            await client.complete(model="tiny", api_key=key, prompt="hi", temprature=0.5)

        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text("".join(orjson.dumps({"custom_id": f"c{i}", "body": {"prompt": "hi"}})
                               .decode() + "\n" for i in range(3)))
        batch = await asyncio.to_thread(_cli, settings, "batch", str(src), "--model", "tiny",
                                        "-o", str(out), "--timeout", "2", key=key)
        assert batch.returncode == 1, batch.stdout + batch.stderr
        assert "3 without an answer in time" in batch.stdout, batch.stdout
        assert out.read_text() == ""  # no line: the next run retries them

        update = await asyncio.to_thread(_cli, settings, "models", "update", "--model", "tiny",
                                         "--pools", "elsewhere")
        assert update.returncode == 0, update.stderr
        assert "warning: no live worker of tiny is in pools elsewhere" in update.stderr
        workers = await asyncio.to_thread(_cli, settings, "workers", "--model", "tiny")
        assert workers.returncode == 0 and "no live worker of model tiny" in workers.stderr
    finally:
        await client.aclose()
        await drop_schema(settings)


DOCUMENTED_USAGE = """
import asyncio, os, sluice
from sluice.errors import KafkaAccessError, RequestTimeoutError

async def main():
    async with sluice.Client() as client:
        try:
            await client.complete(model="tiny", api_key=os.environ["KEY"], prompt="hi",
                                  timeout=1)
        except RequestTimeoutError:
            print("timed out")
    try:
        async with sluice.Client(kafka_bootstrap="127.0.0.1:1") as client:
            await client.complete(model="tiny", prompt="hi", timeout=1)
    except KafkaAccessError:
        print("refused")

asyncio.run(main())
"""


async def test_the_documented_usage_leaves_nothing_unclosed(settings, tiny_model) -> None:
    """`async with sluice.Client()` as the README shows it, answered or refused at login:
    no "Unclosed AIOKafkaProducer/Consumer" lines (aiokafka's warnings of clients left
    open) at exit."""
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(tiny_model))
    key = client.keys.create(tenant="acme")
    client.close()
    try:
        result = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-X", "dev", "-c", DOCUMENTED_USAGE],
            env={**settings_env(settings), "KEY": key, "SLUICE_CLIENT__TIMEOUT_SECS": "5"},
            capture_output=True, text=True, timeout=120)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert result.stdout.split() == ["timed", "out", "refused"], output
        assert "Unclosed" not in output and "never awaited" not in output, output
    finally:
        await drop_schema(settings)


async def test_removing_a_model(settings, tiny_model) -> None:
    from common.topics import TopicAdmin

    with sluice.Client(settings) as admin_client:
        admin_client.models.register(model="tiny", path=str(tiny_model))
        key = admin_client.keys.create(tenant="acme")
        admin_client.keys.grant(key, model="tiny")
    try:
        removed = await asyncio.to_thread(_cli, settings, "models", "remove", "--model", "tiny")
        assert removed.returncode == 0, removed.stderr
        assert "removed model tiny and its request topic" in removed.stdout
        async with TopicAdmin(settings) as admin:
            assert settings.requests_topic("tiny") not in await admin.list_topics()
        client = sluice.Client(settings)
        try:
            assert client.models.list() == []
            with pytest.raises(UnknownModelError):
                await client.complete(model="tiny", api_key=key, prompt="hi")
        finally:
            await client.aclose()
        again = await asyncio.to_thread(_cli, settings, "models", "remove", "--model", "tiny")
        _one_clear_line(again, "'tiny' is not registered")
        # Registered again, it starts from scratch: no grant of the old one survives.
        with sluice.Client(settings) as admin_client:
            dep = admin_client.models.register(model="tiny", path=str(tiny_model))
            assert dep.revision == 1
        conn = await asyncpg.connect(settings.database_url)
        try:
            grants = await conn.fetchval(
                f'SELECT count(*) FROM "{settings.db_schema}".grants WHERE model = $1', "tiny")
        finally:
            await conn.close()
        assert grants == 0
    finally:
        await drop_schema(settings)
