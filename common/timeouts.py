"""The two control-plane timeouts of CONTRACT.md, as context managers with clear errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from common.errors import DependencyTimeoutError, OperationTimeoutError

T = TypeVar("T")


async def dependency_call(what: str, awaitable: Awaitable[T], timeout_s: float) -> T:
    """Bound one call to PostgreSQL or the Kafka admin API by SLUICE_CLIENT__TIMEOUT_SECS."""
    try:
        async with asyncio.timeout(timeout_s):
            return await awaitable
    except TimeoutError as exc:
        raise DependencyTimeoutError(
            f"{what} did not answer within SLUICE_CLIENT__TIMEOUT_SECS={timeout_s:g} s"
        ) from exc


async def operation(what: str, awaitable: Awaitable[T], timeout_s: float) -> T:
    """Bound a whole control-plane operation by SLUICE_SERVER__TIMEOUT_SECONDS."""
    try:
        async with asyncio.timeout(timeout_s):
            return await awaitable
    except DependencyTimeoutError:
        raise
    except TimeoutError as exc:
        raise OperationTimeoutError(
            f"control-plane operation {what!r} did not finish within "
            f"SLUICE_SERVER__TIMEOUT_SECONDS={timeout_s:g} s"
        ) from exc
