"""`sluice batch IN.jsonl --model KEY -o OUT.jsonl [--format sluice|openai]`."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cli.common import fail, friendly_errors, progress_bar


class FileFormat(StrEnum):
    sluice = "sluice"
    openai = "openai"


def register(app: typer.Typer) -> None:
    @app.command("batch")
    @friendly_errors
    def batch_cmd(
        in_path: Annotated[Path, typer.Argument(
            help="Input JSONL: {custom_id, body} lines (with --format openai: OpenAI Batch "
            "API lines).")],
        model: Annotated[str, typer.Option("--model", help="The model's key (with --format "
                                           "openai, MODEL or MODEL:ADAPTER: the model of "
                                           "lines whose body names none).")],
        out_path: Annotated[Path, typer.Option("-o", "--output", help="Output JSONL.")],
        api_key: Annotated[str | None, typer.Option(
            "--api-key", help="API key (default: SLUICE_API_KEY).")] = None,
        concurrency: Annotated[str, typer.Option(
            "--concurrency", help="Requests in flight at once: a number, or auto (sized "
            "from the rate answers come back at, so the workers' batches stay full and "
            "nothing waits in the queue longer than ~20 s).")] = "auto",
        timeout: Annotated[float | None, typer.Option(
            "--timeout", min=0.001, help="Seconds to wait for each line's answer (default: "
            "SLUICE_CLIENT__REQUEST_TIMEOUT_SECS); a line without one gets no output line "
            "and is retried by the next run.")] = None,
        keep_errors: Annotated[bool, typer.Option(
            "--keep-errors", help="Keep lines that ended in an error or timeout instead of "
            "retrying them.")] = False,
        file_format: Annotated[FileFormat, typer.Option(
            "--format", help="sluice: {custom_id, body: <request fields>} lines in, "
            "{custom_id, response: <done event>, error} out. openai: OpenAI Batch API lines "
            "(/v1/chat/completions, /v1/completions) in and out.")] = FileFormat.sluice,
    ) -> None:
        """Run every line of IN through the model. Resumable: a re-run skips ids answered
        in OUT and retries those that failed. Exits 1 when any line has no answer."""
        import uvloop

        from gateway.openai_api import split_model
        from gateway.openai_batch import OpenAIFormat
        from sluice.batch import BatchSummary, LineFormat, SluiceFormat, run_batch
        from sluice.client import Client

        if not in_path.is_file():
            raise fail(f"no input file at {in_path}", 2)
        in_flight = _concurrency(concurrency)
        line_format: LineFormat = SluiceFormat()
        if file_format is FileFormat.openai:
            line_format = OpenAIFormat(model)
            model = split_model(model)[0]  # the adapter only picks the lines' default
        key = api_key or os.environ.get("SLUICE_API_KEY")
        summary = BatchSummary()

        async def main() -> None:
            client = Client()
            try:
                with progress_bar() as progress:
                    task = progress.add_task("batch", total=None)
                    await run_batch(
                        client, in_path, out_path, model=model, api_key=key,
                        concurrency=in_flight, timeout_s=timeout, keep_errors=keep_errors,
                        summary=summary, on_progress=lambda n: progress.advance(task, n),
                        on_total=lambda n: progress.update(task, total=n),
                        line_format=line_format,
                    )
            finally:
                await client.aclose()

        try:
            uvloop.run(main())
        except KeyboardInterrupt:
            typer.echo(f"interrupted: {summary.num_finished} of {summary.num_todo} lines "
                       f"finished this run ({summary.num_done} done, {summary.num_errors} "
                       f"errors) and written to {out_path}; run the same command again to "
                       "continue where it stopped", err=True)
            raise typer.Exit(130) from None
        for problem in summary.invalid_lines[:20]:
            typer.echo(f"skipped invalid input {problem}", err=True)
        typer.echo(summary.line())
        if summary.failed:
            typer.echo(f"some lines have no answer (see {line_format.errors_hint} in "
                       f"{out_path}); a re-run retries them"
                       + ("" if not keep_errors else " without --keep-errors"), err=True)
            raise typer.Exit(1)


def _concurrency(value: str) -> int | None:
    """--concurrency: None for auto, else a positive number."""
    if value.strip().lower() == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise fail(f"--concurrency must be auto or a number >= 1, got {value!r}", 2)
    return number
