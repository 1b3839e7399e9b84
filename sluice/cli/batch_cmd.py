"""`sluice batch IN.jsonl --model KEY -o OUT.jsonl`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from sluice.cli.common import fail, friendly_errors


def register(app: typer.Typer) -> None:
    @app.command("batch")
    @friendly_errors
    def batch_cmd(
        in_path: Annotated[Path, typer.Argument(help="Input JSONL: {custom_id, body} lines.")],
        model: Annotated[str, typer.Option("--model", help="The model's key.")],
        out_path: Annotated[Path, typer.Option("-o", "--output", help="Output JSONL.")],
        api_key: Annotated[str | None, typer.Option(
            "--api-key", help="API key (default: SLUICE_API_KEY).")] = None,
        concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 64,
    ) -> None:
        """Run every line of IN through the model; resumable (skips ids already in OUT)."""
        import uvloop
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        from sluice.batch import run_batch
        from sluice.client import Client

        if not in_path.is_file():
            raise fail(f"no input file at {in_path}", 2)
        key = api_key or os.environ.get("SLUICE_API_KEY")

        async def main() -> None:
            client = Client()
            try:
                with Progress("[progress.description]{task.description}", BarColumn(),
                              MofNCompleteColumn(), TimeRemainingColumn()) as progress:
                    task = progress.add_task("batch", total=None)
                    summary = await run_batch(
                        client, in_path, out_path, model=model, api_key=key,
                        concurrency=concurrency,
                        on_progress=lambda n: progress.advance(task, n),
                        on_total=lambda n: progress.update(task, total=n),
                    )
            finally:
                await client.aclose()
            for problem in summary.invalid_lines[:20]:
                typer.echo(f"skipped invalid input {problem}", err=True)
            typer.echo(summary.line())

        uvloop.run(main())
