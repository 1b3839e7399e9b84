"""What every scenario shares: figures with units, the machine and its limits, the document.

A *figure* is `{"value": 12.3, "unit": "tok/s"}`. A scenario returns a nested
dict whose leaves are figures (or short strings: notes), with a `ratios` dict
(engine over baseline), a `limits` dict (the machine's limits measured in the
same run) and a `goals` dict (`goal(...)`: target, value, met, missed by).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Figure = dict[str, Any]


def figure(value: float | int | None, unit: str, digits: int = 4) -> Figure:
    """One measured number with its unit (None: not measured, e.g. a missing baseline)."""
    if value is None:
        return {"value": None, "unit": unit}
    if digits == 0:
        return {"value": round(float(value)), "unit": unit}
    return {"value": round(float(value), digits), "unit": unit}


def ratio(num: float | None, den: float | None) -> Figure:
    if num is None or den is None or den == 0:
        return figure(None, "x")
    return figure(num / den, "x", 3)


def goal(target: str, value: float | None, threshold: float, *, higher_is_better: bool = True,
         unit: str = "x") -> dict[str, Any]:
    """A goal: met or not, and by how much it is missed (in the value's unit)."""
    if value is None:
        return {"target": target, "value": None, "unit": unit, "met": False, "missed_by": None}
    met = value >= threshold if higher_is_better else value <= threshold
    missed = 0.0 if met else abs(threshold - value)
    return {"target": target, "value": round(value, 4), "unit": unit, "met": met,
            "missed_by": round(missed, 4)}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_figures(samples_ms: Sequence[float]) -> dict[str, Figure]:
    return {
        "p50": figure(percentile(samples_ms, 0.5), "ms", 2),
        "p99": figure(percentile(samples_ms, 0.99), "ms", 2),
        "mean": figure(sum(samples_ms) / len(samples_ms) if samples_ms else None, "ms", 2),
        "count": figure(len(samples_ms), "requests", 0),
    }


def sync_for(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


# ---- the machine ---------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


@dataclass(frozen=True, slots=True)
class MatmulShape:
    """x [m, k] @ w[n, k]^T — one linear layer at a scenario's row count."""

    m: int
    k: int
    n: int

    @property
    def name(self) -> str:
        return f"{self.m}x{self.k}x{self.n}"


def measure_bandwidth(device: str, dtype: torch.dtype = torch.float32,
                      num_bytes: int = 256 << 20) -> float:
    """Bytes/s of reading one large tensor (see bench.runtime_bench), best of 3."""
    from bench.runtime_bench import measure_read_bandwidth

    return measure_read_bandwidth(device, dtype, num_bytes, sync_for(device))


def measure_matmul(device: str, shapes: Sequence[MatmulShape],
                   dtype: torch.dtype = torch.float32, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of `F.linear` at each shape, best of 3 rounds of `repeats` calls."""
    sync = sync_for(device)
    out: dict[str, float] = {}
    for s in shapes:
        x = torch.randn(s.m, s.k, device=device, dtype=dtype)
        w = torch.randn(s.n, s.k, device=device, dtype=dtype)

        def run(x: torch.Tensor = x, w: torch.Tensor = w) -> None:
            for _ in range(repeats):
                torch.nn.functional.linear(x, w)

        run()
        seconds = min(timed(run, sync) for _ in range(3))
        out[s.name] = repeats * 2 * s.m * s.k * s.n / seconds
    return out


def layer_shapes(rows: int, hidden: int, intermediate: int) -> list[MatmulShape]:
    """The dominant linear shapes of a Llama layer at `rows` token rows."""
    return [MatmulShape(rows, hidden, hidden), MatmulShape(rows, hidden, intermediate),
            MatmulShape(rows, intermediate, hidden)]


def combined_flops(per_shape: dict[str, float], shapes: Sequence[MatmulShape]) -> float:
    """FLOP/s of running the shapes one after another (time-weighted harmonic mean)."""
    flops = [2 * s.m * s.k * s.n for s in shapes]
    seconds = sum(f / per_shape[s.name] for f, s in zip(flops, shapes, strict=True))
    return sum(flops) / seconds


def limits_figures(bandwidth: float | None, matmul: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if bandwidth is not None:
        out["memory_bandwidth"] = figure(bandwidth / 1e9, "GB/s", 2)
    out["matmul"] = {name: figure(f / 1e9, "GFLOP/s", 2) for name, f in matmul.items()}
    return out


# ---- the document --------------------------------------------------------------------


@dataclass(slots=True)
class ScenarioResult:
    model_shape: str
    results: dict[str, Any]
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # raw samples for plots, not in JSON


def document(scenario: str, device: str, quick: bool,
             results: dict[str, ScenarioResult]) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "model_shape": {name: r.model_shape for name, r in results.items()},
        "quick": quick,
        "wall_s": {name: round(r.wall_s, 1) for name, r in results.items()},
        "results": {name: r.results for name, r in results.items()},
    }


def is_figure(node: object) -> bool:
    return isinstance(node, dict) and set(node) == {"value", "unit"}


def walk_figures(node: Any, prefix: str = "") -> Iterator[tuple[str, Figure]]:
    """(dotted path, figure) for every figure under `node`, in insertion order."""
    if is_figure(node):
        yield prefix, node
    elif isinstance(node, dict):
        for key, child in node.items():
            yield from walk_figures(child, f"{prefix}.{key}" if prefix else str(key))


def fmt_figure(fig: Figure) -> str:
    value = fig["value"]
    if value is None:
        return "n/a"
    if isinstance(value, float) and abs(value) < 100:
        return f"{value:.3g} {fig['unit']}"
    return f"{value:,.0f} {fig['unit']}"
