"""The dashboard's panels drawn with matplotlib from a live Prometheus: each timeseries
panel's queries over a time range, each table panel's rows now. For the README's picture
of what the dashboard shows (SLUICE_DASHBOARD_PNG with tests/integration/test_alerts.py);
Grafana draws the real thing from the same JSON."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import Any

from tests.integration.prometheus import Prometheus

COLUMNS = 3
UNITS = {"s": "seconds", "percentunit": "fraction", "reqps": "per second", "short": ""}


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def _expr(expr: str, variables: dict[str, str]) -> str:
    for name, value in variables.items():
        expr = expr.replace(name, value)
    return expr


def render(prom: Prometheus, board: dict[str, Any], variables: dict[str, str], out: Path,
           start: float, end: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    panels = [p for p in board["panels"] if p["type"] != "row"]
    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(15, 2.7 * rows), squeeze=False)
    step = max(1.0, (end - start) / 150)
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        if panel["type"] == "table":
            _table(ax, prom, panel, variables)
            continue
        for target in panel["targets"]:
            for series in prom.query_range(_expr(target["expr"], variables), start, end, step):
                points = [(float(t) - start, float(v)) for t, v in series["values"]
                          if math.isfinite(float(v))]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, linewidth=1.2,
                            label=_legend(target.get("legendFormat", ""), series["metric"]))
        unit = panel["fieldConfig"]["defaults"]["unit"]
        if unit == "s":  # milliseconds beside max_ttft's tens of seconds
            ax.set_yscale("log")
        ax.set_ylabel(UNITS.get(unit, ""), fontsize=7)
        ax.set_xlabel("seconds into the test", fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left", ncol=2, frameon=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{board['title']} (Grafana dashboard files/dashboard.json), from a live "
                 "Prometheus scraping a worker and a gateway", fontsize=11)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=64)
    plt.close(fig)
    # 64 colours are plenty for lines on white: a third of the bytes (for the repository).
    Image.open(buffer).convert("RGB").quantize(colors=64).save(out, optimize=True)


def _table(ax: Any, prom: Prometheus, panel: dict[str, Any], variables: dict[str, str]) -> None:
    ax.axis("off")
    lines = []
    for target in panel["targets"]:
        for series in prom.query(_expr(target["expr"], variables)):
            labels = series["metric"]
            lines.append("  ".join(f"{k}={labels[k]}" for k in sorted(labels)))
    ax.text(0, 1, "\n".join(lines[:12]) or "(no rows)", va="top", family="monospace",
            fontsize=7, transform=ax.transAxes)
