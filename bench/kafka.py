"""`kafka` and `bulk`: the same work in-process (the `Engine` directly) and through the broker.

`kafka`: one request at a time, alternating between the two paths, so both
see the same machine state; TTFT (to the first token) and end to end (to the
terminal event), measured by the caller. What Kafka adds = the Kafka path
minus the in-process path, at p50 and p99. The floor it is compared with: two
produce -> consume hops of a small record on the same broker (a request goes
to the request topic, its tokens come back on the reply topic).

`bulk`: a generated JSONL through `sluice.batch.run_batch` (the `sluice
batch` code) and the same prompts submitted to an in-process `Engine`, with
the same concurrency; requests/s and tokens/s of each.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from batcher.config import BatcherConfig
from batcher.engine import Engine
from batcher.types import TERMINAL_EVENT_TYPES, Finished, Request, Tokens
from bench.harness import Figure, figure, goal, latency_figures, percentile, ratio
from bench.served import (
    KV_CACHE_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MODEL,
    Served,
    twin_model_process,
)
from common.heap import freeze_heap
from common.threads import run_in_own_thread
from common.tracing import Tracing
from gpu_runtime import Runtime, RuntimeConfig, SamplingParams
from infra.common import free_port
from schemas import DoneEvent as WireDone
from schemas import TokenEvent as WireToken


def _engine(model_dir: Path, device: str) -> Engine:
    config = RuntimeConfig(device=device, kv_cache_len=KV_CACHE_LEN,
                           max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    rt = run_in_own_thread(Runtime, model_dir, config)  # as a worker loads it
    return Engine(rt, BatcherConfig(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS))


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(24, 64))] for _ in range(count)]


def _vocab(model_dir: Path) -> int:
    return int(orjson.loads((model_dir / "config.json").read_bytes())["vocab_size"])


async def _in_process(engine: Engine, rid: str, prompt: list[int],
                      max_tokens: int) -> tuple[float, float]:
    """(TTFT ms, end-to-end ms) of one request when it is the only one in flight."""
    start = time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    now = time.time()
    engine.submit(Request(rid, tuple(prompt), params, now, now + 60.0))
    first = None
    while True:
        event = await engine.next_event()
        if isinstance(event, Tokens) and first is None:
            first = time.perf_counter()
        if isinstance(event, Finished):
            end = time.perf_counter()
            return ((first or end) - start) * 1000, (end - start) * 1000
        if isinstance(event, TERMINAL_EVENT_TYPES):
            raise RuntimeError(f"request {rid} ended with {event!r}")


async def _through_kafka(served: Served, rid: str, prompt: list[int],
                         max_tokens: int, model: str = MODEL) -> tuple[float, float, float]:
    """(TTFT ms, end-to-end ms, worker-reported TTFT ms) of one request via the SDK."""
    start = time.perf_counter()
    first = None
    async for event in served.client.stream(model=model, api_key=served.api_key,
                                            request_id=rid, prompt_token_ids=prompt,
                                            max_tokens=max_tokens, temperature=0.0):
        if isinstance(event, WireToken):
            first = first or time.perf_counter()
        elif isinstance(event, WireDone):
            end = time.perf_counter()
            return ((first or end) - start) * 1000, (end - start) * 1000, event.timing.ttft_ms
        else:
            raise RuntimeError(f"request {rid} ended with {event!r}")
    raise RuntimeError(f"request {rid}: the reply stream ended early")


async def _broker_round_trips(served: Served, count: int) -> list[float]:
    """Milliseconds from `send_and_wait` of a small record to its consumption."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from common.topics import TopicAdmin, TopicSpec

    topic = served.settings.topic("bench-probe")
    async with TopicAdmin(served.settings) as admin:
        await admin.ensure([TopicSpec(topic, 1, {})])
    options = served.settings.kafka_options()
    producer = AIOKafkaProducer(**options, enable_idempotence=True)
    consumer = AIOKafkaConsumer(**options, enable_auto_commit=False)
    await producer.start()
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        out = []
        for i in range(count + 1):
            start = time.perf_counter()
            await producer.send_and_wait(topic, b"x" * 200, key=str(i).encode())
            await consumer.getone()
            if i:  # the first one warms the connections
                out.append((time.perf_counter() - start) * 1000)
        return out
    finally:
        await consumer.stop()
        await producer.stop()


def added_ms(path: list[float], baseline: list[float], q: float) -> float | None:
    """Milliseconds by which `path`'s q-quantile exceeds `baseline`'s; None without samples."""
    a, b = percentile(path, q), percentile(baseline, q)
    return None if a is None or b is None else a - b


def added_figures(path: dict[str, list[float]],
                  baseline: dict[str, list[float]]) -> dict[str, Figure]:
    """What `path` adds to TTFT and to end-to-end latency over `baseline`, p50 and p99."""
    return {
        "ttft_p50": figure(added_ms(path["ttft"], baseline["ttft"], 0.5), "ms", 2),
        "ttft_p99": figure(added_ms(path["ttft"], baseline["ttft"], 0.99), "ms", 2),
        "end_to_end_p50": figure(added_ms(path["e2e"], baseline["e2e"], 0.5), "ms", 2),
        "end_to_end_p99": figure(added_ms(path["e2e"], baseline["e2e"], 0.99), "ms", 2),
    }


async def bench_kafka(served: Served, device: str,
                      quick: bool) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """(results, raw TTFT samples per path for the plot)."""
    count, max_tokens = (16, 8) if quick else (120, 16)
    prompts = _prompts(count + 1, _vocab(served.model_dir), seed=11)
    local = {"ttft": [], "e2e": []}
    remote: dict[str, list[float]] = {"ttft": [], "e2e": [], "worker_ttft": []}
    async with _engine(served.model_dir, device) as engine:
        await _in_process(engine, "warm", prompts[-1], 2)
        for i, prompt in enumerate(prompts[:count]):
            ttft, e2e = await _in_process(engine, f"local-{i}", prompt, max_tokens)
            local["ttft"].append(ttft)
            local["e2e"].append(e2e)
            ttft, e2e, worker_ttft = await _through_kafka(served, f"kafka-{i}", prompt,
                                                          max_tokens)
            remote["ttft"].append(ttft)
            remote["e2e"].append(e2e)
            remote["worker_ttft"].append(worker_ttft)
    hops = await _broker_round_trips(served, 10 if quick else 50)
    floor = 2 * (percentile(hops, 0.5) or 0.0)
    added_p50 = added_ms(remote["ttft"], local["ttft"], 0.5)
    results: dict[str, Any] = {
        "kafka_ttft": latency_figures(remote["ttft"]),
        "kafka_end_to_end": latency_figures(remote["e2e"]),
        "kafka_worker_reported_ttft": latency_figures(remote["worker_ttft"]),
        "baseline_in_process_ttft": latency_figures(local["ttft"]),
        "baseline_in_process_end_to_end": latency_figures(local["e2e"]),
        "added_by_kafka": added_figures(remote, local),
        "limits": {
            "broker_round_trip": latency_figures(hops),
            "two_hop_floor_p50": figure(floor, "ms", 2),
        },
        "fraction_of_limit": {
            "added_ttft_p50_over_two_hop_floor": ratio(added_p50, floor),
        },
        "ratios": {
            "ttft_p50_kafka_over_in_process": ratio(percentile(remote["ttft"], 0.5),
                                                    percentile(local["ttft"], 0.5)),
            "end_to_end_p50_kafka_over_in_process": ratio(percentile(remote["e2e"], 0.5),
                                                          percentile(local["e2e"], 0.5)),
        },
        "workload": f"{count} requests one at a time, prompts 24-64 tokens, "
                    f"{max_tokens} new tokens, greedy; paths alternate request by request",
    }
    results["goals"] = {
        "added_ttft_p50": goal("Kafka adds <= 10 ms p50 to TTFT", added_p50, 10.0,
                               higher_is_better=False, unit="ms"),
    }
    results["exactly_once"] = await _exactly_once_cost(served, device, quick, prompts[:count],
                                                       max_tokens)
    results["tracing"] = await _tracing_cost(served, device, quick, prompts[:count], max_tokens)
    for name, tracing_goal in results["tracing"].get("goals", {}).items():
        results["goals"][f"tracing_{name}"] = tracing_goal
    return results, {"in-process": local["ttft"], "kafka": remote["ttft"]}


async def _alternating(served: Served, models: dict[str, str], prompts: list[list[int]],
                       max_tokens: int, tag: str) -> dict[str, dict[str, list[float]]]:
    """The same requests to each of `models`, one at a time, alternating request by
    request: TTFT and end to end (ms) per mode."""
    lat: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "e2e": []} for m in models}
    for i, prompt in enumerate(prompts):
        for mode, model in models.items():
            ttft, e2e, _ = await _through_kafka(served, f"{tag}-{mode}-{i}", prompt,
                                                max_tokens, model)
            lat[mode]["ttft"].append(ttft)
            lat[mode]["e2e"].append(e2e)
    return lat


def _bulk_file(folder: Path, served: Served, count: int, max_tokens: int, seed: int) -> Path:
    """A `sluice batch` input of `count` generated prompts, greedy."""
    lines = [{"custom_id": f"b{i}", "body": {"prompt_token_ids": p, "max_tokens": max_tokens,
                                             "temperature": 0.0}}
             for i, p in enumerate(_prompts(count, _vocab(served.model_dir), seed))]
    path = folder / "in.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
    return path


async def _exactly_once_cost(served: Served, device: str, quick: bool,
                             prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The same requests to the at-least-once model and to a twin in exactly-once
    mode (transactions), alternating one by one; then the same bulk load on each,
    alternating runs: what the transactions cost in TTFT and throughput."""
    from bench.served import twin_model
    from sluice.batch import run_batch

    bulk: dict[str, list[tuple[float, int]]] = {m: [] for m in ("at_least_once",
                                                                 "exactly_once")}
    num_bulk, concurrency = (96, 32) if quick else (256, 64)
    async with twin_model(served, f"{MODEL}-eo", device, delivery="exactly_once") as twin:
        models = {"at_least_once": MODEL, "exactly_once": twin}
        lat = await _alternating(served, models, prompts, max_tokens, "eo")
        with tempfile.TemporaryDirectory() as tmp:
            in_path = _bulk_file(Path(tmp), served, num_bulk, max_tokens, 31)
            for r in range(1 if quick else 2):
                for mode, model in models.items():
                    summary = await run_batch(served.client, in_path,
                                              Path(tmp) / f"out-{mode}-{r}.jsonl", model=model,
                                              api_key=served.api_key, concurrency=concurrency)
                    if summary.num_errors:
                        raise RuntimeError(f"{mode} bulk run had {summary.num_errors} errors")
                    bulk[mode].append((summary.seconds, summary.num_completion_tokens))

    def tokens_s(runs: list[tuple[float, int]]) -> float:
        return sum(t for _, t in runs) / sum(s for s, _ in runs)

    p50 = {mode: {kind: percentile(v, 0.5) for kind, v in kinds.items()}
           for mode, kinds in lat.items()}
    eo, alo = p50["exactly_once"], p50["at_least_once"]
    rate = {mode: tokens_s(runs) for mode, runs in bulk.items()}
    return {
        "at_least_once_ttft": latency_figures(lat["at_least_once"]["ttft"]),
        "exactly_once_ttft": latency_figures(lat["exactly_once"]["ttft"]),
        "at_least_once_end_to_end": latency_figures(lat["at_least_once"]["e2e"]),
        "exactly_once_end_to_end": latency_figures(lat["exactly_once"]["e2e"]),
        "bulk_tokens_per_s": {mode: figure(v, "tok/s", 1) for mode, v in rate.items()},
        "ratios": {
            "ttft_p50_exactly_over_at_least_once": ratio(eo["ttft"], alo["ttft"]),
            "end_to_end_p50_exactly_over_at_least_once": ratio(eo["e2e"], alo["e2e"]),
            "bulk_tokens_s_exactly_over_at_least_once": ratio(rate["exactly_once"],
                                                              rate["at_least_once"]),
        },
        "workload": f"{len(prompts)} requests one at a time per mode, alternating; bulk "
                    f"{num_bulk} prompts x {concurrency} in flight per mode, alternating runs",
    }


@contextlib.asynccontextmanager
async def _otlp_sink() -> AsyncIterator[str]:
    """An OTLP/HTTP endpoint in a process of its own (`bench.otlp_sink`): its URL."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.otlp_sink", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            assert proc.stdout is not None
            if (await proc.stdout.readline()).strip() != b"ready":
                raise RuntimeError("the OTLP sink did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.terminate()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await proc.wait()


async def _exported(tracing: Tracing) -> float:
    """Export what the traced worker still holds; the seconds it took (a run's spans
    are exported inside the run's own time, so their cost is counted)."""
    started = time.perf_counter()
    exporter = tracing.exporter
    async with asyncio.timeout(60):
        while not exporter.idle:
            # Again each time: spans of a request committed after the export began
            # would otherwise wait for the schedule delay (5 s).
            exporter.export_now()
            await asyncio.sleep(0.005)
    return time.perf_counter() - started


async def _tracing_cost(served: Served, device: str, quick: bool,
                        prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Two twins of the model in this process, one tracing every request (OTLP to a
    receiver in another process: the collector is elsewhere in a deployment), one not:
    the same requests one at a time, alternating, then bulk runs in the order off, on,
    on, off (a machine that drifts during the run costs both alike). A traced run's
    time includes exporting its spans.

    Twice over, the twins started in the opposite order: with neither twin tracing,
    the one in the traced twin's place ran bulk 1.01-1.06x the other (an A/A check,
    four runs), a lead one pair would take for tracing's. The bulk ratio is the
    geometric mean of the two pairs', where a lead that goes with the start order
    cancels."""
    from bench.served import twin_model
    from sluice.batch import run_batch

    num_bulk, concurrency, cycles = (96, 32, 1) if quick else (512, 64, 2)
    modes = ("off", "on")
    lat: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "e2e": []} for m in modes}
    bulk: list[dict[str, list[tuple[float, int]]]] = []
    spans = 0
    async with _otlp_sink() as endpoint:
        for pair, first in enumerate(modes):
            traced = Tracing.from_env("sluice-bench-worker", {
                "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
            if not traced:
                return {"not_available": "the OpenTelemetry packages are not installed "
                                         "(install sluice-engine[otel])"}
            twins = {"off": twin_model(served, f"{MODEL}-untraced-{pair}", device,
                                       tracing=Tracing.off()),
                     "on": twin_model(served, f"{MODEL}-traced-{pair}", device,
                                      tracing=traced)}
            second = "on" if first == "off" else "off"
            async with twins[first] as one, twins[second] as other:
                models = {first: one, second: other}
                # As `sluice worker` does once its model is loaded (`common.heap`): the
                # traced twin's longer-lived objects set off more full collections,
                # each ~0.15 s of this whole process while start-up's heap is in them.
                freeze_heap(collect_first=True)
                try:
                    await _exported(traced)
                    got = await _alternating(served, models, prompts[pair::2], max_tokens,
                                             f"tr{pair}")
                    for mode in modes:
                        for name, values in got[mode].items():
                            lat[mode][name].extend(values)
                    await _exported(traced)
                    runs: dict[str, list[tuple[float, int]]] = {m: [] for m in modes}
                    with tempfile.TemporaryDirectory() as tmp:
                        in_path = _bulk_file(Path(tmp), served, num_bulk, max_tokens, 37)
                        for r, mode in enumerate(["off", "on", "on", "off"] * cycles):
                            summary = await run_batch(served.client, in_path,
                                                      Path(tmp) / f"out-{mode}-{r}.jsonl",
                                                      model=models[mode], api_key=served.api_key,
                                                      concurrency=concurrency)
                            if summary.num_errors:
                                raise RuntimeError(f"tracing {mode}: a bulk run had "
                                                   f"{summary.num_errors} errors")
                            seconds = summary.seconds + (await _exported(traced) if mode == "on"
                                                         else 0.0)
                            runs[mode].append((seconds, summary.num_completion_tokens))
                    bulk.append(runs)
                finally:
                    gc.unfreeze()  # the rest of the bench as it was
            spans += traced.exporter.num_exported
            await asyncio.to_thread(traced.shutdown)

    def tokens_s(runs: list[tuple[float, int]]) -> float:
        return sum(t for _, t in runs) / sum(s for s, _ in runs)

    ttft = {m: percentile(lat[m]["ttft"], 0.5) for m in modes}
    rates = [{m: tokens_s(runs[m]) for m in modes} for runs in bulk]
    pair_ratios = [r["on"] / r["off"] for r in rates]
    bulk_ratio = math.sqrt(pair_ratios[0] * pair_ratios[1])
    rate = {m: math.sqrt(rates[0][m] * rates[1][m]) for m in modes}
    ttft_cost = None if not ttft["off"] else (ttft["on"] / ttft["off"] - 1) * 100
    bulk_cost = (1 - bulk_ratio) * 100
    return {
        "off_ttft": latency_figures(lat["off"]["ttft"]),
        "on_ttft": latency_figures(lat["on"]["ttft"]),
        "bulk_tokens_per_s": {m: figure(v, "tok/s", 1) for m, v in rate.items()},
        "bulk_runs_tokens_per_s": [{m: [round(t / s, 1) for s, t in runs[m]] for m in modes}
                                   for runs in bulk],
        "bulk_pair_ratios": {f"{first}_started_first": ratio(r["on"], r["off"])
                             for first, r in zip(("untraced", "traced"), rates, strict=True)},
        "spans_exported": figure(spans, "spans", 0),
        "ratios": {
            "ttft_p50_on_over_off": ratio(ttft["on"], ttft["off"]),
            "bulk_tokens_s_on_over_off": figure(bulk_ratio, "x", 3),
        },
        "goals": {
            "ttft_p50_cost": goal("tracing on adds <= 3 % to TTFT p50", ttft_cost, 3.0,
                                  higher_is_better=False, unit="%"),
            "bulk_tokens_s_cost": goal("tracing on costs <= 3 % of bulk tokens/s",
                                       bulk_cost, 3.0, higher_is_better=False, unit="%"),
        },
        "workload": f"two pairs of twins, started untraced first, then traced first: "
                    f"{len(prompts)} requests one at a time, alternating (half per pair); "
                    f"bulk {num_bulk} prompts x {concurrency} in flight, runs off/on/on/off "
                    f"x {cycles} per pair; every request traced (OTLP/HTTP to a receiver "
                    "in another process, spans of a run exported within its time); the "
                    "bulk ratio is the geometric mean of the pairs'",
    }


async def _bulk_in_process(engine: Engine, prompts: list[list[int]], max_tokens: int,
                           concurrency: int) -> tuple[float, int]:
    """(seconds, completion tokens) of every prompt, `concurrency` in flight."""
    waiting = {f"bulk-{i}": p for i, p in enumerate(prompts)}
    order = list(waiting)
    tokens = 0
    start = time.perf_counter()
    in_flight = 0
    while order or in_flight:
        while order and in_flight < concurrency:
            rid = order.pop(0)
            now = time.time()
            engine.submit(Request(rid, tuple(waiting[rid]),
                                  SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                  now, now + 24 * 3600.0))
            in_flight += 1
        event = await engine.next_event()
        if isinstance(event, Finished):
            tokens += event.counts.num_completion_tokens
        if isinstance(event, TERMINAL_EVENT_TYPES):
            in_flight -= 1
    return time.perf_counter() - start, tokens


async def bench_bulk(served: Served, device: str, quick: bool, workdir: Path,
                     real_model: bool = False) -> dict[str, Any]:
    """Closed loop (a fixed number in flight on both paths), then open loop: every
    prompt produced up front (`sluice batch --concurrency N` with N = all) and with
    the default `auto` window, beside the same prompts submitted at once to an
    in-process engine. A real model's step is ~100x the tiny one's, so it gets fewer
    prompts (the same minutes of work)."""
    from sluice.batch import run_batch

    if real_model:
        count, max_tokens, concurrency = (32, 8, 16) if quick else (128, 16, 64)
        open_count = 64 if quick else 400
    else:
        count, max_tokens, concurrency = (128, 8, 32) if quick else (400, 16, 64)
        open_count = 300 if quick else 2000
    vocab = _vocab(served.model_dir)
    prompts = _prompts(count, vocab, seed=23)
    open_prompts = _prompts(open_count, vocab, seed=29)

    def write(name: str, items: list[list[int]]) -> Path:
        path = workdir / name
        lines = [{"custom_id": f"b{i}", "body": {"prompt_token_ids": p,
                                                 "max_tokens": max_tokens,
                                                 "temperature": 0.0}}
                 for i, p in enumerate(items)]
        path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
        return path

    run_numbers = itertools.count(1)

    def fresh(items: list[list[int]]) -> list[list[int]]:
        """`items` with every first token moved on by a run number of its own: a run never
        meets prefixes an earlier run left in a cache (measured: with SmolLM2 the second
        run of the same prompts on one worker took half the time). Lengths stay equal,
        so every run does the same work."""
        n = next(run_numbers)
        return [[3 + (p[0] - 3 + n) % (vocab - 3), *p[1:]] for p in items]

    async def through_kafka(items: list[list[int]], out: str, in_flight: int | None,
                            model: str = MODEL) -> tuple[float, int, int]:
        path = write(f"{out}.in.jsonl", fresh(items))
        summary = await run_batch(served.client, path, workdir / f"{out}.jsonl", model=model,
                                  api_key=served.api_key, concurrency=in_flight)
        if summary.num_errors or summary.num_unanswered:
            raise RuntimeError(f"bulk run had {summary.num_errors} errors, "
                               f"{summary.num_unanswered} unanswered")
        return summary.seconds, summary.num_completion_tokens, summary.peak_in_flight

    local_runs, kafka_runs = [], []
    open_local, open_all, open_auto, open_process = [], [], [], []
    rounds = 1 if quick else 2
    async with (_engine(served.model_dir, device) as engine,
                twin_model_process(served, "bulk-process", device,
                                   workdir / "bulk-process-worker.log") as own_process):
        for r in range(rounds):  # alternate, so drift in machine load hits both paths
            local_runs.append(await _bulk_in_process(engine, fresh(prompts), max_tokens,
                                                     concurrency))
            kafka_runs.append((await through_kafka(prompts, f"bulk-out-{r}", concurrency))[:2])
        for r in range(rounds):
            open_local.append(await _bulk_in_process(engine, fresh(open_prompts), max_tokens,
                                                     open_count))
            open_all.append(await through_kafka(open_prompts, f"bulk-open-all-{r}", open_count))
            open_auto.append(await through_kafka(open_prompts, f"bulk-open-auto-{r}", None))
            open_process.append(await through_kafka(
                open_prompts, f"bulk-open-process-{r}", None, own_process))

    def rates(runs: list[tuple[float, int]], n: int = count) -> dict[str, Any]:
        seconds = sum(s for s, _ in runs)
        tokens = sum(t for _, t in runs)
        return {"requests_s": n * len(runs) / seconds, "tokens_s": tokens / seconds,
                "tokens": tokens / len(runs), "seconds": seconds / len(runs)}

    mine, base = rates(kafka_runs), rates(local_runs)
    all_at_once = rates([run[:2] for run in open_all], open_count)
    auto = rates([run[:2] for run in open_auto], open_count)
    engine_at_once = rates(open_local, open_count)
    own = rates([run[:2] for run in open_process], open_count)

    def figs(r: dict[str, Any]) -> dict[str, Any]:
        return {"requests_per_s": figure(r["requests_s"], "req/s", 2),
                "completion_tokens_per_s": figure(r["tokens_s"], "tok/s", 1),
                "completion_tokens": figure(r["tokens"], "tokens", 0),
                "wall": figure(r["seconds"], "s", 2)}

    open_ratio = ratio(all_at_once["tokens_s"], engine_at_once["tokens_s"])
    auto_ratio = ratio(auto["tokens_s"], engine_at_once["tokens_s"])
    own_ratio = ratio(own["tokens_s"], engine_at_once["tokens_s"])
    return {
        "kafka_run_batch": figs(mine),
        "baseline_in_process_engine": figs(base),
        "open_loop": {
            "kafka_all_produced_up_front": figs(all_at_once),
            "kafka_auto_window": {**figs(auto), "peak_in_flight": figure(
                max(run[2] for run in open_auto), "requests", 0)},
            # The same, served by a `sluice worker` process of its own (as deployed):
            # above, worker and client share this process's interpreter.
            "kafka_auto_window_worker_process": {**figs(own), "peak_in_flight": figure(
                max(run[2] for run in open_process), "requests", 0)},
            "baseline_in_process_all_at_once": figs(engine_at_once),
            "ratios": {"up_front_over_in_process": open_ratio,
                       "auto_over_in_process": auto_ratio,
                       "auto_worker_process_over_in_process": own_ratio},
            "workload": f"{open_count} prompts of 24-64 tokens, max_tokens {max_tokens}, "
                        f"greedy, {rounds} round(s) per path",
        },
        "limits": {"in_process_tokens_per_s": figure(base["tokens_s"], "tok/s", 1)},
        "fraction_of_limit": {"kafka_tokens_s_of_in_process": ratio(mine["tokens_s"],
                                                                    base["tokens_s"])},
        "ratios": {
            "requests_s_kafka_over_in_process": ratio(mine["requests_s"], base["requests_s"]),
            "tokens_s_kafka_over_in_process": ratio(mine["tokens_s"], base["tokens_s"]),
        },
        "goals": {
            "open_loop": goal(">= 0.90x the in-process engine's tok/s, every prompt "
                              "produced up front", open_ratio["value"], 0.90),
            "auto_window": goal(">= 0.90x the in-process engine's tok/s, sluice batch's "
                                "default window", auto_ratio["value"], 0.90),
            "auto_window_worker_process": goal(
                ">= 0.90x the in-process engine's tok/s, sluice batch's default window, "
                "the worker in a process of its own", own_ratio["value"], 0.90),
        },
        "workload": f"{count} prompts of 24-64 tokens, max_tokens {max_tokens}, greedy, "
                    f"{concurrency} in flight, {rounds} round(s) per path, alternating",
    }
