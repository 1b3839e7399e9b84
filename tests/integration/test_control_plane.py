"""Control plane, SDK control calls and the permission check, on the real broker and database."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

import sluice
from common.db import create_pool, notify_channel
from common.settings import Settings
from ingest.permissions import PermissionChecker
from schemas import ModelDeployment, decode
from sluice.control_plane import ControlPlane
from sluice.errors import (
    ConflictError,
    DependencyTimeoutError,
    InvalidConfigError,
    LimitExceededError,
    NotFoundError,
)
from tests.integration.pipeline_helpers import drop_schema

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[Path]]:
    from gpu_runtime.tiny import make_tiny_adapters, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")
    return path, make_tiny_adapters(path, path / "adapters", 6)


@pytest.fixture
def model_dir(tiny) -> Path:
    return tiny[0]


def _adapter_dir(tiny_or_path, name: str) -> Path:
    """One of the tiny model's real PEFT adapters (`name` ends in its index)."""
    return tiny_or_path[1][int(name[-1])]


async def test_register_update_and_publish(settings, model_dir) -> None:
    cp = await ControlPlane.connect(settings)
    try:
        dep = await cp.register_model("tiny", str(model_dir))
        assert dep.revision == 1 and dep.compute_config.max_adapters == 4
        with pytest.raises(ConflictError):
            await cp.register_model("tiny", str(model_dir))
        dep = await cp.update_compute_config("tiny", {"kv_cache_len": 300000, "tp": 4})
        assert (dep.compute_config.kv_cache_len, dep.compute_config.tp) == (300000, 4)
        dep = await cp.update("tiny", {"compute_pools": ["pool-1", "pool-2"],
                                       "max_ttft_ms": 5000})
        assert dep.placement.compute_pools == ["pool-1", "pool-2"]
        assert dep.compute_config.kv_cache_len == 300000  # earlier change kept
        assert dep.revision == 3
        with pytest.raises(InvalidConfigError, match="quantization"):
            await cp.update_compute_config("tiny", {"quantization": "int2"})
        with pytest.raises(InvalidConfigError, match="tp"):
            await cp.update_compute_config("tiny", {"tp": 0})
        with pytest.raises(NotFoundError, match="sluice models register"):
            await cp.update("nope", {"max_ttft_ms": 1})
        with pytest.raises(InvalidConfigError, match="invalid model name"):
            await cp.register_model("bad name; drop", str(model_dir))
        assert [d.model for d in await cp.list_models()] == ["tiny"]
    finally:
        await cp.close()

    # The request topic exists, with LogAppendTime and the configured partitions.
    admin = AIOKafkaAdminClient(**settings.kafka_options())
    await admin.start()
    try:
        described = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, settings.requests_topic("tiny"))]
        )
        configs = {c[0]: c[1] for c in described[0].resources[0][4]}
        assert configs["message.timestamp.type"] == "LogAppendTime"
        control = [ConfigResource(ConfigResourceType.TOPIC, settings.topic("control"))]
        configs = {c[0]: c[1] for c in (await admin.describe_configs(control))[0].resources[0][4]}
        assert configs["cleanup.policy"] == "compact"
    finally:
        await admin.close()

    # Every change was published on the control topic; the newest is the truth.
    consumer = AIOKafkaConsumer(settings.topic("control"), auto_offset_reset="earliest",
                                **settings.kafka_options())
    await consumer.start()
    try:
        batch = await consumer.getmany(timeout_ms=5000)
        records = [r for rs in batch.values() for r in rs]
        while len(records) < 3:
            more = await consumer.getmany(timeout_ms=5000)
            assert more
            records += [r for rs in more.values() for r in rs]
    finally:
        await consumer.stop()
    deployments = [decode(ModelDeployment, r.value) for r in records]
    assert [d.revision for d in deployments] == [1, 2, 3]
    assert all(r.key == b"tiny" for r in records)
    await drop_schema(settings)


async def test_adapter_limit_is_enforced_with_a_clear_message(settings, model_dir, tiny,
                                                             tmp_path) -> None:
    cp = await ControlPlane.connect(settings)
    try:
        await cp.register_model("tiny", str(model_dir))
        for i in range(4):
            await cp.register_adapter("tiny", f"a{i}", str(_adapter_dir(tiny, f"a{i}")))
        with pytest.raises(LimitExceededError) as info:
            await cp.register_adapter("tiny", "a4", str(_adapter_dir(tiny, "a4")))
        assert "max_adapters=4" in str(info.value) and "update-compute-config" in str(info.value)
        await cp.update_compute_config("tiny", {"max_adapters": 6})
        dep = await cp.register_adapter("tiny", "a4", str(_adapter_dir(tiny, "a4")))
        assert [a.name for a in dep.adapters] == ["a0", "a1", "a2", "a3", "a4"]
        dep = await cp.remove_adapter("tiny", "a0")
        assert [a.name for a in dep.adapters] == ["a1", "a2", "a3", "a4"]
        with pytest.raises(InvalidConfigError, match=r"adapter_config\.json"):
            await cp.register_adapter("tiny", "empty", str(tmp_path))
        # An adapter made for another base model is refused with the shapes.
        from gpu_runtime.tiny import TinySpec, make_tiny_adapters, make_tiny_model

        other = make_tiny_model(tmp_path / "wide", TinySpec(hidden_size=96, num_heads=6,
                                                            num_kv_heads=2))
        foreign = make_tiny_adapters(other, tmp_path / "wide-adapters", 1)[0]
        await cp.update_compute_config("tiny", {"max_adapters": 8})
        with pytest.raises(InvalidConfigError, match="refused"):
            await cp.register_adapter("tiny", "foreign", str(foreign))
    finally:
        await cp.close()
    await drop_schema(settings)


async def test_keys_grants_and_fast_revocation(settings, model_dir) -> None:
    cp = await ControlPlane.connect(settings)
    pool = await create_pool(settings)
    checker = PermissionChecker(pool, notify_channel(settings.db_schema))
    checker.start()
    try:
        await cp.register_model("tiny", str(model_dir))
        key = await cp.create_key("acme")
        other = await cp.create_key("globex")
        await cp.grant(key, "tiny", "support-bot")
        bearer = f"Bearer {key}".encode()
        # Stored only as a salted hash: the secret appears nowhere in the table.
        conn = await asyncpg.connect(settings.database_url)
        rows = await conn.fetch(f'SELECT * FROM "{settings.db_schema}".api_keys')
        await conn.close()
        assert key.split(".")[1].encode() not in orjson.dumps([dict(r) for r in rows],
                                                               default=str)
        assert (await checker.check(bearer, "tiny", "support-bot")).allowed
        denied = await checker.check(bearer, "tiny", "other-bot")
        assert not denied.allowed and "other-bot" in denied.reason
        assert not (await checker.check(bearer, "tiny", None)).allowed  # base not granted
        assert not (await checker.check(f"Bearer {other}", "tiny", "support-bot")).allowed
        assert not (await checker.check(None, "tiny", None)).allowed
        forged = key[:-4] + "AAAA"
        assert not (await checker.check(f"Bearer {forged}", "tiny", "support-bot")).allowed

        # Cached: a second check does not ask the database.
        lookups = checker.num_lookups
        assert (await checker.check(bearer, "tiny", "support-bot")).allowed
        assert checker.num_lookups == lookups

        for _ in range(50):  # wait for the listener to be attached
            if checker._listening:
                break
            await asyncio.sleep(0.1)
        await cp.revoke(key)
        started = time.monotonic()
        while (await checker.check(bearer, "tiny", "support-bot")).allowed:
            assert time.monotonic() - started < 1.0, "revocation not seen within 1 s"
            await asyncio.sleep(0.02)
    finally:
        await checker.close()
        await pool.close()
        await cp.close()
    await drop_schema(settings)


def test_sdk_control_calls_are_synchronous(settings, model_dir, tiny) -> None:
    with sluice.Client(settings) as client:
        client.models.register(model="tiny", path=str(model_dir))
        dep = client.models.update_compute_config(
            model="tiny", compute_config={"kv_cache_len": 300000, "tp": 1})
        assert dep.compute_config.kv_cache_len == 300000
        dep = client.models.update(model="tiny", placement={"compute_pools": ["pool-1"],
                                                            "max_ttft_ms": 60000})
        assert dep.placement.compute_pools == ["pool-1"]
        client.adapters.register(model="tiny", name="support-bot",
                                 path=str(_adapter_dir(tiny, "a0")))
        key = client.keys.create(tenant="acme")
        client.keys.grant(key, model="tiny", adapter="support-bot")
        assert key.startswith("sk-sluice-")
        assert [a.name for a in client.adapters.list(model="tiny")] == ["support-bot"]
    asyncio.run(drop_schema(settings))


async def test_dependency_timeout_names_the_setting(endpoints, unique_name) -> None:
    import socket

    # A listener that never answers: the connection opens but PostgreSQL's
    # handshake never comes, so only the client timeout can end the call.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        settings = Settings(kafka_bootstrap=endpoints.kafka_bootstrap,
                            database_url=f"postgresql://u:p@127.0.0.1:{port}/x",
                            db_schema=unique_name, client={"timeout_secs": 0.3})
        started = time.monotonic()
        with pytest.raises(DependencyTimeoutError) as info:
            await create_pool(settings)
    assert "SLUICE_CLIENT__TIMEOUT_SECS=0.3" in str(info.value)
    assert time.monotonic() - started < 5
