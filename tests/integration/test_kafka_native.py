"""What only a log-based engine can do: durable cancellation, exactly-once answers.

On the real broker: a cancel record stops a running request (its `done` says
"cancelled" and carries the tokens so far), answers a queued one without
running it, and is ignored for a finished request or from another tenant; the
SDK cancels a stream closed early. In exactly-once mode a worker SIGKILLed
mid-load and restarted leaves a `read_committed` reader of the reply topic
exactly one terminal event per request.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import pytest

from gpu_runtime import Runtime, StepOutput, StepPlan
from gpu_runtime.tiny import make_tiny_model
from schemas import DoneEvent, TokenEvent
from tests.integration.pipeline_helpers import (
    drop_schema,
    register_tiny,
    terminal_events,
    worker_process,
)
from worker.worker import Worker, WorkerOptions

pytestmark = [pytest.mark.integration]

class GatedRuntime(Runtime):
    """The real runtime, each step held until `gate` is open and slowed by `delay_s`,
    so a test can keep a request running (or queued) while its cancel arrives."""

    gate = threading.Event()
    delay_s = 0.05

    def execute(self, plan: StepPlan) -> StepOutput:
        type(self).gate.wait(30)
        time.sleep(type(self).delay_s)
        return super().execute(plan)


async def test_cancel_running_queued_finished_and_foreign(settings, tmp_path) -> None:
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"),
                                compute_config={"kv_cache_len": 4096})
    other = client.keys.create(tenant="globex")
    client.keys.grant(other, model="tiny")
    GatedRuntime.gate.set()
    worker = Worker(settings, WorkerOptions(model="tiny", instance_id="cancel-0"),
                    runtime_factory=lambda path, cfg: GatedRuntime(path, cfg))
    task = asyncio.create_task(worker.run())
    long = {"api_key": key, "max_tokens": 400, "temperature": 0.0}
    try:
        warm = await asyncio.wait_for(client.complete(
            model="tiny", prompt_token_ids=[5, 6, 7], max_tokens=2, api_key=key), 120)
        assert warm.finish_reason in ("stop", "length")

        # Running: cancelled after a few tokens, by a cancel record (the SDK's `cancel`).
        events: list[object] = []
        async for event in client.stream(model="tiny", request_id="run-1", session_id="s-1",
                                         prompt_token_ids=[11, 12, 13], **long):
            events.append(event)
            if len(events) == 3:
                await client.cancel(model="tiny", request_id="run-1", session_id="s-1",
                                    api_key=key)
        done = events[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled", done
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert 3 <= done.usage.completion_tokens < 400
        assert "".join(t.text for t in tokens) == done.text

        # Queued: held behind a step that cannot finish, cancelled before it runs.
        GatedRuntime.gate.clear()
        running = asyncio.create_task(client.complete(
            model="tiny", request_id="busy-1", prompt_token_ids=[21, 22], **long))
        await asyncio.sleep(0.5)
        queued = asyncio.create_task(client.complete(
            model="tiny", request_id="queued-1", prompt_token_ids=[31, 32], **long))
        await _until(lambda: _held(worker, "queued-1"))
        await client.cancel(model="tiny", request_id="queued-1", api_key=key)
        await _until(lambda: _cancel_requested(worker, "queued-1"))
        GatedRuntime.gate.set()
        answer = await asyncio.wait_for(queued, 60)
        assert answer.finish_reason == "cancelled" and answer.usage.completion_tokens == 0
        assert answer.text == ""

        # Another tenant's cancel is refused: the request runs to its end.
        foreign = asyncio.create_task(client.complete(
            model="tiny", request_id="foreign-1", prompt_token_ids=[41, 42],
            api_key=key, max_tokens=40))
        await _until(lambda: _held(worker, "foreign-1"))
        await client.cancel(model="tiny", request_id="foreign-1", api_key=other)
        assert (await asyncio.wait_for(foreign, 60)).finish_reason != "cancelled"
        await client.cancel(model="tiny", request_id="busy-1", api_key=key)
        assert (await asyncio.wait_for(running, 60)).finish_reason == "cancelled"

        # Finished: a late cancel changes nothing and writes nothing.
        await client.cancel(model="tiny", request_id="foreign-1", api_key=key)
        await _until(lambda: _cancel_count(worker, "ignored") >= 1)
        ids = {"run-1", "queued-1", "busy-1", "foreign-1"}
        counts = await terminal_events(settings, settings.topic("results"), ids)
        assert counts == dict.fromkeys(ids, 1), counts
        assert _cancel_count(worker, "refused") == 1
        assert _cancel_count(worker, "cancelled") == 3

        # A stream closed early cancels its request: the worker ends it "cancelled".
        stream = client.stream(model="tiny", request_id="closed-1",
                               prompt_token_ids=[51, 52], **long)
        async for _event in stream:
            break
        await stream.aclose()
        counts = await terminal_events(settings, settings.topic("results"), {"closed-1"})
        assert counts == {"closed-1": 1}
        await _until(lambda: _cancel_count(worker, "cancelled") == 4)
        assert not task.done() and worker.fatal is None
    finally:
        GatedRuntime.gate.set()
        worker.stop()
        await task
        await client.aclose()
        await drop_schema(settings)


async def test_exactly_once_across_a_sigkilled_worker(settings, tmp_path: Path) -> None:
    """A worker in exactly-once mode is SIGKILLed mid-load and restarted under the same
    replica id: every request is answered, and a `read_committed` reader of the reply
    topic sees one terminal event per request — none from the killed attempt's open
    transaction."""
    client, key = register_tiny(settings, make_tiny_model(tmp_path / "tiny"), compute_config={
        "kv_cache_len": 8192, "delivery": "exactly_once"})
    num = 120
    ids = {f"eo-{i}" for i in range(num)}
    try:
        with worker_process(settings, "tiny", tmp_path) as first:
            first.wait_for_log("delivery: exactly once", 120)
            sends = [asyncio.create_task(client.complete(
                model="tiny", request_id=f"eo-{i}", session_id=f"s-{i % 8}", api_key=key,
                prompt_token_ids=[3 + i % 50, 4, 5], max_tokens=64 + i % 32, timeout=240))
                for i in range(num)]
            await _until(lambda: sum(t.done() for t in sends) >= 5, 120)
            first.kill(signal.SIGKILL)
            answered_before = sum(t.done() for t in sends)
            assert answered_before < num, "the load ended before the kill"
            with worker_process(settings, "tiny", tmp_path) as second:
                answers = await asyncio.wait_for(asyncio.gather(*sends), 240)
                assert {a.request_id for a in answers} == ids, second.log()
                counts = await terminal_events(settings, settings.topic("results"), ids,
                                               settle_s=2.0)
                assert counts == dict.fromkeys(ids, 1), (counts, second.log())
                assert "transactional id" in second.log()
    finally:
        await client.aclose()
        await drop_schema(settings)


def _held(worker: Worker, request_id: str) -> bool:
    return any(ctx.request.request_id == request_id for _key, ctx in worker.held.items())


def _cancel_requested(worker: Worker, request_id: str) -> bool:
    assert worker.engine is not None
    return any(state.cancel_requested for key, state in worker.engine.scheduler._states.items()
               if key.startswith(f"{request_id}#"))


def _cancel_count(worker: Worker, outcome: str) -> float:
    value = worker.metrics.registry.get_sample_value(
        "sluice_cancels_total", {"model": "tiny", "pool": worker.settings.pool,
                                 "outcome": outcome})
    return value or 0.0


async def _until(condition, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)
