"""PostgreSQL access for the control plane and workers: a pool and versioned migrations.

Migrations are an ordered list of SQL scripts; each runs once, in a
transaction, under an advisory lock so concurrent starters do not race.
Every statement elsewhere is parameterised ($1, $2, ...); identifiers that
cannot be parameters (the schema name) are validated by Settings' pattern.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import orjson

from common.errors import DatabaseAccessError, DependencyTimeoutError
from common.settings import Settings
from common.timeouts import dependency_call

MIGRATIONS: list[str] = [
    # 1: the registry, keys and grants.
    """
    CREATE TABLE models (
        name text PRIMARY KEY,
        path text NOT NULL,
        revision bigint NOT NULL DEFAULT 0,
        compute_config jsonb NOT NULL,
        placement jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        updated_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE adapters (
        model text NOT NULL REFERENCES models(name) ON DELETE CASCADE,
        name text NOT NULL,
        path text NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (model, name)
    );
    CREATE TABLE api_keys (
        key_id text PRIMARY KEY,
        tenant text NOT NULL,
        salt bytea NOT NULL,
        secret_hash bytea NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        revoked_at timestamptz
    );
    CREATE TABLE grants (
        key_id text NOT NULL REFERENCES api_keys(key_id) ON DELETE CASCADE,
        model text NOT NULL,
        adapter text NOT NULL DEFAULT '',
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (key_id, model, adapter)
    );
    """,
    # 2: workers report where they run and how much device memory they have, so
    # the control plane can refuse a compute config that would not fit.
    """
    CREATE TABLE workers (
        instance_id text PRIMARY KEY,
        model text NOT NULL,
        pool text NOT NULL,
        device text NOT NULL,
        device_memory_bytes bigint NOT NULL,
        started_at timestamptz NOT NULL DEFAULT now(),
        last_seen timestamptz NOT NULL DEFAULT now()
    );
    """,
    # 3: a tenant's keys may be bound to a reply-topic prefix (see infra/helm ACL notes).
    """
    ALTER TABLE api_keys ADD COLUMN reply_topic_prefix text;
    """,
    # 4: what a worker is doing (warming, serving, ...) and which process it is.
    """
    ALTER TABLE workers ADD COLUMN status text NOT NULL DEFAULT 'unknown';
    ALTER TABLE workers ADD COLUMN process text NOT NULL DEFAULT '';
    """,
    # 5: the gateway's stored responses (Responses API: GET and previous_response_id).
    """
    CREATE TABLE responses (
        id text PRIMARY KEY,
        tenant text NOT NULL,
        model text NOT NULL,
        session_key text NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        expires_at timestamptz NOT NULL,
        response jsonb NOT NULL,
        conversation jsonb NOT NULL
    );
    CREATE INDEX responses_expiry ON responses (expires_at);
    """,
    # 6: whether a CPU worker multiplies bf16 natively: `dtype: auto` serves bfloat16
    # there for a bf16 checkpoint (gpu_runtime.loader.default_dtype), so the capacity
    # check plans with the dtype that worker picks.
    """
    ALTER TABLE workers ADD COLUMN native_bf16 boolean NOT NULL DEFAULT false;
    """,
]

_LOCK_ID = 0x51CE

# What a call to a database that is away, restarting or unreachable raises. A session
# the server ended (a restart) leaves its connection refusing every query with
# InternalClientError ("cannot switch to state ...; another operation is in
# progress") until it is closed: routine too, never a reason to stop a worker.
DATABASE_AWAY: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
    asyncpg.InternalClientError)


@contextlib.asynccontextmanager
async def bounded_connection(pool: asyncpg.Pool, timeout_s: float) -> AsyncIterator[Any]:
    """A pool connection whose acquisition and use each end within `timeout_s`
    (TimeoutError past it). A connection whose query was cut short is terminated, not
    handed back: asyncpg's release first waits, with no bound, for the server to confirm
    the query's cancellation, and through a cut network (or one that drops packets) no
    confirmation comes, so the caller would hang until the connection died of itself."""
    conn = await pool.acquire(timeout=timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            yield conn
    except (TimeoutError, asyncio.CancelledError):
        conn.terminate()
        raise
    finally:
        await pool.release(conn)


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=lambda v: orjson.dumps(v).decode(), decoder=orjson.loads,
        schema="pg_catalog",
    )


async def create_pool(settings: Settings, *, min_size: int = 1, max_size: int = 5) -> asyncpg.Pool:
    timeout = settings.client.timeout_secs
    dsn = settings.database_dsn()
    try:
        pool = await dependency_call(
            "connecting to PostgreSQL",
            asyncpg.create_pool(
                dsn, min_size=min_size, max_size=max_size,
                command_timeout=timeout, timeout=timeout, init=_init_connection,
                server_settings={"search_path": settings.db_schema, "application_name": "sluice"},
            ),
            timeout,
        )
    except DependencyTimeoutError:
        raise
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise DatabaseAccessError(connection_problem(exc, dsn)) from None
    await dependency_call("migrating the database", migrate(pool, settings.db_schema), timeout)
    return pool


async def migrate(pool: asyncpg.Pool, schema: str) -> int:
    """Apply pending migrations; returns the schema version now in place."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_ID)
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".schema_migrations ('
            "version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        current = await conn.fetchval(
            f'SELECT coalesce(max(version), 0) FROM "{schema}".schema_migrations'
        )
        for version, script in enumerate(MIGRATIONS, start=1):
            if version <= current:
                continue
            await conn.execute(f'SET LOCAL search_path TO "{schema}"')
            await conn.execute(script)
            await conn.execute(
                f'INSERT INTO "{schema}".schema_migrations (version) VALUES ($1)', version
            )
        return len(MIGRATIONS)


def connection_problem(exc: BaseException, dsn: str) -> str:
    """Why PostgreSQL could not be used, in one line naming what to fix; never the
    password (only host, port and user are named)."""
    parts = urlsplit(dsn)
    where = f"PostgreSQL at {parts.hostname}:{parts.port or 5432}"
    user = parts.username or "(default user)"
    ca_hint = "set sslrootcert= in SLUICE_DATABASE_URL or SLUICE_DATABASE__SSL_CAFILE"
    if isinstance(exc, asyncpg.InvalidPasswordError):
        return (f"{where} refused the password of user {user!r}: check the user and password "
                "in SLUICE_DATABASE_URL")
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        if "no encryption" in str(exc):
            return (f"{where} accepts only TLS connections: add ?sslmode=verify-full to "
                    f"SLUICE_DATABASE_URL ({ca_hint})")
        return f"{where} refused user {user!r}: {exc}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"{where} presented a certificate this client does not trust "
                f"({exc.verify_message}): {ca_hint} to the CA that signed it")
    if isinstance(exc, asyncpg.ClientConfigurationError):
        return f"{where}: the TLS settings of SLUICE_DATABASE_URL are incomplete ({exc}); {ca_hint}"
    if isinstance(exc, ConnectionError | TimeoutError) or (
            isinstance(exc, OSError) and exc.errno is not None):
        return (f"{where} cannot be reached ({exc.strerror or type(exc).__name__}): check "
                "SLUICE_DATABASE_URL and that the server runs (`sluice infra up` for the local "
                "one)")
    return f"{where} could not be used: {type(exc).__name__}: {exc}"


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel on which key and grant changes are announced."""
    return f"sluice_auth_{schema}"
