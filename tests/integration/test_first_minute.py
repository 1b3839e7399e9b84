"""The first minute of a deployment: nobody waits longer than the model's max_ttft_ms.

Without a live worker a request ends at the model's max_ttft_ms plus a grace, with
a RequestTimeoutError that says no worker started it (streamed or not), instead of
at the client's own timeout. A request a worker started is waited for past that,
however long its answer takes: a non-streamed one sends nothing until it is done.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import sluice
from gpu_runtime import Runtime, StepOutput, StepPlan
from schemas import DoneEvent
from sluice.errors import RequestTimeoutError
from sluice.placements import GRACE_S
from tests.integration.pipeline_helpers import drop_schema
from worker.worker import Worker, WorkerOptions

pytestmark = [pytest.mark.integration]

MAX_TTFT_MS = 1500


class SlowRuntime(Runtime):
    """The real runtime, each step slowed: a 12-token answer takes well over 3 s."""

    def execute(self, plan: StepPlan) -> StepOutput:
        time.sleep(0.3)
        return super().execute(plan)


def _setup(settings, tiny_model) -> tuple[sluice.Client, str]:
    client = sluice.Client(settings)
    client.models.register(model="tiny", path=str(tiny_model),
                           compute_config={"kv_cache_len": 4096},
                           placement={"max_ttft_ms": MAX_TTFT_MS})
    key = client.keys.create(tenant="acme")
    client.keys.grant(key, model="tiny")
    return client, key


async def test_without_a_worker_a_request_ends_at_max_ttft(settings, tiny_model) -> None:
    client, key = _setup(settings, tiny_model)
    try:
        for stream in (False, True):
            started = time.monotonic()
            with pytest.raises(RequestTimeoutError) as caught:
                async for _event in client.stream(model="tiny", api_key=key, stream=stream,
                                                  prompt_token_ids=[1, 2], timeout=120):
                    pass
            waited = time.monotonic() - started
            assert MAX_TTFT_MS / 1000 + GRACE_S <= waited < MAX_TTFT_MS / 1000 + GRACE_S + 5
            error = caught.value
            assert error.not_started and error.max_ttft_ms == MAX_TTFT_MS
            assert "no worker started it" in str(error)
            assert "sluice workers --model tiny" in str(error)
    finally:
        await client.aclose()
        await drop_schema(settings)


async def test_a_started_request_is_waited_for_past_max_ttft(settings, tiny_model) -> None:
    client, key = _setup(settings, tiny_model)
    worker = Worker(settings, WorkerOptions(model="tiny", instance_id="slow-0"),
                    runtime_factory=SlowRuntime)
    task = asyncio.create_task(worker.run())
    try:
        started = time.monotonic()
        done = await asyncio.wait_for(client.complete(
            model="tiny", api_key=key, prompt_token_ids=[3, 4, 5], max_tokens=14,
            timeout=120), 120)
        assert isinstance(done, DoneEvent) and len(done.token_ids) == 14
        assert time.monotonic() - started > MAX_TTFT_MS / 1000 + GRACE_S  # waited past it
    finally:
        worker.stop()
        await asyncio.wait_for(task, 60)
        await client.aclose()
        await drop_schema(settings)
