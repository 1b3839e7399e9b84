"""Where the gateway keeps responses (`store: true`, OpenAI's default): PostgreSQL.

A stored response is what `GET /v1/responses/{id}` returns and what
`previous_response_id` continues: its conversation (the messages and the answer)
and its session key, so the next turn lands on the partition — and the worker —
holding the conversation's KV cache. Responses are the tenant's: another tenant's
key finds none. They expire after RETENTION_DAYS (OpenAI keeps them 30 days);
expired rows are deleted at every EXPIRE_EVERY_S. `store: false` stores nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg

RETENTION_DAYS = 30
EXPIRE_EVERY_S = 3600.0


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    session_key: str
    model: str


class ResponseStore:
    def __init__(self, pool: asyncpg.Pool):
        self._pool = pool

    async def put(self, *, response_id: str, tenant: str, model: str, session_key: str,
                  response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        async with self._pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO responses (id, tenant, model, session_key, expires_at, response, "
                "conversation) VALUES ($1, $2, $3, $4, now() + make_interval(days => $5), $6, "
                "$7)", response_id, tenant, model, session_key, RETENTION_DAYS, response,
                conversation)

    async def get(self, response_id: str, tenant: str) -> Stored | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT response, conversation, session_key, model FROM responses "
                "WHERE id = $1 AND tenant = $2 AND expires_at > now()", response_id, tenant)
        if row is None:
            return None
        return Stored(row["response"], row["conversation"], row["session_key"], row["model"])

    async def delete(self, response_id: str, tenant: str) -> bool:
        async with self._pool.acquire() as conn:
            done = await conn.execute("DELETE FROM responses WHERE id = $1 AND tenant = $2",
                                      response_id, tenant)
        return done.endswith(" 1")

    async def expire(self) -> int:
        async with self._pool.acquire() as conn:
            done = await conn.execute("DELETE FROM responses WHERE expires_at <= now()")
        return int(done.split()[-1])
