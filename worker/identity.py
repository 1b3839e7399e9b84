"""One live worker per group member id: a PostgreSQL advisory lock per replica.

A replica's static group member id (`<pool>-<host>-<replica>`) keeps its
partitions — and their KV caches — with it across restarts. Two live processes
with one id would fence each other in the consumer group about once a second
and both serve the same records, so a worker takes a session-level advisory
lock named after (schema, group, member id) on a connection of its own before
it joins the group, and holds it for as long as it runs. PostgreSQL releases
the lock the moment that connection ends — the process exits or is killed — so
a restarted replica takes it back at once, while a second live one is refused
with a line that names `--replica` and the holder. A paused (SIGSTOPped)
holder still holds it: it is alive, and may wake. Server-side TCP keepalives
free the lock of a host that vanished within about half a minute.

Without `--replica` a worker takes the lowest free index, so the same command
run twice gives two replicas, and a restart usually finds its old index free.

If the lock's connection drops (a database restart) the worker keeps serving
and takes the lock again once the database is back. Finding it taken then by
another process means that process took this identity while the database was
away: `hold` raises `ReplicaTakenError` and the worker stops. A stale session of
this very process (its old connection not yet noticed as gone) is recognised by
its application name and ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from common.db import DATABASE_AWAY
from common.errors import SluiceError
from common.timeouts import within
from worker.options import WorkerOptions

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0
# Indexes tried when no --replica is given.
MAX_REPLICAS = 256
_KEEPALIVE = {"tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5",
              "tcp_keepalives_count": "3"}


class ReplicaTakenError(SluiceError):
    """Another live worker holds this replica's group member id."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a replica's lock, as PostgreSQL sees the session."""

    application_name: str
    client: str | None
    since: str

    def __str__(self) -> str:
        who = self.application_name.removeprefix("sluice-worker ") or "an unnamed session"
        where = f" from {self.client}" if self.client else ""
        return f"{who}{where}, since {self.since}"


def lock_key(schema: str, group_id: str, instance_id: str) -> int:
    """The advisory lock's signed 64-bit key (advisory locks span the database, so the
    schema is part of the name)."""
    digest = hashlib.sha256(f"sluice-replica\0{schema}\0{group_id}\0{instance_id}".encode())
    return int.from_bytes(digest.digest()[:8], "big", signed=True)


class ReplicaLock:
    def __init__(self, dsn: str, schema: str, group_id: str, timeout_s: float):
        self._dsn = dsn
        self._schema = schema
        self._group_id = group_id
        self._timeout_s = timeout_s
        # Names this process's sessions, so a stale one of ours is told from a rival's.
        self.session_name = (f"sluice-worker {socket.gethostname()} pid {os.getpid()} "
                             f"{int(time.time() * 1000):x}")[:63]
        self._conn: asyncpg.Connection | None = None
        self.instance_id: str | None = None
        self._key = 0

    async def take(self, instance_id: str) -> Holder | None:
        """Take `instance_id`'s lock; returns None, or who holds it (then nothing is held).
        Raises what connecting to PostgreSQL raises."""
        key = lock_key(self._schema, self._group_id, instance_id)
        conn = await self._connect()
        try:
            if await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):
                await self._release_held()
                self._conn, self._key, self.instance_id = conn, key, instance_id
                return None
            holder = await _holder(conn, key)
        except BaseException:
            await _close(conn)
            raise
        await _close(conn)
        return holder or Holder("a session that just ended", None, "now")

    async def take_first_free(self, instance_id_of: Callable[[int], str]) -> int:
        """The lowest replica index whose member id is free, taken; ReplicaTakenError
        when all MAX_REPLICAS are."""
        for index in range(MAX_REPLICAS):
            if await self.take(instance_id_of(index)) is None:
                return index
        raise ReplicaTakenError(f"all {MAX_REPLICAS} replica indexes of this host and pool "
                                "are held by live workers")

    async def hold(self) -> None:
        """Keep the lock for as long as the worker runs (see the module docstring)."""
        lost_at: float | None = None
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            if await self._alive():
                continue
            if lost_at is None:
                lost_at = time.monotonic()
                log.warning("lost the database connection that holds replica %s's lock; "
                            "serving on, and taking it again when the database is back",
                            self.instance_id)
            try:
                await self._retake()
            except DATABASE_AWAY as exc:  # still away: try again at the next check
                log.debug("taking replica %s's lock again failed: %s: %s", self.instance_id,
                          type(exc).__name__, exc)
                continue
            log.info("holding replica %s's lock again after %.1f s", self.instance_id,
                     time.monotonic() - lost_at)
            lost_at = None

    async def release(self) -> None:
        await self._release_held()

    # ---- helpers -------------------------------------------------------------------------

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(
            self._dsn, timeout=self._timeout_s, command_timeout=self._timeout_s,
            server_settings={"application_name": self.session_name, **_KEEPALIVE})

    async def _alive(self) -> bool:
        conn = self._conn
        if conn is None or conn.is_closed():
            return False
        try:
            await within(5, conn.fetchval("SELECT 1"))
        except DATABASE_AWAY:  # the session is gone, or unusable until closed
            await _close(conn)
            return False
        return True

    async def _retake(self) -> None:
        conn = await self._connect()
        try:
            for _ in range(3):
                if await conn.fetchval("SELECT pg_try_advisory_lock($1)", self._key):
                    self._conn = conn
                    return
                holder = await _holder(conn, self._key)
                if holder is None:  # its holder ended just now
                    continue
                if holder.application_name != self.session_name:
                    raise ReplicaTakenError(
                        f"replica {self.instance_id} was taken by another worker ({holder}) "
                        "while the database was away: two processes must not serve as one "
                        "replica, so this one stops")
                # Our own old session, not yet noticed as gone: end it and try again.
                await conn.execute(
                    "SELECT pg_terminate_backend(a.pid) FROM pg_locks l JOIN "
                    "pg_stat_activity a ON a.pid = l.pid WHERE " + _LOCK_WHERE
                    + " AND a.application_name = $3", *_lock_ids(self._key),
                    self.session_name)
                await asyncio.sleep(0.2)
            raise ReplicaTakenError(f"replica {self.instance_id}'s lock could not be taken back")
        except BaseException:
            await _close(conn)
            raise

    async def _release_held(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await _close(conn)  # a session's advisory locks end with it


_LOCK_WHERE = ("l.locktype = 'advisory' AND l.classid = $1::oid AND l.objid = $2::oid "
               "AND l.objsubid = 1 AND l.granted "
               "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())")


def _lock_ids(key: int) -> tuple[int, int]:
    """A bigint advisory key as pg_locks shows it: (classid, objid), high and low words."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


async def _holder(conn: asyncpg.Connection, key: int) -> Holder | None:
    row = await conn.fetchrow(
        "SELECT a.application_name, host(a.client_addr) AS client, "
        "to_char(a.backend_start, 'YYYY-MM-DD HH24:MI:SS TZ') AS since "
        "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE " + _LOCK_WHERE,
        *_lock_ids(key))
    if row is None:
        return None
    return Holder(row["application_name"] or "", row["client"], row["since"] or "?")


async def _close(conn: asyncpg.Connection) -> None:
    with contextlib.suppress(Exception):
        await within(5, conn.close())
    if not conn.is_closed():
        conn.terminate()


async def take_member_id(lock: ReplicaLock, model: str, options: WorkerOptions,
                         member_id: Callable[[int], str]) -> tuple[str, WorkerOptions]:
    """The group member id this worker runs as (held by `lock` from now on), and its
    options with the replica index it took; or ReplicaTakenError: two live workers
    with one id would both serve the same partitions."""
    instance_id = options.instance_id or (
        member_id(options.replica) if options.replica is not None else "")
    if not instance_id:
        replica = await lock.take_first_free(member_id)
        return member_id(replica), dataclasses.replace(options, replica=replica)
    holder = await lock.take(instance_id)
    if holder is not None:
        flag = "--instance-id" if options.instance_id else f"--replica {options.replica}"
        raise ReplicaTakenError(
            f"another live worker of model {model} already runs as {instance_id} "
            f"({holder}): two workers with one group member id would both answer the same "
            f"requests. Start this one with another {flag.split()[0]}"
            + ("" if options.instance_id else
               ", or without --replica to take the lowest free index"))
    return instance_id, options
