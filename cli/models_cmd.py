"""`sluice models ...`: the `models` command group, `import-gguf` and `make-tiny`.

The control-plane subcommands (register, update, show, list) come from
`registry_cmd.add_model_commands`; this module owns the group itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli import registry_cmd
from cli.common import fail


def register(app: typer.Typer) -> None:
    models = typer.Typer(help="Models: make a tiny one, register, configure.", no_args_is_help=True)
    app.add_typer(models, name="models")
    registry_cmd.add_model_commands(models)

    @models.command("import-gguf")
    def import_gguf_cmd(
        gguf_file: Annotated[Path, typer.Argument(help="The .gguf file.")],
        directory: Annotated[Path, typer.Argument(help="New folder to write the model into.")],
        dtype: Annotated[str | None, typer.Option(
            "--dtype", help="float32 | bfloat16 | float16: write the weights dequantized "
            "(a GPU serves those). Without it the file's quantization is kept.")] = None,
    ) -> None:
        """Turn a GGUF file into a model folder sluice serves.

        Reads the metadata with transformers and the gguf package; writes config.json,
        generation_config.json and the tokenizer with its chat template, and beside them
        the file itself (model.gguf: served in its own quantization on the CPU), or with
        --dtype the weights dequantized into model.safetensors.
        """
        from modelfiles.gguf_import import GgufImportError, import_gguf

        try:
            import_gguf(gguf_file, directory, dtype=dtype, say=typer.echo)
        except GgufImportError as exc:
            raise fail(str(exc), 2) from None

    @models.command("make-tiny")
    def make_tiny_cmd(
        directory: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
        adapters: Annotated[
            int,
            typer.Option("--adapters", min=0, help="LoRA adapters to write, in DIR/adapters."),
        ] = 0,
        seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
        train_steps: Annotated[
            int,
            typer.Option("--train-steps", min=0,
                         help="Teach the model a short chat first (the demo's; ~150 steps)."),
        ] = 0,
    ) -> None:
        """Write a small random-weight Llama model (Hugging Face format) with a tokenizer.

        With `--adapters N`, also N PEFT LoRA adapters in DIR/adapters/adapter-{i}.
        With `--train-steps N`, the weights are then fitted to a short chat so the
        model answers the demo's questions in plain words.
        """
        from gpu_runtime.tiny import TinySpec, make_tiny_adapters, make_tiny_model

        if directory.exists() and not directory.is_dir():
            raise fail(f"{directory} exists and is not a directory", 2)
        out = make_tiny_model(directory, TinySpec(seed=seed))
        typer.echo(f"wrote a tiny Llama model to {out}")
        if train_steps > 0:
            from modelfiles.tiny_train import train_tiny_model

            loss = train_tiny_model(out, train_steps, seed=seed)
            typer.echo(f"trained it for {train_steps} steps (final loss {loss:.4f})")
        if adapters > 0:
            paths = make_tiny_adapters(out, out / "adapters", adapters)
            typer.echo(f"wrote {len(paths)} LoRA adapters to {out / 'adapters'}")
