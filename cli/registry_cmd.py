"""Control-plane commands: `sluice models register|update-compute-config|update|show|list`,
`sluice adapters ...` and `sluice keys ...`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import orjson
import typer
from rich.console import Console
from rich.table import Table

from cli.common import friendly_errors, parse_assignments

if TYPE_CHECKING:
    from schemas import ModelDeployment
    from sluice.client import Client

ModelOpt = Annotated[str, typer.Option("--model", help="The model's key.")]


def _client() -> Client:
    # Imported lazily: the SDK pulls in Kafka and PostgreSQL clients.
    import sluice

    return sluice.Client()


def _print_deployment(dep: ModelDeployment) -> None:
    typer.echo(orjson.dumps(dep.model_dump(mode="json"), option=orjson.OPT_INDENT_2).decode())


def add_model_commands(models: typer.Typer) -> None:
    @models.command("register")
    @friendly_errors
    def register_cmd(
        model: ModelOpt,
        path: Annotated[str, typer.Option("--path", help=(
            "Hugging Face model directory, or a .gguf file (served in its own quantization)."))],
        partitions: Annotated[int | None, typer.Option(
            "--partitions", help="Request-topic partitions (SLUICE_REQUEST_PARTITIONS).")]
        = None,
    ) -> None:
        """Register a model: creates its request topic and publishes its deployment."""
        with _client() as client:
            _print_deployment(client.models.register(model=model, path=path,
                                                     partitions=partitions))

    @models.command("update-compute-config")
    @friendly_errors
    def update_compute_config_cmd(
        model: ModelOpt,
        assignments: Annotated[list[str], typer.Option(
            "--set", help="NAME=VALUE: kv_cache_len, tp, max_adapters, max_lora_rank, "
            "quantization (none|fp8), dtype.")],
    ) -> None:
        """Change a model's compute config while it serves."""
        changes = parse_assignments(assignments)
        with _client() as client:
            _print_deployment(client.models.update_compute_config(model=model,
                                                                  compute_config=changes))

    @models.command("update")
    @friendly_errors
    def update_cmd(
        model: ModelOpt,
        pools: Annotated[str | None, typer.Option(
            "--pools", help="Compute pools that serve the model, comma-separated.")] = None,
        max_ttft_ms: Annotated[int | None, typer.Option(
            "--max-ttft-ms", help="Longest wait for a first token, queue time included.")]
        = None,
    ) -> None:
        """Change a model's placement: compute pools and max time to first token."""
        placement: dict[str, object] = {}
        if pools is not None:
            placement["compute_pools"] = [p.strip() for p in pools.split(",") if p.strip()]
        if max_ttft_ms is not None:
            placement["max_ttft_ms"] = max_ttft_ms
        with _client() as client:
            dep = client.models.update(model=model, placement=placement)
            _print_deployment(dep)
            new_pools = list(dep.placement.compute_pools)
            if not any(w.live for w in client.workers.list(model=model, pools=new_pools)):
                Console(stderr=True).print(
                    f"[yellow]warning:[/] no live worker of {model} is in pools "
                    f"{', '.join(new_pools)}: its requests wait until one starts there "
                    f"(`sluice worker --model {model} --pool {new_pools[0]}`)", highlight=False)

    @models.command("remove")
    @friendly_errors
    def remove_cmd(
        model: ModelOpt,
        keep_topic: Annotated[bool, typer.Option(
            "--keep-topic", help="Keep the request topic (and any requests still on it).")]
        = False,
    ) -> None:
        """Remove a model: its registry entry, adapters, grants and request topic."""
        with _client() as client:
            client.models.remove(model=model, keep_topic=keep_topic)
        typer.echo(f"removed model {model}" + ("" if keep_topic else " and its request topic"))

    @models.command("show")
    @friendly_errors
    def show_cmd(model: ModelOpt) -> None:
        """Print a model's deployment as JSON."""
        with _client() as client:
            _print_deployment(client.models.show(model=model))

    @models.command("list")
    @friendly_errors
    def list_cmd() -> None:
        """List registered models."""
        table = Table("model", "rev", "pools", "tp", "kv_cache_len", "quant", "adapters")
        with _client() as client:
            for dep in client.models.list():
                cc = dep.compute_config
                table.add_row(dep.model, str(dep.revision), ",".join(dep.placement.compute_pools),
                              str(cc.tp), str(cc.kv_cache_len), cc.quantization,
                              str(len(dep.adapters)))
        Console().print(table)


def _models_group(app: typer.Typer) -> typer.Typer:
    """The `sluice models` group (made by models_cmd), or a new one."""
    for group in app.registered_groups:
        if group.name == "models" and group.typer_instance is not None:
            return group.typer_instance
    models = typer.Typer(help="Models: register and configure.", no_args_is_help=True)
    app.add_typer(models, name="models")
    return models


def register(app: typer.Typer) -> None:
    add_model_commands(_models_group(app))

    @app.command("workers")
    @friendly_errors
    def workers_cmd(
        model: Annotated[str | None, typer.Option("--model", help="Only this model's.")]
        = None,
        show_all: Annotated[bool, typer.Option(
            "--all", help="Also workers not seen in the last minute.")] = False,
    ) -> None:
        """List workers by their heartbeats: where they run and when they were last seen."""
        table = Table("instance", "model", "pool", "status", "device", "memory GiB",
                      "process", "last seen", "live")
        with _client() as client:
            workers = [w for w in client.workers.list(model=model) if show_all or w.live]
        for w in workers:
            table.add_row(w.instance_id, w.model, w.pool, w.status, w.device,
                          f"{w.device_memory_bytes / 2**30:.1f}", w.process,
                          w.last_seen.strftime("%Y-%m-%d %H:%M:%S"), "yes" if w.live else "no")
        Console().print(table)
        if not workers:
            what = f" of model {model}" if model else ""
            Console(stderr=True).print(f"no live worker{what}; start one with `sluice worker "
                                       f"--model {model or 'KEY'}`", highlight=False)
    adapters = typer.Typer(help="LoRA adapters of a registered model.", no_args_is_help=True)
    keys = typer.Typer(help="API keys and their grants.", no_args_is_help=True)
    app.add_typer(adapters, name="adapters")
    app.add_typer(keys, name="keys")

    @adapters.command("register")
    @friendly_errors
    def adapter_register_cmd(
        model: ModelOpt,
        name: Annotated[str, typer.Option("--name", help="The adapter's name in requests.")],
        path: Annotated[str, typer.Option("--path", help="PEFT LoRA adapter directory.")],
    ) -> None:
        """Register a PEFT LoRA adapter (refused past the model's max_adapters)."""
        with _client() as client:
            client.adapters.register(model=model, name=name, path=path)
        typer.echo(f"registered adapter {name} of {model}")

    @adapters.command("list")
    @friendly_errors
    def adapter_list_cmd(model: ModelOpt) -> None:
        """List a model's adapters."""
        with _client() as client:
            for adapter in client.adapters.list(model=model):
                typer.echo(f"{adapter.name}\t{adapter.path}")

    @adapters.command("remove")
    @friendly_errors
    def adapter_remove_cmd(
        model: ModelOpt,
        name: Annotated[str, typer.Option("--name", help="The adapter's name.")],
    ) -> None:
        """Remove an adapter from a model."""
        with _client() as client:
            client.adapters.remove(model=model, name=name)
        typer.echo(f"removed adapter {name} of {model}")

    @keys.command("create")
    @friendly_errors
    def key_create_cmd(
        tenant: Annotated[str, typer.Option("--tenant", help="Who the key belongs to.")],
        reply_prefix: Annotated[str | None, typer.Option(
            "--reply-prefix", help="Only allow reply topics starting with this.")] = None,
    ) -> None:
        """Create an API key; prints the key alone (it is shown only once)."""
        with _client() as client:
            typer.echo(client.keys.create(tenant=tenant, reply_topic_prefix=reply_prefix))

    @keys.command("grant")
    @friendly_errors
    def key_grant_cmd(
        key: Annotated[str, typer.Option("--key", help="The key, or its id.")],
        model: ModelOpt,
        adapter: Annotated[str | None, typer.Option(
            "--adapter", help="Grant this adapter of the model (default: the base model); "
            "grant each adapter a key may use.")] = None,
    ) -> None:
        """Allow a key to use a model (its base) or one adapter of it."""
        with _client() as client:
            client.keys.grant(key, model=model, adapter=adapter)
        typer.echo("granted")

    @keys.command("revoke")
    @friendly_errors
    def key_revoke_cmd(
        key: Annotated[str, typer.Option("--key", help="The key, or its id.")],
    ) -> None:
        """Revoke a key; every worker refuses it within a second."""
        with _client() as client:
            client.keys.revoke(key)
        typer.echo("revoked")
