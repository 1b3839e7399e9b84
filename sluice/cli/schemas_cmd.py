"""`sluice schemas export DIR`: JSON Schema files for every wire message."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    schemas = typer.Typer(help="The wire formats of sluice's messages.")
    app.add_typer(schemas, name="schemas")

    @schemas.command("export")
    def export_cmd(
        directory: Annotated[Path, typer.Argument(help="Folder to write *.schema.json into.")],
    ) -> None:
        """Write one JSON Schema file per message type."""
        from schemas.export import export_json_schemas

        for path in export_json_schemas(directory):
            typer.echo(str(path))
