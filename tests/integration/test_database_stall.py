"""A link to PostgreSQL that stalls (a cut that drops packets: no reset, no answer) holds
a permission check for at most one try, and the check answers again within a try of the
link coming back. Before, a lookup waited on its hung connection until TCP gave it up
(12-18 s in the fault runs), and handing back a connection whose query was cancelled
waited, with no bound, for the server to confirm the cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.db import create_pool, notify_channel
from common.timeouts import within
from ingest.permissions import TRY_S, PermissionChecker, PermissionsUnavailable
from sluice.control_plane import ControlPlane
from tests.integration.pipeline_helpers import drop_schema
from tests.integration.stalling_proxy import StallingProxy

pytestmark = pytest.mark.integration


async def _until(predicate, timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_a_stalled_database_link_holds_a_permission_check_for_one_try(
        settings, tiny_model) -> None:
    cp = await ControlPlane.connect(settings)
    proxy = StallingProxy.for_url(str(settings.database_url))
    await proxy.start()
    through = settings.model_copy(
        update={"database_url": proxy.url_through(str(settings.database_url))})
    pool = await create_pool(through)
    # The callers' own budget is long (a minute): only the per-try bound may end a try.
    checker = PermissionChecker(pool, notify_channel(settings.db_schema), call_timeout_s=60)
    checker.start()
    try:
        await cp.register_model("tiny", str(tiny_model))
        first, second = await cp.create_key("acme"), await cp.create_key("acme")
        for key in (first, second):
            await cp.grant(key, "tiny")
        assert (await checker.check(f"Bearer {first}", "tiny", None)).allowed
        await _until(lambda: checker._listening, 10)

        proxy.stall()
        # The listener's probe notices within a try and stops caching.
        await _until(lambda: not checker._listening, TRY_S + 3)
        # A key never looked up: its lookup hangs on the stalled link, for one try.
        started = time.monotonic()
        with pytest.raises(PermissionsUnavailable):
            await within(TRY_S + 5, checker.check(f"Bearer {second}", "tiny", None))
        assert time.monotonic() - started < TRY_S + 2

        proxy.flow()
        healed = time.monotonic()
        while True:
            try:
                decision = await within(TRY_S + 5, checker.check(f"Bearer {second}", "tiny", None))
                break
            except PermissionsUnavailable:
                assert time.monotonic() - healed < 2 * TRY_S + 2
                await asyncio.sleep(0.5)
        assert decision.allowed
        assert time.monotonic() - healed < 2 * TRY_S + 2
        # The listener comes back too, so answers are cached again.
        await _until(lambda: checker._listening, 3 * TRY_S + 5)
    finally:
        proxy.flow()
        await checker.close()
        await within(10, pool.close())
        await proxy.close()
        await cp.close()
    await drop_schema(settings)
