"""`sluice replay --model M --from TIME|OFFSETS [--to ...] -o OUT.jsonl`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from cli.common import fail, friendly_errors, progress_bar

RANGE_HELP = ("an ISO-8601 date-time (2024-05-24T10:00:00Z; without a zone, local time), "
              "epoch milliseconds, a time before now (-24h, -30m, -2d), or offsets P:O,P:O")


def register(app: typer.Typer) -> None:
    @app.command("replay")
    @friendly_errors
    def replay_cmd(
        model: Annotated[str, typer.Option(
            "--model", help="The model whose request topic is replayed.")],
        start: Annotated[str, typer.Option(
            "--from", help=f"Where to start: {RANGE_HELP}, or `earliest`. With offsets, "
            "only the partitions named are replayed.")],
        out_path: Annotated[Path, typer.Option("-o", "--output", help="Output JSONL.")],
        stop: Annotated[str | None, typer.Option(
            "--to", help=f"Where to stop (exclusive): {RANGE_HELP}; partitions not named "
            "read to their end. Default and cap: the end at the moment replay starts.")] = None,
        as_model: Annotated[str | None, typer.Option(
            "--as-model", help="Send the requests to this model (default: --model).")] = None,
        adapter: Annotated[str | None, typer.Option(
            "--adapter", help="Replace each request's adapter with this one.")] = None,
        base: Annotated[bool, typer.Option(
            "--base", help="Run every request on the base model (no adapter).")] = False,
        original_replies: Annotated[str | None, typer.Option(
            "--original-replies", help="Reply topic of the original requests: each line "
            "gets its original `done` event and whether the answer changed.")] = None,
        api_key: Annotated[str | None, typer.Option(
            "--api-key", help="The replayer's API key (default: SLUICE_API_KEY); the "
            "original requests' keys are never used.")] = None,
        concurrency: Annotated[int, typer.Option(
            "--concurrency", min=1, help="Requests in flight at once.")] = 64,
        timeout: Annotated[float | None, typer.Option(
            "--timeout", min=0.001, help="Seconds to wait for each answer (default: "
            "SLUICE_CLIENT__REQUEST_TIMEOUT_SECS); a request without one gets no output "
            "line and is retried by the next run.")] = None,
    ) -> None:
        """Re-run requests recorded on a model's request topic against another model or
        adapter, pairing each original with the new answer in OUT. Reads the topic without
        joining the workers' consumer group. Resumable: a re-run skips records answered in
        OUT and retries those that failed. Exits 1 when any replayed request has no answer."""
        import uvloop

        from schemas.names import NameError_
        from sluice.client import Client
        from sluice.replay import ReplayInputError, ReplaySummary, run_replay
        from sluice.replay_source import parse_position

        if adapter is not None and base:
            raise fail("give --adapter or --base, not both", 2)
        try:
            start_at = parse_position(start)
            stop_at = parse_position(stop) if stop is not None else None
        except ReplayInputError as exc:
            raise fail(str(exc), 2) from None
        key = api_key or os.environ.get("SLUICE_API_KEY")
        summary = ReplaySummary()

        async def main() -> None:
            client = Client()
            try:
                with progress_bar() as progress:
                    task = progress.add_task("replay", total=None)

                    def phase(description: str, total: int | None) -> None:
                        progress.update(task, description=description, total=total,
                                        completed=0)

                    await run_replay(
                        client, out_path, model=model, start=start_at, stop=stop_at,
                        as_model=as_model, adapter=adapter, base=base,
                        original_replies=original_replies, api_key=key,
                        concurrency=concurrency, timeout_s=timeout, summary=summary,
                        on_phase=phase, on_progress=lambda n: progress.advance(task, n),
                    )
            finally:
                await client.aclose()

        try:
            uvloop.run(main())
        except (ReplayInputError, NameError_) as exc:
            raise fail(str(exc), 2) from None
        except KeyboardInterrupt:
            flags = summary.resume_flags()
            again = (f"to continue over exactly this range, run it again with {flags}" if flags
                     else "run the same command again to continue")
            typer.echo(f"interrupted: {summary.num_handled} records handled this run "
                       f"({summary.num_done} done, {summary.num_errors} errors, written to "
                       f"{out_path}); {again}", err=True)
            raise typer.Exit(130) from None
        typer.echo(summary.line())
        if summary.failed:
            typer.echo(f"some replayed requests have no answer (an error line in {out_path}, "
                       "or no line when none came in time); a re-run retries them", err=True)
            raise typer.Exit(1)
