"""Whether a model has a worker that serves it now, from the workers' heartbeats; and
when each model was registered.

A worker records its status at every change and every few seconds
(`worker.heartbeat`); one seen within READY_WINDOW_S (three beats) whose status
is `serving...` answers requests. The gateway's `/ready` and the `ready` field of
its `/v1/models` entries come from here.
"""

from __future__ import annotations

import asyncpg

READY_WINDOW_S = 15.0


async def serving_workers(pool: asyncpg.Pool) -> dict[str, int]:
    """Per model, its live workers that serve now (models without one are left out)."""
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT model, count(*) AS n FROM workers WHERE status LIKE 'serving%' "
            "AND last_seen > now() - make_interval(secs => $1) GROUP BY model",
            READY_WINDOW_S)
    return {row["model"]: row["n"] for row in rows}


async def registered_at(pool: asyncpg.Pool) -> dict[str, int]:
    """Per registered model, when it was registered (Unix seconds: OpenAI's `created`)."""
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT name, extract(epoch FROM created_at)::bigint AS created FROM models")
    return {row["name"]: row["created"] for row in rows}
