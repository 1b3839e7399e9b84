"""`sluice gateway [--host H] [--port P]`: the OpenAI-compatible HTTP API."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import friendly_errors


def register(app: typer.Typer) -> None:
    @app.command("gateway")
    @friendly_errors
    def gateway_cmd(
        host: Annotated[str, typer.Option("--host", help="Address to listen on.")]
        = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")]
        = 8000,
        instance_id: Annotated[str | None, typer.Option(
            "--instance-id", help="Names this gateway's reply topic <prefix>.gateway.<id> "
            "(default: host name and a random suffix).")] = None,
        log_level: Annotated[str, typer.Option(
            "--log-level", help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
    ) -> None:
        """Serve OpenAI's /v1/chat/completions, /v1/completions and /v1/models over
        the topics; the bearer token is a sluice API key."""
        import uvloop

        from common.logs import setup_logging
        from common.settings import Settings
        from gateway.app import serve

        setup_logging(log_level)
        settings = Settings.load()
        typer.echo(f"sluice gateway on http://{host}:{port}/v1", err=True)
        uvloop.run(serve(settings, host, port, instance_id))
