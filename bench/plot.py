"""`--plot OUT.png`: decode throughput vs batch size beside its roofline, and TTFT per class.

matplotlib (the `bench` extra) is imported only here, with the Agg backend,
so the harness runs without it and says clearly what is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.harness import ScenarioResult


class PlotUnavailableError(RuntimeError):
    pass


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'sluice-engine[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _throughput(ax: Any, raw: dict[str, Any]) -> None:
    decode = {int(b): v for b, v in raw["decode_tokens_s"].items()}
    batches = sorted(decode)
    step_bytes = raw["model"]["params_per_step"] * 4
    bandwidth = raw["memory_bandwidth_gb_s"] * 1e9
    flops = {int(b): g * 1e9 for b, g in raw["matmul_gflops"].items()}
    # Roofline: a step reads every weight once (bandwidth) and does 2 * params FLOPs per row.
    roof = [min(b * bandwidth / step_bytes, flops[b] / (2 * raw["model"]["params_per_step"]))
            for b in batches]
    ax.plot(batches, [decode[b] for b in batches], "o-", label="sluice runtime")
    ax.plot(batches, roof, "--", color="gray", label="machine limit (roofline)")
    flops_bound = {b: f / (2 * raw["model"]["params_per_step"]) for b, f in flops.items()}
    hf = {int(b): v for b, v in raw["hf_generate_decode_tokens_s"].items()
          if v is not None and v <= 2 * flops_bound.get(int(b), float("inf"))}
    if hf:
        ax.plot(sorted(hf), [hf[b] for b in sorted(hf)], "s-", label="HF generate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("runtime: decode throughput")
    ax.legend(fontsize=8)


def _deadlines(ax: Any, raw: dict[str, Any]) -> None:
    """p50 / p99 TTFT per class and policy (bench_deadlines reports percentiles only)."""
    labels, p50, p99 = [], [], []
    for policy in ("edf", "fcfs"):
        for cls in ("interactive", "bulk"):
            c = raw[policy][cls]
            labels.append(f"{policy}\n{cls}\n({c['timeouts']} t/o)")
            p50.append(c["ttft_ms_p50"] or 0.0)
            p99.append(c["ttft_ms_p99"] or 0.0)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    ax.axhline(raw["load"]["interactive_max_ttft_ms"], color="red", ls=":",
               label="interactive max_ttft")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("TTFT ms")
    ax.set_title("deadlines: TTFT per class, EDF vs FCFS")
    ax.legend(fontsize=8)


def _cdf(ax: Any, series: dict[str, list[float]], title: str) -> None:
    for label, values in series.items():
        ordered = sorted(values)
        n = len(ordered)
        ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT ms")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.legend(fontsize=8)


def render(results: dict[str, ScenarioResult], out: Path) -> Path:
    plt = _pyplot()
    panels = []
    if "runtime" in results and "raw" in results["runtime"].extra:
        panels.append(lambda ax: _throughput(ax, results["runtime"].extra["raw"]))
    if "deadlines" in results and "raw" in results["deadlines"].extra:
        panels.append(lambda ax: _deadlines(ax, results["deadlines"].extra["raw"]))
    for name, title in (("sessions", "sessions: TTFT CDF"), ("kafka", "kafka: TTFT CDF")):
        if name in results and results[name].extra.get("ttft_ms"):
            series = results[name].extra["ttft_ms"]
            panels.append(lambda ax, s=series, t=title: _cdf(ax, s, t))
    if not panels:
        raise PlotUnavailableError("nothing to plot for these scenarios")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for panel, ax in zip(panels, axes[0], strict=True):
        panel(ax)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
