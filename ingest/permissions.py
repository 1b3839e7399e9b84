"""The permission check on every request: API key → model (and adapter) grants.

Answers come from PostgreSQL through a short-lived cache so the check stays
off the hot path. The control plane NOTIFYs on every grant or revocation and
this cache LISTENs, dropping the key at once (well under a second). While the
LISTEN connection is down, nothing is cached, so a revocation can never be
missed. If the database cannot be reached, `check` raises
`PermissionsUnavailable`: the caller must wait, never serve unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field

import asyncpg

from common.db import DATABASE_AWAY, bounded_connection
from common.timeouts import within
from schemas import keys as api_keys

log = logging.getLogger(__name__)

# Each try at the database (a lookup, the listener's probe) ends within this; the caller
# tries again. A lookup takes milliseconds; a connection that a network cut left hanging
# would otherwise hold the request until TCP gave up on it.
TRY_S = 3.0


class PermissionsUnavailable(RuntimeError):
    """PostgreSQL could not answer; the request must wait, not be served."""


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str = ""
    key_id: str | None = None
    # When set, the key may only name reply topics that start with this prefix.
    reply_topic_prefix: str | None = None
    tenant: str | None = None  # the key's tenant: only it may cancel the request


@dataclass(slots=True)
class _Entry:
    key_id: str | None
    active: bool
    grants: frozenset[tuple[str, str]]
    expires: float
    reply_topic_prefix: str | None = None
    tenant: str | None = None


@dataclass(slots=True)
class PermissionChecker:
    pool: asyncpg.Pool
    channel: str  # where grant and revocation changes are announced (LISTEN/NOTIFY)
    ttl_s: float = 30.0
    call_timeout_s: float = 60.0
    _cache: dict[bytes, _Entry] = field(default_factory=dict)
    _listener: asyncpg.Connection | None = None
    _listen_task: asyncio.Task[None] | None = None
    _closed: bool = False
    num_lookups: int = 0

    def start(self) -> asyncio.Task[None]:
        """Start listening for grant changes; returns the task, for its owner to watch."""
        self._listen_task = asyncio.create_task(self._keep_listening(),
                                                name="permission listener")
        return self._listen_task

    async def close(self) -> None:
        self._closed = True
        if self._listen_task is not None:
            self._listen_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listen_task
        if self._listener is not None and not self._listener.is_closed():
            await self._listener.close()

    async def check(self, authorization: bytes | str | None, model: str,
                    adapter: str | None) -> Decision:
        key = api_keys.bearer_key(authorization)
        if key is None:
            return Decision(False, "missing or malformed `authorization: Bearer <key>` header")
        entry = await self._entry(key)
        if entry.key_id is None or not entry.active:
            return Decision(False, "unknown or revoked API key", entry.key_id)
        wanted = (model, adapter or "")
        if wanted not in entry.grants:
            what = f"adapter {adapter!r} of model {model!r}" if adapter else f"model {model!r}"
            return Decision(False, f"key {entry.key_id} is not granted {what}", entry.key_id)
        return Decision(True, key_id=entry.key_id, reply_topic_prefix=entry.reply_topic_prefix,
                        tenant=entry.tenant)

    async def tenant_of(self, authorization: bytes | str | None) -> str | None:
        """The tenant of a valid, unrevoked key (a cancel's sender), else None."""
        key = api_keys.bearer_key(authorization)
        if key is None:
            return None
        entry = await self._entry(key)
        return entry.tenant if entry.key_id is not None and entry.active else None

    async def _entry(self, key: str) -> _Entry:
        # Keyed by a digest, so raw keys are not kept in memory longer than needed.
        digest = hashlib.sha256(key.encode()).digest()
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached.expires > now:
            return cached
        entry = await self._lookup(key, now)
        if self._listening:
            self._cache[digest] = entry
        if len(self._cache) > 100_000:
            self._cache.clear()
        return entry

    @property
    def _listening(self) -> bool:
        return self._listener is not None and not self._listener.is_closed()

    async def _lookup(self, key: str, now: float) -> _Entry:
        self.num_lookups += 1
        parsed = api_keys.parse(key)
        if parsed is None:
            return _Entry(None, False, frozenset(), now + self.ttl_s)
        key_id, secret = parsed
        try:
            async with bounded_connection(self.pool, min(self.call_timeout_s, TRY_S)) as conn:
                row = await conn.fetchrow(
                    "SELECT salt, secret_hash, revoked_at, reply_topic_prefix, tenant "
                    "FROM api_keys "
                    "WHERE key_id = $1",
                    key_id,
                )
                grants = await conn.fetch(
                    "SELECT model, adapter FROM grants WHERE key_id = $1", key_id
                )
        except DATABASE_AWAY as exc:
            raise PermissionsUnavailable(f"permission database unavailable: {exc}") from exc
        if row is None or not api_keys.verify(row["salt"], row["secret_hash"], secret):
            return _Entry(None, False, frozenset(), now + self.ttl_s)
        return _Entry(
            key_id, row["revoked_at"] is None,
            frozenset((g["model"], g["adapter"]) for g in grants), now + self.ttl_s,
            row["reply_topic_prefix"], row["tenant"],
        )

    async def _let_go(self, conn: asyncpg.Connection) -> None:
        """Stop listening on `conn` and hand it back. One that does not answer in time is
        terminated instead (see `bounded_connection`: a cut network never confirms a
        cancelled query, and the pool would wait for that)."""
        try:
            await within(TRY_S, conn.remove_listener(self.channel, self._on_notify))
        except Exception:  # whatever went wrong, this connection is done
            conn.terminate()
        with contextlib.suppress(Exception):
            await self.pool.release(conn)

    def _on_notify(self, _conn: object, _pid: int, _channel: str, key_id: str) -> None:
        for digest in [d for d, e in self._cache.items() if e.key_id == key_id]:
            del self._cache[digest]

    async def _keep_listening(self) -> None:
        channel = self.channel
        while not self._closed:
            try:
                conn = await self.pool.acquire(timeout=TRY_S)
                try:
                    await within(TRY_S, conn.add_listener(channel, self._on_notify))
                    self._listener = conn
                    while not self._closed and not conn.is_closed():
                        # A cheap liveness probe: a dead connection must stop caching.
                        await within(TRY_S, conn.execute("SELECT 1"))
                        await asyncio.sleep(1.0)
                finally:
                    self._listener = None
                    self._cache.clear()
                    await self._let_go(conn)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep trying: the database may come back
                log.warning("permission listener lost its connection: %s", exc)
                await asyncio.sleep(1.0)
