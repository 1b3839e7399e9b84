"""`sluice models make-tiny` + `sluice generate --json`, through typer's CliRunner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cli import app


def test_make_tiny_then_generate_json(tmp_path):
    runner = CliRunner()
    model = tmp_path / "tiny"
    res = runner.invoke(app, ["models", "make-tiny", str(model)])
    assert res.exit_code == 0, res.output
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (model / name).is_file()
    res = runner.invoke(
        app,
        [
            "generate",
            "--model-path",
            str(model),
            "--prompt",
            "Hello world",
            "--max-tokens",
            "5",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["finish_reason"] in ("stop", "length")
    assert 1 <= len(out["token_ids"]) <= 5
    assert isinstance(out["text"], str)
    if out["finish_reason"] == "length":
        assert len(out["token_ids"]) == 5
    args = ["generate", "--model-path", str(model), "--prompt-ids", "5,6,7", "--max-tokens", "4"]
    seeded = [*args, "--temperature", "1.0", "--seed", "3", "--json"]
    a, b = runner.invoke(app, seeded), runner.invoke(app, seeded)
    assert a.exit_code == 0 and json.loads(a.stdout) == json.loads(b.stdout)
    assert runner.invoke(app, [*args, "--quantization", "fp8", "--json"]).exit_code == 0

    # --messages: a chat as a request's `messages` becomes ids (this model has no
    # template: the plain framing), and --json shows those ids.
    from tokenizers import Tokenizer

    from ingest.prompting import PromptBuilder

    chat = [{"role": "user", "content": "Hello world"}]
    res = runner.invoke(app, ["generate", "--model-path", str(model), "--messages",
                              json.dumps(chat), "--max-tokens", "3", "--json"])
    assert res.exit_code == 0, res.output
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    builder = PromptBuilder.for_model(model, tok, tok.get_vocab_size())
    assert json.loads(res.stdout)["prompt_token_ids"] == builder.chat(
        [("user", "Hello world")]).token_ids


def test_cli_errors_are_one_line_exit_2(tmp_path):
    runner = CliRunner()
    model = tmp_path / "tiny"
    assert runner.invoke(app, ["models", "make-tiny", str(model)]).exit_code == 0
    cases = [
        ["--model-path", str(tmp_path / "missing"), "--prompt-ids", "1"],
        ["--model-path", str(model), "--prompt-ids", "1,x"],
        ["--model-path", str(model), "--prompt-ids", "1,100000"],
        ["--model-path", str(model)],
        ["--model-path", str(model), "--messages", '{"role": "user"}'],
        ["--model-path", str(model), "--messages", "[]", "--prompt", "x"],
    ]
    for extra in cases:
        res = runner.invoke(app, ["generate", *extra])
        assert res.exit_code == 2, (extra, res.output)
        assert "Traceback" not in res.output
    res = runner.invoke(app, ["generate", *cases[1][:2], "--prompt-ids", "1", "--tp", "3"])
    assert res.exit_code == 2 and "tp=3 does not divide num_attention_heads=4" in res.output
    bad = ["generate", "--model-path", str(model), "--prompt-ids", "1", "--adapter-path"]
    res = runner.invoke(app, [*bad, str(tmp_path)])
    assert res.exit_code == 2 and "adapter_config.json" in res.output


def test_make_tiny_adapters_then_generate_with_adapter(tmp_path):
    runner = CliRunner()
    model = tmp_path / "tiny"
    res = runner.invoke(app, ["models", "make-tiny", str(model), "--adapters", "2"])
    assert res.exit_code == 0, res.output
    args = ["generate", "--model-path", str(model), "--prompt-ids", "5,6,7", "--max-tokens", "4"]
    outs = []
    for extra in ([], ["--adapter-path", str(model / "adapters" / "adapter-0")]):
        res = runner.invoke(app, [*args, *extra, "--json"])
        assert res.exit_code == 0, res.output
        outs.append(json.loads(res.stdout)["token_ids"])
    assert (model / "adapters" / "adapter-1" / "adapter_model.safetensors").is_file()
    assert outs[0] != outs[1]  # the adapter changes the greedy tokens


def test_make_tiny_train_steps_teaches_the_model_its_lines(tmp_path):
    """Training runs through the runtime's own model code; what the model then
    generates (greedy, through the runtime) is the line it was taught."""
    runner = CliRunner()
    model = tmp_path / "taught"
    res = runner.invoke(app, ["models", "make-tiny", str(model), "--train-steps", "150"])
    assert res.exit_code == 0, res.output
    loss = float(res.output.rsplit("final loss ", 1)[1].rstrip(")\n"))
    assert loss < 0.3
    res = runner.invoke(app, ["generate", "--model-path", str(model), "--prompt",
                              "The river runs", "--max-tokens", "24", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["text"] == " from the hills to the sea."
    assert out["finish_reason"] == "stop"  # the eos it was taught to end the line with


def _commands(cmd, path=()):
    subs = getattr(cmd, "commands", None)
    if subs:
        for name, sub in subs.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def test_every_option_is_explained_and_flags_show_no_type() -> None:
    """Each option of each command has help text, and `--help` shows flags as flags
    (typer 0.29 printed a `<bool>` type beside every one)."""
    import typer

    runner = CliRunner()
    commands = list(_commands(typer.main.get_command(app)))
    assert len(commands) > 20
    for name, cmd in commands:
        for param in cmd.params:
            if param.param_type_name == "option":
                assert param.help, f"`sluice {name}` {param.opts[0]} has no help text"
        res = runner.invoke(app, [*name.split(), "--help"], env={"COLUMNS": "160"})
        assert res.exit_code == 0, res.output
        assert "<bool>" not in res.output, f"sluice {name} --help:\n{res.output}"


def test_import_gguf_errors_are_one_line(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["models", "import-gguf", str(tmp_path / "no.gguf"),
                              str(tmp_path / "out")])
    assert res.exit_code == 2 and "no such file" in res.output, res.output
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    res = runner.invoke(app, ["models", "import-gguf", str(tmp_path / "bad.gguf"),
                              str(tmp_path / "taken")])
    assert res.exit_code == 2 and "not an empty folder" in res.output, res.output
    res = runner.invoke(app, ["models", "import-gguf", str(tmp_path / "bad.gguf"),
                              str(tmp_path / "out")])
    assert res.exit_code == 2 and "could not read" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()
