"""The worker's heartbeat: where it runs and how much device memory a model may use.

Recorded in PostgreSQL's `workers` table every few seconds, for as long as the
worker runs; the control plane reads it (`sluice.capacity`) to refuse a
compute config a live worker could not hold, and `sluice workers` lists it.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

log = logging.getLogger(__name__)


async def record_worker(conn: asyncpg.Connection, *, instance_id: str, model: str, pool: str,
                        device: str, device_memory_bytes: int) -> None:
    await conn.execute(
        "INSERT INTO workers (instance_id, model, pool, device, device_memory_bytes) "
        "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (instance_id) DO UPDATE SET "
        "model = $2, pool = $3, device = $4, device_memory_bytes = $5, last_seen = now()",
        instance_id, model, pool, device, device_memory_bytes,
    )


async def heartbeat(pool: asyncpg.Pool, *, instance_id: str, model: str, pool_name: str,
                    device: str, device_memory_bytes: int, every_s: float = 5.0) -> None:
    """Record this worker every few seconds, for as long as it runs."""
    while True:
        try:
            async with pool.acquire() as conn:
                await record_worker(conn, instance_id=instance_id, model=model, pool=pool_name,
                                    device=device, device_memory_bytes=device_memory_bytes)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.warning("heartbeat to PostgreSQL failed: %s", exc)
        await asyncio.sleep(every_s)
