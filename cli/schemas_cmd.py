"""`sluice schemas export DIR [--asyncapi]`: JSON Schema files for every wire message,
and an AsyncAPI 3.0 document of the topics."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from schemas.asyncapi import TopicFacts


def topic_facts() -> dict[str, TopicFacts]:
    """What sluice creates its shared topics with, by role (a model's request topic gets
    its partition count at registration, so only its configs are known)."""
    from common.settings import Settings
    from common.topics import request_topic, shared_topics
    from schemas.asyncapi import TopicFacts

    settings = Settings()
    prefix = settings.topic("")
    facts = {spec.name.removeprefix(prefix): TopicFacts(spec.partitions, spec.configs)
             for spec in shared_topics(settings)}
    facts["requests"] = TopicFacts(None, request_topic(settings, "model").configs)
    return facts


def register(app: typer.Typer) -> None:
    schemas = typer.Typer(help="The wire formats of sluice's messages.")
    app.add_typer(schemas, name="schemas")

    @schemas.command("export")
    def export_cmd(
        directory: Annotated[Path, typer.Argument(help="Folder to write *.schema.json into.")],
        asyncapi: Annotated[bool, typer.Option(
            "--asyncapi", help="Also write asyncapi.json: an AsyncAPI 3.0 document of the "
                               "topics, their keys, headers and messages.")] = False,
    ) -> None:
        """Write one JSON Schema file per message type (a description on every field)."""
        from schemas.export import export_asyncapi, export_json_schemas

        for path in export_json_schemas(directory):
            typer.echo(str(path))
        if asyncapi:
            typer.echo(str(export_asyncapi(directory, topic_facts())))
