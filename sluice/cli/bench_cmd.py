"""`sluice bench SCENARIO`: the harness in `sluice.bench` (tables: benchmarks/README.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sluice.cli.common import fail, friendly_errors

CHOICES = ("runtime", "adapters", "sessions", "deadlines", "startup", "kafka", "bulk", "gateway",
           "all", "gpu")


def register(app: typer.Typer) -> None:
    @app.command("bench")
    @friendly_errors
    def bench_cmd(
        scenario: Annotated[str, typer.Argument(help=f"One of: {', '.join(CHOICES)}.")],
        quick: Annotated[bool, typer.Option(
            "--quick", help="Smaller shapes and fewer requests (the CI smoke test).")] = False,
        json_out: Annotated[Path | None, typer.Option(
            "--json", help="Write the JSON document here.")] = None,
        plot_out: Annotated[Path | None, typer.Option(
            "--plot", help="Render a PNG (needs the `bench` extra: matplotlib).")] = None,
        device: Annotated[str | None, typer.Option(
            "--device", help="cpu or cuda (default: cpu; cuda for `gpu`).")] = None,
        tiny: Annotated[bool, typer.Option(
            "--tiny", help="`gpu` only: a tiny shape, so it runs anywhere.")] = False,
    ) -> None:
        """Run a scenario beside its baseline and the machine's limits; print a table."""
        import orjson
        from rich.console import Console

        if scenario not in CHOICES:
            raise fail(f"unknown scenario {scenario!r}; choose one of {', '.join(CHOICES)}", 2)
        if device is not None and device not in ("cpu", "cuda") and not device.startswith(
                "cuda:"):
            raise fail(f"--device must be cpu or cuda, got {device!r}", 2)
        console = Console()
        if scenario == "gpu":
            from sluice.bench.gpu import print_gpu, run_gpu

            doc = run_gpu(device or "cuda", tiny=tiny)
            print_gpu(doc, console)
            results = None
        else:
            from sluice.bench.harness import document
            from sluice.bench.scenarios import failed_scenarios, run_scenarios
            from sluice.bench.table import print_document

            def progress(name: str, result: object) -> None:
                console.print(f"[dim]{name} done in {getattr(result, 'wall_s', 0):.1f} s[/]")

            results = run_scenarios(scenario, device or "cpu", quick, progress)
            doc = document(scenario, device or "cpu", quick, results)
            print_document(doc, console)
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
            console.print(f"wrote {json_out}")
        if plot_out is not None:
            if results is None:
                raise fail("--plot is not available for the gpu scenario", 2)
            from sluice.bench.plot import PlotUnavailableError, render

            try:
                console.print(f"wrote {render(results, plot_out)}")
            except PlotUnavailableError as exc:
                raise fail(str(exc)) from None
        if results is not None and failed_scenarios(results):
            raise fail(f"scenarios failed: {', '.join(failed_scenarios(results))} "
                       "(their errors are in the table and the JSON)")
