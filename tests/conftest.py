"""Shared fixtures: one real Kafka broker and one real PostgreSQL per test run.

They are started through the same code as `sluice infra up`, or reused when
`SLUICE_KAFKA_BOOTSTRAP` / `SLUICE_DATABASE_URL` point at running ones. Each
test gets unique topic names and its own database schema, so tests never see
each other's data.

`SLUICE_TEST_KAFKA_SECURITY=sasl` (or `mtls`) runs the tests that use these
fixtures against the secure local broker (`sluice infra up --secure`: SASL_SSL
with SCRAM, or mutual TLS; PostgreSQL over TLS). The tests of security itself
start their own secure broker (`secure_endpoints`).

Workers started by the suite step eagerly (`SLUICE_COMPILE=0`): compiling the
decode step costs seconds at every worker start. The compiled step has its own
tests (`tests/parity/test_compiled_step.py`, a pipeline test that clears it).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("SLUICE_COMPILE", "0")


@dataclass(frozen=True, slots=True)
class Endpoints:
    kafka_bootstrap: str
    database_url: str
    # SLUICE_KAFKA__* of a secure broker (empty: plaintext).
    kafka_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """These endpoints as SLUICE_* environment variables."""
        return {"SLUICE_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
                "SLUICE_DATABASE_URL": self.database_url, **self.kafka_env}

    def kafka_settings(self) -> Any:
        from common.settings import KafkaSettings

        prefix = "SLUICE_KAFKA__"
        return KafkaSettings(**{name.removeprefix(prefix).lower(): value
                                for name, value in self.kafka_env.items()})


def secure_infra(cfg: Any, mtls: bool = False) -> Endpoints:
    """Start the secure local infrastructure of `cfg` and return a client's endpoints:
    SASL_SSL as `admin`, or mutual TLS with the client certificate."""
    import dataclasses

    from infra import local

    cfg = dataclasses.replace(cfg, secure=True)
    local.up(cfg)
    env = local.env(cfg, mtls)
    return Endpoints(env.pop("SLUICE_KAFKA_BOOTSTRAP"), env.pop("SLUICE_DATABASE_URL"), env)


@pytest.fixture(scope="session")
def endpoints() -> Iterator[Endpoints]:
    bootstrap = os.environ.get("SLUICE_KAFKA_BOOTSTRAP")
    url = os.environ.get("SLUICE_DATABASE_URL")
    security = os.environ.get("SLUICE_TEST_KAFKA_SECURITY", "")
    if security:
        from infra import local
        from infra.common import InfraConfig

        cfg = InfraConfig.from_env(secure=True)
        yield secure_infra(cfg, mtls=security == "mtls")
        if os.environ.get("SLUICE_TEST_KEEP_INFRA") != "1":
            local.down(cfg)
        return
    started: dict[str, bool] = {}
    if bootstrap is None or url is None:
        from infra import kafka_broker, postgres
        from infra.common import InfraConfig

        cfg = InfraConfig.from_env()
        if bootstrap is None:
            started["kafka"] = kafka_broker.running_pid(cfg) is None
            bootstrap = str(kafka_broker.up(cfg)["bootstrap"])
        if url is None:
            started["postgres"] = postgres.running_pid(cfg) is None
            url = str(postgres.up(cfg)["url"])
    yield Endpoints(bootstrap, url)
    # Leave running what was running before; stop what this run started,
    # unless asked to keep it for the next run (faster local iteration).
    if os.environ.get("SLUICE_TEST_KEEP_INFRA") != "1":
        from infra import kafka_broker, postgres
        from infra.common import InfraConfig

        cfg = InfraConfig.from_env()
        if started.get("kafka"):
            kafka_broker.down(cfg)
        if started.get("postgres"):
            postgres.down(cfg)


def free_port() -> int:
    """A free loopback port below Linux's ephemeral range (`infra.common.free_port`)."""
    from infra.common import free_port as free

    return free()


@pytest.fixture(scope="session")
def secure_cfg(endpoints: Endpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The InfraConfig of a running secure broker and database: the tests' own (private
    state, free ports, purged at the end), or the session's when it runs secure."""
    from infra import local
    from infra.common import InfraConfig

    if endpoints.kafka_env:
        yield InfraConfig.from_env(secure=True)
        return
    cfg = InfraConfig.from_env(
        state_dir=tmp_path_factory.mktemp("secure-infra"), kafka_port=free_port(),
        kafka_controller_port=free_port(), kafka_tls_port=free_port(),
        postgres_port=free_port(), secure=True)
    try:
        secure_infra(cfg)
        yield cfg
    finally:
        local.purge(cfg)


@pytest.fixture(scope="session")
def secure_endpoints(secure_cfg: Any) -> Endpoints:
    """A client of the secure broker over SASL_SSL (SCRAM-SHA-512, user admin)."""
    return secure_infra(secure_cfg)


@pytest.fixture(scope="session")
def secure_mtls_endpoints(secure_cfg: Any) -> Endpoints:
    """A client of the secure broker over mutual TLS (principal sluice-client)."""
    return secure_infra(secure_cfg, mtls=True)


def secure_state_dir(endpoints: Endpoints) -> Path:
    """The state directory of a secure broker's endpoints (its CA, certificates)."""
    return Path(endpoints.kafka_env["SLUICE_KAFKA__SSL_CAFILE"]).parent.parent


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short name unique to this test, usable in topic and schema names."""
    base = "".join(c if c.isalnum() else "_" for c in request.node.name)[:24].lower()
    return f"t_{base}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def pg_schema(endpoints: Endpoints, unique_name: str) -> AsyncIterator[str]:
    """A fresh PostgreSQL schema for this test, dropped afterwards."""
    import asyncpg

    conn = await asyncpg.connect(endpoints.database_url)
    try:
        await conn.execute(f'CREATE SCHEMA "{unique_name}"')
        yield unique_name
        await conn.execute(f'DROP SCHEMA "{unique_name}" CASCADE')
    finally:
        await conn.close()
