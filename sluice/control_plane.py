"""The control plane: the registry in PostgreSQL, published on `sluice.control`.

Every change is one PostgreSQL transaction that bumps the model's revision,
then the model's full deployment (`ModelDeployment`) is published to the
compacted control topic, keyed by model, so the newest record per model is
what workers serve. Each operation is bounded by SLUICE_SERVER__TIMEOUT_SECONDS
and each call to a dependency by SLUICE_CLIENT__TIMEOUT_SECS.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pydantic
from aiokafka import AIOKafkaProducer

from common.db import create_pool, notify_channel
from common.kafka_connect import connect
from common.settings import Settings
from common.timeouts import dependency_call
from common.topics import TopicAdmin, request_topic, shared_topics
from schemas import AdapterSpec, ComputeConfig, ModelDeployment, Placement, encode
from schemas import keys as api_keys
from schemas.names import NameError_, check_name, is_valid_topic
from sluice.capacity import LIVE_WINDOW_S, WorkerInfo, check_fits
from sluice.errors import (
    ConflictError,
    InvalidConfigError,
    LimitExceededError,
    NotFoundError,
)

# Checks a deployment before it is stored (e.g. "does it fit in memory");
# raises InvalidConfigError with the reason. Set by whoever knows the devices.
DeploymentValidator = Callable[[ModelDeployment], None]


def _validation_message(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False, include_input=False):
        field = ".".join(str(p) for p in err["loc"])
        parts.append(f"{field}: {err['msg']}")
    return "; ".join(parts)


def _check(kind: str, value: str) -> str:
    try:
        return check_name(kind, value)
    except NameError_ as exc:
        raise InvalidConfigError(str(exc)) from None


def _check_adapter(dep: ModelDeployment, adapter_dir: Path) -> None:
    """Refuse an adapter that does not fit the base model (shapes, rank, targets)."""
    from gpu_runtime.errors import RuntimeErrorBase
    from gpu_runtime.lora_format import validate_adapter_dir

    try:
        validate_adapter_dir(dep.path, adapter_dir, dep.compute_config.max_lora_rank)
    except (RuntimeErrorBase, OSError, ValueError) as exc:
        raise InvalidConfigError(f"adapter at {adapter_dir} refused: {exc}") from None


class ControlPlane:
    """Async control-plane operations. Use `await ControlPlane.connect(settings)`."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, producer: AIOKafkaProducer,
                 validator: DeploymentValidator | None = None):
        self.settings = settings
        self._pool = pool
        self._producer = producer
        self._validator = validator

    @classmethod
    async def connect(cls, settings: Settings,
                      validator: DeploymentValidator | None = None) -> ControlPlane:
        timeout = settings.client.timeout_secs
        pool = await create_pool(settings)
        try:
            async with TopicAdmin(settings) as admin:
                await admin.ensure(shared_topics(settings))
            producer = AIOKafkaProducer(
                **settings.producer_options(), enable_idempotence=True,
                request_timeout_ms=int(timeout * 1000),
            )
            try:
                await connect(producer.start(), settings, "the control plane's producer")
            except BaseException:
                await producer.stop()  # a failed start closes what it opened
                raise
        except BaseException:
            await pool.close()
            raise
        return cls(settings, pool, producer, validator)

    async def close(self) -> None:
        await self._producer.stop()
        await self._pool.close()

    # -- models -------------------------------------------------------------------------

    async def register_model(self, model: str, path: str, *, partitions: int | None = None,
                             compute_config: dict[str, Any] | None = None,
                             placement: dict[str, Any] | None = None) -> ModelDeployment:
        _check("model", model)
        model_dir = Path(path).expanduser().resolve()
        is_gguf = model_dir.suffix.lower() == ".gguf" and model_dir.is_file()
        if not is_gguf and not (model_dir / "config.json").is_file():
            raise InvalidConfigError(
                f"{model_dir} is not a model directory (no config.json) nor a .gguf file; "
                "make one with `sluice models make-tiny DIR`"
            )
        config = self._parse(ComputeConfig, compute_config or {})
        place = self._parse(Placement, placement or {})
        deployment = ModelDeployment(model=model, revision=1, path=str(model_dir),
                                     compute_config=config, placement=place)
        self._validate(deployment)
        async with self._pool.acquire() as conn:
            await self._call(check_fits(conn, deployment), "checking worker capacity")
        async with TopicAdmin(self.settings) as admin:
            await admin.ensure([request_topic(self.settings, model, partitions)])
        async with self._pool.acquire() as conn:
            try:
                await self._call(conn.execute(
                    "INSERT INTO models (name, path, revision, compute_config, placement) "
                    "VALUES ($1, $2, 1, $3, $4)",
                    model, str(model_dir), config.model_dump(), place.model_dump(),
                ), "registering the model")
            except asyncpg.UniqueViolationError:
                raise ConflictError(
                    f"model {model!r} is already registered; change it with "
                    "`sluice models update-compute-config` or `sluice models update`"
                ) from None
        await self._publish(deployment)
        return deployment

    async def update_compute_config(self, model: str,
                                    compute_config: dict[str, Any]) -> ModelDeployment:
        def change(dep: ModelDeployment) -> dict[str, Any]:
            merged = {**dep.compute_config.model_dump(), **compute_config}
            return {"compute_config": self._parse(ComputeConfig, merged)}

        return await self._change(model, change)

    async def update(self, model: str, placement: dict[str, Any]) -> ModelDeployment:
        def change(dep: ModelDeployment) -> dict[str, Any]:
            merged = {**dep.placement.model_dump(), **placement}
            return {"placement": self._parse(Placement, merged)}

        return await self._change(model, change)

    async def remove_model(self, model: str, *, keep_topic: bool = False) -> None:
        """Remove a model: its registry entry, adapters and grants; a tombstone on the
        control topic (its workers leave the consumer group); and, unless `keep_topic`,
        its request topic with any requests still on it. Re-running finishes a removal
        that failed half-way."""
        _check("model", model)
        topic = self.settings.requests_topic(model)
        async with self._pool.acquire() as conn, conn.transaction():
            status = await self._call(conn.execute("DELETE FROM models WHERE name = $1", model),
                                      "removing the model")
            key_ids = await self._call(conn.fetch(
                "DELETE FROM grants WHERE model = $1 RETURNING key_id", model),
                "removing the model's grants")
            for key_id in {row["key_id"] for row in key_ids}:
                await conn.execute("SELECT pg_notify($1, $2)",
                                   notify_channel(self.settings.db_schema), key_id)
        async with TopicAdmin(self.settings) as admin:
            topic_exists = topic in await admin.list_topics()
            if status.endswith(" 0") and not topic_exists:
                raise NotFoundError(f"model {model!r} is not registered")
            await dependency_call(
                "publishing to the control topic",
                self._producer.send_and_wait(self.settings.topic("control"), None,
                                             key=model.encode()),
                self.settings.client.timeout_secs)
            if not keep_topic:
                await admin.delete([topic])

    async def list_workers(self, model: str | None = None,
                           pools: list[str] | None = None) -> list[WorkerInfo]:
        """Workers seen recently (heartbeat), optionally of one model and some pools."""
        async with self._pool.acquire() as conn:
            rows = await self._call(conn.fetch(
                "SELECT instance_id, model, pool, device, device_memory_bytes, started_at, "
                "last_seen, last_seen > now() - make_interval(secs => $3) AND status <> 'stopped' "
                "AS live, status, "
                "process "
                "FROM workers WHERE ($1::text IS NULL OR model = $1) "
                "AND ($2::text[] IS NULL OR pool = ANY($2::text[])) "
                "ORDER BY model, pool, instance_id", model, pools, LIVE_WINDOW_S),
                "listing workers")
        return [WorkerInfo(**dict(row)) for row in rows]

    async def get(self, model: str) -> ModelDeployment:
        async with self._pool.acquire() as conn:
            return await self._load(conn, model)

    async def list_models(self) -> list[ModelDeployment]:
        async with self._pool.acquire() as conn:
            names = await self._call(conn.fetch("SELECT name FROM models ORDER BY name"),
                                     "listing models")
            return [await self._load(conn, row["name"]) for row in names]

    # -- adapters -----------------------------------------------------------------------

    async def register_adapter(self, model: str, name: str, path: str) -> ModelDeployment:
        _check("adapter", name)
        adapter_dir = Path(path).expanduser().resolve()
        for required in ("adapter_config.json", "adapter_model.safetensors"):
            if not (adapter_dir / required).is_file():
                raise InvalidConfigError(
                    f"{adapter_dir} is not a PEFT LoRA adapter directory (no {required})"
                )

        def change(dep: ModelDeployment) -> dict[str, Any]:
            if any(a.name == name for a in dep.adapters):
                raise ConflictError(f"adapter {name!r} of model {model!r} is already registered")
            _check_adapter(dep, adapter_dir)
            limit = dep.compute_config.max_adapters
            if len(dep.adapters) >= limit:
                raise LimitExceededError(
                    f"model {model!r} already has {len(dep.adapters)} adapters, its limit "
                    f"(max_adapters={limit}). Raise it with `sluice models update-compute-config "
                    f"--model {model} --set max_adapters={limit * 2}` (SDK: "
                    "client.models.update_compute_config(model=..., compute_config="
                    "{'max_adapters': N})), or remove one with `sluice adapters remove`."
                )
            spec = AdapterSpec(name=name, path=str(adapter_dir))
            return {"adapters": [*dep.adapters, spec]}

        return await self._change(model, change)

    async def remove_adapter(self, model: str, name: str) -> ModelDeployment:
        def change(dep: ModelDeployment) -> dict[str, Any]:
            if not any(a.name == name for a in dep.adapters):
                raise NotFoundError(f"model {model!r} has no adapter {name!r}")
            return {"adapters": [a for a in dep.adapters if a.name != name]}

        return await self._change(model, change)

    # -- keys and grants ----------------------------------------------------------------

    async def create_key(self, tenant: str, reply_topic_prefix: str | None = None) -> str:
        """A new key. With `reply_topic_prefix`, its requests may only name reply topics
        starting with it — pair it with Kafka ACLs so tenants cannot read each other's."""
        _check("tenant", tenant)
        if reply_topic_prefix is not None and not is_valid_topic(reply_topic_prefix):
            raise InvalidConfigError(f"invalid reply topic prefix {reply_topic_prefix!r}")
        new = api_keys.generate()
        async with self._pool.acquire() as conn:
            await self._call(conn.execute(
                "INSERT INTO api_keys (key_id, tenant, salt, secret_hash, reply_topic_prefix) "
                "VALUES ($1, $2, $3, $4, $5)",
                new.key_id, tenant, new.salt, new.secret_hash, reply_topic_prefix,
            ), "creating a key")
        return new.key

    async def grant(self, key: str, model: str, adapter: str | None = None) -> None:
        key_id = self._key_id(key)
        _check("model", model)
        if adapter is not None:
            _check("adapter", adapter)
        async with self._pool.acquire() as conn, conn.transaction():
            found = await self._call(conn.fetchval(
                "SELECT 1 FROM api_keys WHERE key_id = $1 AND revoked_at IS NULL", key_id
            ), "looking up the key")
            if not found:
                raise NotFoundError(f"no active key with id {key_id}")
            await self._call(conn.execute(
                "INSERT INTO grants (key_id, model, adapter) VALUES ($1, $2, $3) "
                "ON CONFLICT DO NOTHING", key_id, model, adapter or "",
            ), "granting")
            await conn.execute("SELECT pg_notify($1, $2)",
                               notify_channel(self.settings.db_schema), key_id)

    async def revoke(self, key: str) -> None:
        key_id = self._key_id(key)
        async with self._pool.acquire() as conn, conn.transaction():
            status = await self._call(conn.execute(
                "UPDATE api_keys SET revoked_at = now() WHERE key_id = $1 AND revoked_at IS NULL",
                key_id,
            ), "revoking the key")
            if status.endswith(" 0"):
                raise NotFoundError(f"no active key with id {key_id}")
            # Workers LISTEN on this channel and drop the key from their caches.
            await conn.execute("SELECT pg_notify($1, $2)",
                               notify_channel(self.settings.db_schema), key_id)

    # -- internals ----------------------------------------------------------------------

    async def _change(self, model: str,
                      change: Callable[[ModelDeployment], dict[str, Any]]) -> ModelDeployment:
        async with self._pool.acquire() as conn, conn.transaction():
            current = await self._load(conn, model, lock=True)
            updated = current.model_copy(update={**change(current),
                                                 "revision": current.revision + 1})
            self._validate(updated)
            await self._call(check_fits(conn, updated), "checking worker capacity")
            await self._call(conn.execute(
                "UPDATE models SET revision = $2, compute_config = $3, placement = $4, "
                "updated_at = now() WHERE name = $1",
                model, updated.revision, updated.compute_config.model_dump(),
                updated.placement.model_dump(),
            ), "updating the model")
            await self._sync_adapters(conn, model, current, updated)
        await self._publish(updated)
        return updated

    async def _sync_adapters(self, conn: asyncpg.Connection, model: str,
                             before: ModelDeployment, after: ModelDeployment) -> None:
        old = {a.name for a in before.adapters}
        new = {a.name: a for a in after.adapters}
        for name in old - set(new):
            await self._call(conn.execute(
                "DELETE FROM adapters WHERE model = $1 AND name = $2", model, name
            ), "removing an adapter")
        for name in set(new) - old:
            await self._call(conn.execute(
                "INSERT INTO adapters (model, name, path) VALUES ($1, $2, $3)",
                model, name, new[name].path,
            ), "registering an adapter")

    async def _load(self, conn: asyncpg.Connection, model: str,
                    lock: bool = False) -> ModelDeployment:
        query = "SELECT * FROM models WHERE name = $1" + (" FOR UPDATE" if lock else "")
        row = await self._call(conn.fetchrow(query, model), "reading the model")
        if row is None:
            raise NotFoundError(
                f"model {model!r} is not registered; register it with "
                f"`sluice models register --model {model} --path DIR`"
            )
        adapters = await self._call(conn.fetch(
            "SELECT name, path FROM adapters WHERE model = $1 ORDER BY created_at, name", model
        ), "reading adapters")
        return ModelDeployment(
            model=row["name"], revision=row["revision"], path=row["path"],
            compute_config=ComputeConfig.model_validate(row["compute_config"]),
            placement=Placement.model_validate(row["placement"]),
            adapters=[AdapterSpec(name=a["name"], path=a["path"]) for a in adapters],
        )

    async def _publish(self, deployment: ModelDeployment) -> None:
        await dependency_call(
            "publishing to the control topic",
            self._producer.send_and_wait(self.settings.topic("control"), encode(deployment),
                                         key=deployment.model.encode()),
            self.settings.client.timeout_secs,
        )

    def _validate(self, deployment: ModelDeployment) -> None:
        if self._validator is not None:
            self._validator(deployment)

    async def _call(self, awaitable: Any, what: str) -> Any:
        return await dependency_call(f"PostgreSQL ({what})", awaitable,
                                     self.settings.client.timeout_secs)

    @staticmethod
    def _parse(model: type[pydantic.BaseModel], data: dict[str, Any]) -> Any:
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as exc:
            raise InvalidConfigError(
                f"invalid {model.__name__}: {_validation_message(exc)}"
            ) from None

    @staticmethod
    def _key_id(key: str) -> str:
        try:
            return api_keys.key_id_of(key)
        except ValueError as exc:
            raise InvalidConfigError(str(exc)) from None
