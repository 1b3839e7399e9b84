"""The chart's alert rules and dashboard against a real Prometheus, scraping a live
worker and a live gateway on the real broker and database.

One stack for the module: model `tiny` (and its adapter `a0`) served by a `sluice
worker` process, `sluice gateway` in this loop, and Prometheus (Debian's binary)
scraping both every second with the chart's rules (files/alerts.yaml) evaluated every
second. A workload of chats, completions and SDK requests runs first. Then, in this
file's order: nothing fires while all is well; every dashboard panel's query returns
data; each alert fires under its own fault — dead letters arriving (malformed
records), TTFT p99 over max_ttft (the model's max_ttft cut to 1 ms), consumer lag
growing (a second model whose worker's model step stalls, as a hung device's would,
while requests keep coming), a worker down (its process killed; last, as it ends the
stack's worker).

The rules are the chart's with one change: every `for:` is cut to 0s, so an alert fires
at the first evaluation that finds its condition instead of minutes later; every
expression is the chart's own, unchanged (checked below).

SLUICE_DASHBOARD_PNG=PATH also draws the dashboard's panels from this Prometheus's data
into PATH (the README's picture).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiokafka import AIOKafkaProducer

from common.settings import Settings
from gpu_runtime import Runtime, RuntimeConfig, StepOutput, StepPlan
from sluice.errors import RequestError, RequestTimeoutError
from tests.integration.pipeline_helpers import (
    WorkerProcess,
    drop_schema,
    served_gateway,
    tiny_with_adapter,
    worker_process,
)
from tests.integration.prometheus import Prometheus, finite
from worker.worker import Worker, WorkerOptions

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FILES = Path(__file__).resolve().parents[2] / "infra" / "helm" / "sluice" / "files"
WORKERS, GATEWAYS = "sluice-worker", "sluice-gateway"
# Dashboard variables, as Grafana would fill them: every model, and a window holding
# the whole test run (the workload comes first, the panels are queried later).
VARIABLES = {"$model": ".*", "$__rate_interval": "5m"}


def rules_for_tests() -> dict[str, Any]:
    """The chart's rules with every `for:` cut to 0s, and nothing else changed."""
    chart = yaml.safe_load((FILES / "alerts.yaml").read_text())
    rules = copy.deepcopy(chart)
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    strip = [{k: v for k, v in r.items() if k != "for"}
             for doc in (chart, rules) for g in doc["groups"] for r in g["rules"]]
    half = len(strip) // 2
    assert strip[:half] == strip[half:]
    return rules


@dataclass
class Stack:
    settings: Settings
    client: Any
    key: str
    api: Any  # an openai client of the gateway
    worker: WorkerProcess
    worker_target: str
    gateway_target: str
    prometheus: Prometheus
    workdir: Path
    model_dir: Path
    started_at: float


def metrics_port(worker: WorkerProcess) -> int:
    worker.wait_for_log("metrics on port")
    found = re.search(r"metrics on port (\d+)", worker.log_path.read_text())
    assert found, worker.log()
    return int(found.group(1))


async def workload(api: Any, client: Any, key: str) -> int:
    """Chats (two turns of three sessions, one on the adapter, some streamed) and a
    completion through the gateway; SDK requests; one refused key. Returns how many
    requests got a done event."""
    done = 0
    for session in range(3):
        model = "tiny:a0" if session == 2 else "tiny"
        messages = [{"role": "user", "content": f"Tell me about sluices, part {session}."}]
        for turn in range(2):
            if turn == 1 and session == 1:  # a streamed turn
                stream = await api.chat.completions.create(
                    model=model, messages=messages, max_completion_tokens=8, temperature=0,
                    stream=True, extra_headers={"x-session-id": f"s{session}"})
                text = "".join([c.choices[0].delta.content or "" async for c in stream
                                if c.choices])
            else:
                chat = await api.chat.completions.create(
                    model=model, messages=messages, max_completion_tokens=8, temperature=0,
                    extra_headers={"x-session-id": f"s{session}"})
                text = chat.choices[0].message.content or ""
            done += 1
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "And then?"}]
    completion = await api.completions.create(model="tiny", prompt="Gates", max_tokens=8)
    assert completion.choices[0].text is not None
    done += 1
    answers = await asyncio.gather(*(
        client.complete(model="tiny", api_key=key, prompt_token_ids=[5, 6, 7 + i],
                        max_tokens=16, ignore_eos=True) for i in range(8)))
    assert all(a.usage.completion_tokens == 16 for a in answers)
    done += len(answers)
    with pytest.raises(RequestError) as refused:
        await client.complete(model="tiny", api_key="sk-not-a-key", prompt="hi", max_tokens=2)
    assert refused.value.code == "unauthorized"
    return done


@pytest.fixture(scope="module")
async def stack(endpoints, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[Stack]:
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (infra/system-deps.sh installs Debian's)")
    name = f"t_alerts_{uuid.uuid4().hex[:8]}"
    settings = Settings(kafka_bootstrap=endpoints.kafka_bootstrap,
                        database_url=endpoints.database_url, db_schema=name, topic_prefix=name,
                        request_partitions=2, kafka=endpoints.kafka_settings())
    workdir = tmp_path_factory.mktemp("alerts")
    client, key = tiny_with_adapter(settings, tiny_model, workdir / "adapters")
    try:
        with worker_process(settings, "tiny", workdir) as worker, Prometheus.running(
                workdir / "prometheus", rules_for_tests(), [WORKERS, GATEWAYS]) as prometheus:
            async with served_gateway(settings, key, "alerts", timeout_s=120) as (api, port):
                target = f"127.0.0.1:{await asyncio.to_thread(metrics_port, worker)}"
                gateway = f"127.0.0.1:{port}"
                prometheus.set_targets(WORKERS, [target])
                prometheus.set_targets(GATEWAYS, [gateway])
                await asyncio.to_thread(worker.wait_for_log, "assigned partition")
                # Both scraped before the workload, so rates see it happen.
                await prometheus.wait_for(lambda: prometheus.scraped() == {
                    target: 1.0, gateway: 1.0}, "worker and gateway scraped")
                started_at = time.time()
                done = await workload(api, client, key)
                # Scraped since: every answer counted in Prometheus.
                await prometheus.wait_for(lambda: (prometheus.value(
                    'sum(sluice_requests_total{type="done", model="tiny"})') or 0) >= done,
                    f"{done} done events in Prometheus")
                yield Stack(settings, client, key, api, worker, target, gateway, prometheus,
                            workdir, tiny_model, started_at)
    finally:
        await client.aclose()
        await drop_schema(settings)


async def test_a_healthy_stack_fires_no_alert(stack: Stack) -> None:
    prom = stack.prometheus
    # Every rule evaluated after the workload was scraped, cleanly.
    after = time.time() + 1.5
    await prom.wait_for(lambda: all(
        rule["health"] == "ok" and _seconds(rule["lastEvaluation"]) > after
        for group in prom.api("rules")["groups"] for rule in group["rules"]),
        "every rule evaluated")
    assert prom.api("alerts")["alerts"] == []
    up = {s["metric"]["job"]: float(s["value"][1]) for s in prom.query("up")}
    assert up == {WORKERS: 1.0, GATEWAYS: 1.0}


async def test_every_dashboard_panel_returns_data(stack: Stack) -> None:
    prom = stack.prometheus
    board = json.loads((FILES / "dashboard.json").read_text())
    empty = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, (panel["title"], expr)
            result = await asyncio.to_thread(prom.query, expr)
            if not finite(result):
                empty.append(f"{panel['title']} [{target['refId']}]: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    # The model variable's values.
    models = prom.api("label/model/values", **{"match[]": "sluice_requests_total"})
    assert "tiny" in models
    # The new gauges say what the worker holds: one adapter, a 60 s max_ttft; the second
    # turns of the chats found their first turns in the KV cache.
    assert prom.value('max(sluice_adapters_loaded{model="tiny"})') == 1
    assert prom.value('max(sluice_max_ttft_seconds{model="tiny"})') == 60
    assert prom.value('sum(sluice_cached_prompt_tokens_total{model="tiny"})') > 0
    assert prom.value('max(sluice_worker_status{model="tiny", status="serving"})') == 1
    picture = os.environ.get("SLUICE_DASHBOARD_PNG")
    if picture:  # a minute more of the workload, drawn with Grafana's short rate windows
        from tests.integration.dashboard_png import render

        until = time.monotonic() + float(os.environ.get("SLUICE_DASHBOARD_SECONDS", "60"))
        while time.monotonic() < until:
            await workload(stack.api, stack.client, stack.key)
            await asyncio.sleep(1)
        await asyncio.sleep(3)
        await asyncio.to_thread(render, prom, board, {**VARIABLES, "$__rate_interval": "15s"},
                                Path(picture), stack.started_at, time.time())


async def test_dead_letters_fire_their_alert(stack: Stack) -> None:
    prom = stack.prometheus
    assert not prom.firing("SluiceDeadLetters")
    producer = AIOKafkaProducer(**stack.settings.producer_options())
    await producer.start()
    try:
        for i in range(3):  # bytes no producer of requests should write
            await producer.send_and_wait(stack.settings.requests_topic("tiny"),
                                         b"\xff\xfe not a request %d" % i, key=b"k%d" % i)
    finally:
        await producer.stop()
    firing = await prom.wait_for(lambda: prom.firing("SluiceDeadLetters"), "dead letters")
    assert [a["model"] for a in firing] == ["tiny"]
    assert firing[0]["severity"] == "warning"


async def test_ttft_over_max_ttft_fires_its_alert(stack: Stack) -> None:
    prom, client = stack.prometheus, stack.client
    assert not prom.firing("SluiceTTFTOverMaxTTFT")
    await asyncio.to_thread(client.models.update, model="tiny", placement={"max_ttft_ms": 1})
    try:
        # The worker has the new placement once it exports it.
        await prom.wait_for(lambda: prom.value(
            'max(sluice_max_ttft_seconds{model="tiny"})') == 0.001, "max_ttft 1 ms applied")
        async def too_late(i: int) -> None:  # read over 1 ms after the broker took it
            with pytest.raises(RequestTimeoutError):
                await client.complete(model="tiny", api_key=stack.key,
                                      prompt_token_ids=[9, 9, i], max_tokens=4, timeout=30)

        # Batches of them until over 1% of the last 5 minutes' requests timed out (how
        # many that takes depends on the traffic before).
        async with asyncio.timeout(90):
            while not prom.firing("SluiceTTFTOverMaxTTFT"):
                await asyncio.gather(*(too_late(i) for i in range(5)))
                await asyncio.sleep(1)
        firing = prom.firing("SluiceTTFTOverMaxTTFT")
        assert [a["model"] for a in firing] == ["tiny"]
        assert prom.value('sum(sluice_request_timeouts_total{model="tiny"})') >= 5
    finally:
        await asyncio.to_thread(client.models.update, model="tiny",
                                placement={"max_ttft_ms": 60000})
    await prom.wait_for(lambda: prom.value(
        'max(sluice_max_ttft_seconds{model="tiny"})') == 60, "max_ttft restored")


class StalledRuntime(Runtime):
    """The real runtime, whose model step does not return while `stall` is set: a device
    that stopped answering. The worker around it still reads, counts and is scraped."""

    def __init__(self, model_path: str | Path, config: RuntimeConfig | None,
                 stall: threading.Event):
        super().__init__(model_path, config)
        self.stall = stall

    def execute(self, plan: StepPlan) -> StepOutput:
        while self.stall.is_set():
            time.sleep(0.05)
        return super().execute(plan)


async def test_lag_growing_fires_its_alert(stack: Stack) -> None:
    prom, client, settings = stack.prometheus, stack.client, stack.settings
    assert not prom.firing("SluiceConsumerLagGrowing")
    await asyncio.to_thread(client.models.register, model="stalled", path=str(stack.model_dir))
    await asyncio.to_thread(client.keys.grant, stack.key, model="stalled")
    stall = threading.Event()
    stall.set()
    worker = Worker(settings.model_copy(update={"metrics_port": 0}),
                    WorkerOptions(model="stalled", instance_id="stalled-0"),
                    runtime_factory=lambda path, cfg: StalledRuntime(path, cfg, stall))
    running = asyncio.create_task(worker.run())
    producer = AIOKafkaProducer(**settings.producer_options(), linger_ms=5)
    await producer.start()
    sent = 0

    async def keep_sending() -> None:
        nonlocal sent
        while True:  # 50 requests a second, none of which the stalled worker finishes
            for _ in range(5):
                request = {"v": 1, "request_id": f"lag-{sent}", "model": "stalled",
                           "prompt_token_ids": [3, 4, 5], "max_tokens": 1,
                           "reply_topic": settings.topic("results")}
                await producer.send(settings.requests_topic("stalled"), orjson.dumps(request),
                                    key=request["request_id"].encode(),
                                    headers=[("authorization", f"Bearer {stack.key}".encode())])
                sent += 1
            await asyncio.sleep(0.1)

    sender: asyncio.Task[None] | None = None
    stalled: str | None = None
    try:
        await prom.wait_for(lambda: worker.ingest is not None and worker.metrics.ready
                            and worker.metrics_server is not None, "the stalled worker serving",
                            timeout_s=120)
        assert worker.metrics_server is not None
        stalled = f"127.0.0.1:{worker.metrics_server.port}"
        prom.set_targets(WORKERS, [stack.worker_target, stalled])
        await prom.wait_for(lambda: prom.scraped().get(stalled) == 1, "stalled worker scraped")
        sender = asyncio.create_task(keep_sending())
        firing = await prom.wait_for(lambda: prom.firing("SluiceConsumerLagGrowing"),
                                     "lag growing", timeout_s=90)
        assert [a["model"] for a in firing] == ["stalled"]
        assert prom.value('sum(sluice_consumer_lag{model="stalled"})') > 100
    finally:
        if sender is not None:
            sender.cancel()
        await producer.stop()
        # Out of Prometheus's targets before it stops: a worker stopped on purpose is
        # not down.
        if stalled is not None:
            prom.set_targets(WORKERS, [stack.worker_target])
            await prom.wait_for(lambda: stalled not in prom.scraped(), "stalled target gone")
        stall.clear()  # the device answers again: the drain can finish
        worker.stop()
        await asyncio.wait_for(running, 60)
    assert sent > 100


async def test_worker_down_fires_its_alert(stack: Stack) -> None:
    """Last: it ends the stack's worker."""
    prom = stack.prometheus
    assert prom.scraped() == {stack.worker_target: 1.0, stack.gateway_target: 1.0}
    assert not prom.firing("SluiceWorkerDown")
    stack.worker.kill()  # SIGKILL: no goodbye
    firing = await prom.wait_for(lambda: prom.firing("SluiceWorkerDown"), "worker down")
    assert [(a["instance"], a["job"], a["severity"]) for a in firing] == [
        (stack.worker_target, WORKERS, "critical")]


def _seconds(rfc3339: str) -> float:
    """Prometheus's timestamps (nanoseconds, Z) as Unix seconds."""
    from datetime import datetime

    head, _, frac = rfc3339.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float(f"0.{frac or 0}")
