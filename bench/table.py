"""The document as rich tables: every figure per scenario, then the goals."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from bench.harness import fmt_figure, walk_figures


def scenario_table(name: str, results: dict[str, Any]) -> Table:
    table = Table(title=f"sluice bench: {name}", title_justify="left", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for path, fig in walk_figures({k: v for k, v in results.items() if k != "goals"}):
        table.add_row(path, fmt_figure(fig))
    if not results.get("available", True):
        table.add_row("not available", str(results.get("error") or results.get("note", "")))
    return table


def goals_table(doc: dict[str, Any]) -> Table:
    table = Table(title="goals", title_justify="left", show_header=True)
    for column in ("scenario", "goal", "value", "met", "missed by"):
        table.add_column(column, justify="right" if column in ("value", "missed by") else "left")
    for name, results in doc["results"].items():
        for g in results.get("goals", {}).values():
            value = "n/a" if g["value"] is None else f"{g['value']:.3g} {g['unit']}"
            missed = "" if g["met"] or g["missed_by"] is None else f"{g['missed_by']:.3g}"
            table.add_row(name, g["target"], value, "yes" if g["met"] else "NO", missed)
    return table


def print_document(doc: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    m = doc["machine"]
    console.print(f"[bold]sluice bench {doc['scenario']}[/] {doc['date']}  quick={doc['quick']}  "
                  f"{m['cpu_model']} x{m['cores']}  torch {m['torch_version']}  "
                  f"device={m['device']}  load={m.get('load_average_1m')}")
    for name, results in doc["results"].items():
        console.print(scenario_table(name, results))
    console.print(goals_table(doc))
