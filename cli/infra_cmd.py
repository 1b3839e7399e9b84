"""`sluice infra up|down|status|env`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, NoReturn

import orjson
import typer
from rich.console import Console
from rich.table import Table

from infra import local
from infra.common import MAX_BROKERS, InfraConfig, InfraError

StateDir = Annotated[
    Path | None, typer.Option("--state-dir", help="Where the broker and database keep state.")
]
KafkaPort = Annotated[int | None, typer.Option("--kafka-port", help="Kafka listener port.")]
ControllerPort = Annotated[
    int | None, typer.Option("--kafka-controller-port", help="KRaft controller port.")
]
PostgresPort = Annotated[int | None, typer.Option("--postgres-port", help="PostgreSQL port.")]
TlsPort = Annotated[int | None, typer.Option(
    "--kafka-tls-port", help="The secure broker's mutual-TLS listener port.")]


def _config(
    state_dir: Path | None, kafka_port: int | None, ctrl: int | None, pg_port: int | None,
    tls_port: int | None = None, secure: bool | None = None, brokers: int | None = None,
) -> InfraConfig:
    try:
        return InfraConfig.from_env(
            state_dir=state_dir, kafka_port=kafka_port, kafka_controller_port=ctrl,
            postgres_port=pg_port, kafka_tls_port=tls_port, secure=secure or None,
            brokers=brokers,
        )
    except InfraError as exc:  # e.g. SLUICE_INFRA_BROKERS out of range
        _fail(exc)


def _fail(exc: InfraError) -> NoReturn:
    Console(stderr=True).print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
    raise typer.Exit(1)


def _print_status(report: dict[str, dict[str, object]]) -> None:
    table = Table("service", "up", "endpoint", "security", "version", "pid")
    for name, info in report.items():
        endpoint = info.get("bootstrap") or _hide_password(str(info.get("url")))
        if info.get("tls_bootstrap"):
            endpoint = f"{endpoint} (mTLS {info['tls_bootstrap']})"
        up = "[green]yes[/]" if info["up"] else "[red]no[/]"
        pid = str(info["pid"] or "-")
        nodes = info.get("nodes")
        if isinstance(nodes, list):  # a cluster: how many of its brokers are live
            live = sum(1 for node in nodes if node["up"])
            if info["up"]:
                up = f"[green]yes[/] ({live}/{len(nodes)} brokers)" if live == len(nodes) \
                    else f"[yellow]yes[/] ({live}/{len(nodes)} brokers)"
            pid = ",".join(str(node["pid"] or "-") for node in nodes)
        security = ("SASL_SSL, ACLs" if name == "kafka" else "TLS only") if info.get("secure") \
            else "plaintext"
        table.add_row(name, up, endpoint, security, str(info["version"]), pid)
    Console().print(table)


def _hide_password(url: str) -> str:
    """The URL as shown in a table: `sluice infra env` is where the password is."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def register(app: typer.Typer) -> None:
    infra = typer.Typer(help="A local Apache Kafka broker or cluster (KRaft) and PostgreSQL.")
    app.add_typer(infra, name="infra")

    @infra.command("up")
    def up_cmd(
        state_dir: StateDir = None, kafka_port: KafkaPort = None,
        kafka_controller_port: ControllerPort = None, postgres_port: PostgresPort = None,
        kafka_tls_port: TlsPort = None,
        secure: Annotated[bool, typer.Option(
            "--secure", help="Kafka with SASL_SSL (SCRAM, user admin) and mutual TLS, ACLs "
            "enforced; PostgreSQL over TLS only (SLUICE_INFRA_SECURE=1). `sluice infra env` "
            "prints the client settings.")] = False,
        brokers: Annotated[int | None, typer.Option(
            "--brokers", min=1, max=MAX_BROKERS,
            help="Kafka nodes (combined broker+controller; SLUICE_INFRA_BROKERS; default 1). "
            "Node k listens 100*k above the first node's ports; with 3 or more, topics are "
            "replicated 3 times with min.insync.replicas=2. Plaintext only.")] = None,
    ) -> None:
        """Start the local broker (or cluster) and database (a no-op for what already
        runs; a cluster's stopped nodes are started again)."""
        cfg = _config(state_dir, kafka_port, kafka_controller_port, postgres_port,
                      kafka_tls_port, secure, brokers)
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
        kafka_tls_port: TlsPort = None,
        mtls: Annotated[bool, typer.Option(
            "--mtls", help="Secure broker: settings for its mutual-TLS listener (client "
            "certificate) instead of SASL_SSL.")] = False,
    ) -> None:
        """Print `export ...` lines for the local infrastructure (eval "$(sluice infra env)"),
        security settings included when it runs --secure."""
        cfg = _config(state_dir, kafka_port, kafka_controller_port, postgres_port,
                      kafka_tls_port)
        try:
            lines = local.env_lines(cfg, mtls)
        except InfraError as exc:
            _fail(exc)
        for line in lines:
            typer.echo(line)
