"""cli: the `sluice` command line, the outermost room (thin commands over all the others).

Each command group lives in its own module and registers itself on `app`
through `register(app)`; this module only wires them together. Entry point:
`main` (the `sluice` console script, and `python -m sluice`).

It may import every room below it; nothing imports it.
"""

from __future__ import annotations

import logging

import typer

from cli import (
    batch_cmd,
    bench_cmd,
    chat_cmd,
    demo_cmd,
    gateway_cmd,
    generate_cmd,
    infra_cmd,
    models_cmd,
    registry_cmd,
    replay_cmd,
    schemas_cmd,
    worker_cmd,
)

app = typer.Typer(
    name="sluice",
    help="sluice — a Kafka-native LLM inference engine.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

for module in (infra_cmd, schemas_cmd, models_cmd, registry_cmd, generate_cmd, worker_cmd,
               batch_cmd, replay_cmd, chat_cmd, gateway_cmd, demo_cmd, bench_cmd):
    module.register(app)


def main() -> None:
    # Commands report failures themselves, in one line; the Kafka client's own log lines
    # (retries, "Unable connect to ...") would only repeat them. `sluice worker` sets up
    # its JSON logs, aiokafka's warnings included.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    app()
