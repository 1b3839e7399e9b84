"""`sluice infra up|down|status|env`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import orjson
import typer
from rich.console import Console
from rich.table import Table

from infra import local
from infra.common import InfraConfig, InfraError

StateDir = Annotated[
    Path | None, typer.Option("--state-dir", help="Where the broker and database keep state.")
]
KafkaPort = Annotated[int | None, typer.Option("--kafka-port", help="Kafka listener port.")]
ControllerPort = Annotated[
    int | None, typer.Option("--kafka-controller-port", help="KRaft controller port.")
]
PostgresPort = Annotated[int | None, typer.Option("--postgres-port", help="PostgreSQL port.")]


def _config(
    state_dir: Path | None, kafka_port: int | None, ctrl: int | None, pg_port: int | None
) -> InfraConfig:
    return InfraConfig.from_env(
        state_dir=state_dir, kafka_port=kafka_port, kafka_controller_port=ctrl,
        postgres_port=pg_port,
    )


def _fail(exc: InfraError) -> None:
    Console(stderr=True).print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
    raise typer.Exit(1)


def _print_status(report: dict[str, dict[str, object]]) -> None:
    table = Table("service", "up", "endpoint", "version", "pid")
    for name, info in report.items():
        endpoint = info.get("bootstrap") or info.get("url")
        up = "[green]yes[/]" if info["up"] else "[red]no[/]"
        table.add_row(name, up, str(endpoint), str(info["version"]), str(info["pid"] or "-"))
    Console().print(table)


def register(app: typer.Typer) -> None:
    infra = typer.Typer(help="A local Apache Kafka broker (KRaft) and PostgreSQL.")
    app.add_typer(infra, name="infra")

    @infra.command("up")
    def up_cmd(
        state_dir: StateDir = None, kafka_port: KafkaPort = None,
        kafka_controller_port: ControllerPort = None, postgres_port: PostgresPort = None,
    ) -> None:
        """Start the local broker and database (a no-op for what already runs)."""
        cfg = _config(state_dir, kafka_port, kafka_controller_port, postgres_port)
        started = time.monotonic()
        try:
            report = local.up(cfg)
        except InfraError as exc:
            _fail(exc)
        _print_status(report)
        Console().print(f"ready in {time.monotonic() - started:.1f} s; state in {cfg.state_dir}")

    @infra.command("down")
    def down_cmd(
        state_dir: StateDir = None, kafka_port: KafkaPort = None,
        kafka_controller_port: ControllerPort = None, postgres_port: PostgresPort = None,
        purge: Annotated[bool, typer.Option(
            "--purge", help="Also delete their data: every topic, message and database.",
        )] = False,
    ) -> None:
        """Stop the broker and database that `up` started (by their PIDs)."""
        cfg = _config(state_dir, kafka_port, kafka_controller_port, postgres_port)
        stopped = local.down(cfg)
        for name, was_running in stopped.items():
            Console().print(f"{name}: {'stopped' if was_running else 'was not running'}")
        if purge:
            for name, had_data in local.purge(cfg).items():
                Console().print(f"{name}: {'data deleted' if had_data else 'had no data'}")

    @infra.command("status")
    def status_cmd(
        state_dir: StateDir = None, kafka_port: KafkaPort = None,
        kafka_controller_port: ControllerPort = None, postgres_port: PostgresPort = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Whether the local broker and database are up, and where."""
        cfg = _config(state_dir, kafka_port, kafka_controller_port, postgres_port)
        report = local.status(cfg)
        if as_json:
            typer.echo(orjson.dumps(report).decode())
        else:
            _print_status(report)

    @infra.command("env")
    def env_cmd(
        state_dir: StateDir = None, kafka_port: KafkaPort = None,
        kafka_controller_port: ControllerPort = None, postgres_port: PostgresPort = None,
    ) -> None:
        """Print `export ...` lines for the local infrastructure (eval "$(sluice infra env)")."""
        cfg = _config(state_dir, kafka_port, kafka_controller_port, postgres_port)
        for line in local.env_lines(cfg):
            typer.echo(line)
