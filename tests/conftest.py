"""Shared fixtures: one real Kafka broker and one real PostgreSQL per test run.

They are started through the same code as `sluice infra up`, or reused when
`SLUICE_KAFKA_BOOTSTRAP` / `SLUICE_DATABASE_URL` point at running ones. Each
test gets unique topic names and its own database schema, so tests never see
each other's data.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True, slots=True)
class Endpoints:
    kafka_bootstrap: str
    database_url: str


@pytest.fixture(scope="session")
def endpoints() -> Iterator[Endpoints]:
    bootstrap = os.environ.get("SLUICE_KAFKA_BOOTSTRAP")
    url = os.environ.get("SLUICE_DATABASE_URL")
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
    """A free port below Linux's ephemeral range (32768 and up): a port in that range
    can be taken by any outgoing connection between this check and its use."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32000")


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
