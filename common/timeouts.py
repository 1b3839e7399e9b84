"""The two control-plane timeouts of CONTRACT.md, as context managers with clear errors;
and `within`, the bounded wait every loop here uses instead of `asyncio.wait_for`."""

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


async def within(timeout_s: float, awaitable: Awaitable[T]) -> T:
    """`await awaitable`, TimeoutError after `timeout_s`. Python 3.11's `asyncio.wait_for`
    loses a cancellation of its caller when the awaited work completes at that moment (the
    task then runs on, and whoever awaits its cancellation waits forever); a timeout
    scope never does."""
    async with asyncio.timeout(timeout_s):
        return await awaitable
