"""`sluice bench SCENARIO`: the harness in `bench` (tables: benchmarks/README.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import fail, friendly_errors

CHOICES = ("runtime", "adapters", "sessions", "deadlines", "startup", "overhead", "kafka",
           "bulk", "gateway", "all", "gpu", "chaos", "cpu")


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
        seed: Annotated[int, typer.Option("--seed", help="`chaos`: the faults' seed.")] = 1,
        requests: Annotated[int, typer.Option(
            "--requests", min=1, help="`chaos`: requests sent.")] = 3000,
        faults: Annotated[int, typer.Option("--faults", min=0, help="`chaos`: faults.")] = 12,
        delivery: Annotated[str, typer.Option(
            "--delivery", help="`chaos`: exactly_once or at_least_once.")] = "exactly_once",
        networked: Annotated[bool, typer.Option(
            "--networked", help="`chaos`: brokers, PostgreSQL and each worker in a network "
            "namespace of its own, and network faults (partitions, loss, a bandwidth cap) "
            "beside the process faults; needs root, `ip` and `nft`.")] = False,
        kinds: Annotated[str | None, typer.Option(
            "--kinds", help="`chaos`: the fault kinds to draw from, comma-separated (default: "
            "every kind the run can make).")] = None,
        model: Annotated[str, typer.Option(
            "--model", help="`kafka`, `bulk`, `gateway`: the model served: tiny (default; "
            "its step is so cheap that Kafka's own cost shows) or smollm2 (the bundled "
            "SmolLM2-135M-Instruct, a real model's step).")] = "tiny",
    ) -> None:
        """Run a scenario beside its baseline and the machine's limits; print a table."""
        import orjson
        from rich.console import Console

        if scenario not in CHOICES:
            raise fail(f"unknown scenario {scenario!r}; choose one of {', '.join(CHOICES)}", 2)
        if model not in ("tiny", "smollm2"):
            raise fail(f"--model must be tiny or smollm2, got {model!r}", 2)
        if device is not None and device not in ("cpu", "cuda") and not device.startswith(
                "cuda:"):
            raise fail(f"--device must be cpu or cuda, got {device!r}", 2)
        console = Console()
        if scenario == "chaos":
            doc = _chaos(console, seed, requests, faults, delivery, networked, kinds)
            results = None
        elif scenario == "gpu":
            from bench.gpu import print_gpu, run_gpu

            doc = run_gpu(device or "cuda", tiny=tiny)
            print_gpu(doc, console)
            results = None
        else:
            from bench.harness import document
            from bench.scenarios import failed_scenarios, run_scenarios
            from bench.table import print_document

            def progress(name: str, result: object) -> None:
                console.print(f"[dim]{name} done in {getattr(result, 'wall_s', 0):.1f} s[/]")

            results = run_scenarios(scenario, device or "cpu", quick, progress, model)
            doc = document(scenario, device or "cpu", quick, results)
            print_document(doc, console)
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
            console.print(f"wrote {json_out}")
        if plot_out is not None:
            if results is None:
                raise fail("--plot is not available for the gpu scenario", 2)
            from bench.plot import PlotUnavailableError, render

            try:
                console.print(f"wrote {render(results, plot_out)}")
            except PlotUnavailableError as exc:
                raise fail(str(exc)) from None
        if scenario == "chaos" and (doc["violations"] or not doc["goals_met"]):
            raise fail(f"chaos: {doc['violations']} violations; goals met: {doc['goals_met']}")
        if results is not None and failed_scenarios(results):
            raise fail(f"scenarios failed: {', '.join(failed_scenarios(results))} "
                       "(their errors are in the table and the JSON)")


def _chaos(console: object, seed: int, requests: int, faults: int, delivery: str,
           networked: bool, kinds: str | None = None) -> dict:
    """A seeded fault run on a cluster of its own (`bench.chaos`), as a document."""
    import asyncio
    import tempfile

    from bench.chaos import SESSION_TIMEOUT_S, ChaosConfig, run_chaos
    from bench.chaos_report import ALL_KINDS, PROCESS_KINDS
    from bench.harness import goal, percentile
    from gpu_runtime.tiny import make_tiny_model
    from infra.netns import unavailable

    if delivery not in ("exactly_once", "at_least_once"):
        raise fail(f"--delivery must be exactly_once or at_least_once, got {delivery!r}", 2)
    if networked and (reason := unavailable()) is not None:
        raise fail(f"--networked: no network namespaces here: {reason}", 2)
    chosen = ALL_KINDS if networked else PROCESS_KINDS
    if kinds is not None:
        chosen = tuple(kind.strip() for kind in kinds.split(",") if kind.strip())
        if not chosen:
            raise fail(f"--kinds names no kind; known: {', '.join(ALL_KINDS)}", 2)
    try:
        config = ChaosConfig(seed=seed, requests=requests, faults=faults, delivery=delivery,
                             networked=networked, kinds=chosen)
    except ValueError as exc:  # a kind unknown, or a network kind without --networked
        raise fail(f"--kinds: {exc}; known: {', '.join(ALL_KINDS)}", 2) from None
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny")
        report = asyncio.run(run_chaos(config, Path(tmp), model, say=console.print))  # type: ignore[attr-defined]
    doc = report.summary()
    p99 = percentile(report.fault_latency_s, 0.99)
    calm_p99 = percentile(report.calm_latency_s, 0.99)
    capacity = [f.capacity_back_s for f in report.faults]
    goals = {
        "no_violation": goal("0 lost, 0 duplicated, no rewind, texts equal", -len(
            report.violations), 0),
        "no_worker_exit": goal("worker exits not caused by the nemesis's own SIGKILL: 0",
                               len(report.worker_exits), 0, higher_is_better=False,
                               unit="exits"),
        "p99_calm": goal("end-to-end p99 with no fault <= 1.5 s", calm_p99, 1.5,
                         higher_is_better=False, unit="s"),
        "p99_during_faults": goal(f"end-to-end p99 during a fault <= session timeout + 2 s "
                                  f"({SESSION_TIMEOUT_S + 2:g} s)", p99,
                                  SESSION_TIMEOUT_S + 2, higher_is_better=False, unit="s"),
        "capacity_back": goal("all workers serving every partition again <= 15 s after "
                              "each fault heals (the slowest)",
                              None if not capacity or None in capacity else max(capacity),
                              15.0, higher_is_better=False, unit="s"),
        "timeouts": goal("`timeout` events <= 0.5 % of requests", doc["timeout_share"] * 100,
                         0.5, higher_is_better=False, unit="%"),
    }
    doc["goals"] = goals
    doc["goals_met"] = all(g["met"] for g in goals.values())
    console.print(doc)  # type: ignore[attr-defined]
    return doc
