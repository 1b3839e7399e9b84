"""The worker's heartbeat: where it runs, what it is doing, how much memory a model may use.

Recorded in PostgreSQL's `workers` table every few seconds, and at once when its
status changes, for as long as the worker runs; the control plane reads it
(`sluice.capacity`) to refuse a compute config a live worker could not hold,
`sluice workers` lists it, and the gateway's `/ready` asks it whether a model
has a live worker that serves. Statuses: `warming` (connecting, loading the
model), `serving` (answering with eager steps), `serving (compiling)` (eager
while the compiled step is built behind), `serving (compiled)`, `idle` (its
pool is not in the model's placement), `stopping`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import asyncpg

from common.db import DATABASE_AWAY, bounded_connection
from common.timeouts import within

log = logging.getLogger(__name__)

SERVING_PREFIX = "serving"
# A beat that takes longer gives up (its connection terminated) and the next tries anew.
BEAT_TRY_S = 5.0


async def record_worker(conn: asyncpg.Connection, *, instance_id: str, model: str, pool: str,
                        device: str, device_memory_bytes: int, status: str = "serving",
                        process: str = "", native_bf16: bool = False) -> None:
    await conn.execute(
        "INSERT INTO workers (instance_id, model, pool, device, device_memory_bytes, status, "
        "process, native_bf16) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) "
        "ON CONFLICT (instance_id) DO UPDATE SET model = $2, pool = $3, device = $4, "
        "device_memory_bytes = $5, status = $6, process = $7, native_bf16 = $8, "
        "last_seen = now()",
        instance_id, model, pool, device, device_memory_bytes, status, process, native_bf16,
    )


def _native_bf16() -> bool:
    from gpu_runtime.loader import cpu_has_native_bf16  # torch: only a worker pays for it

    return cpu_has_native_bf16()


class Heartbeat:
    def __init__(self, pool: asyncpg.Pool, *, instance_id: str, model: str, pool_name: str,
                 device: str, every_s: float = 5.0):
        self._pool = pool
        self._row = {"instance_id": instance_id, "model": model, "pool": pool_name,
                     "device": device, "process": f"{socket.gethostname()} pid {os.getpid()}",
                     "native_bf16": device == "cpu" and _native_bf16()}
        self._every_s = every_s
        self.status = "warming"
        self.device_memory_bytes = 0
        self._changed = asyncio.Event()

    def set_status(self, status: str) -> None:
        """Record `status` at once (not at the next beat)."""
        if status != self.status:
            self.status = status
            self._changed.set()

    async def run(self) -> None:
        """Record this worker every few seconds, and on each status change."""
        while True:
            self._changed.clear()
            await self.beat()
            with contextlib.suppress(TimeoutError):
                await within(self._every_s, self._changed.wait())

    async def beat(self) -> None:
        try:
            async with bounded_connection(self._pool, BEAT_TRY_S) as conn:
                await record_worker(conn, **self._row, status=self.status,  # type: ignore[arg-type]
                                    device_memory_bytes=self.device_memory_bytes)
        except DATABASE_AWAY as exc:
            log.warning("heartbeat to PostgreSQL failed: %s", exc)
