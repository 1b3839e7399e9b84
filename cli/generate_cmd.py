"""`sluice generate`: run a model directory locally, no Kafka, and print the tokens."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import orjson
import typer

if TYPE_CHECKING:
    from gpu_runtime import Runtime, SamplingParams

from cli.common import fail


def _parse_ids(raw: str) -> list[int]:
    try:
        ids = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise fail(f"--prompt-ids must be comma-separated integers, got {raw!r}", 2) from None
    if not ids:
        raise fail("--prompt-ids is empty", 2)
    return ids


def _parse_messages(raw: str) -> list[tuple[str, str]]:
    try:
        value = orjson.loads(raw)
        if not isinstance(value, list) or not value:
            raise ValueError("not a non-empty list")
        chat = [(m["role"], m["content"]) for m in value]
        if not all(isinstance(r, str) and isinstance(c, str) for r, c in chat):
            raise ValueError("role and content must be strings")
    except (orjson.JSONDecodeError, ValueError, TypeError, KeyError) as exc:
        raise fail('--messages must be a JSON list of {"role": ..., "content": ...} '
                   f"objects ({exc})", 2) from None
    return chat


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate_cmd(
        model_path: Annotated[
            Path, typer.Option("--model-path", help="Hugging Face model directory, or a .gguf "
                               "file (served in its own quantization).")
        ],
        max_tokens: Annotated[int, typer.Option(
            "--max-tokens", min=1, help="Most tokens to generate.")] = 16,
        prompt_ids: Annotated[str | None, typer.Option("--prompt-ids", help="e.g. 1,2,3")] = None,
        prompt: Annotated[
            str | None, typer.Option("--prompt", help="Text; needs tokenizer.json.")
        ] = None,
        messages: Annotated[str | None, typer.Option(
            "--messages", help='Chat as JSON, [{"role": "user", "content": "..."}], '
            "rendered with the model's chat template.")] = None,
        temperature: Annotated[float | None, typer.Option(
            "--temperature", min=0.0, help="Sampling temperature (0: greedy; default: "
            "the model's generation_config.json, else greedy).")] = None,
        top_p: Annotated[float | None, typer.Option(
            "--top-p", help="Nucleus sampling: keep the smallest set of tokens whose "
            "probability reaches this (1: all; default: the model's).")] = None,
        top_k: Annotated[int | None, typer.Option(
            "--top-k", min=0, help="Sample among the k likeliest tokens (0: all; default: "
            "the model's).")] = None,
        seed: Annotated[int | None, typer.Option(
            "--seed", help="Seed of the request's sampler, for repeatable samples.")] = None,
        quantization: Annotated[str, typer.Option("--quantization", help="none | fp8")] = "none",
        device: Annotated[str, typer.Option("--device", help="cpu | cuda")] = "cpu",
        dtype: Annotated[
            str | None, typer.Option("--dtype", help="float32 | bfloat16 | float16")
        ] = None,
        tp: Annotated[
            int, typer.Option("--tp", min=1, help="Tensor-parallel ranks (GPUs; CPU processes).")
        ] = 1,
        adapter_path: Annotated[
            Path | None, typer.Option("--adapter-path", help="PEFT LoRA adapter directory.")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Generate from a prompt with the local runtime and print the result."""
        from gpu_runtime import RuntimeErrorBase

        if sum(x is not None for x in (prompt_ids, prompt, messages)) != 1:
            raise fail("give exactly one of --prompt-ids, --prompt or --messages", 2)
        chat = _parse_messages(messages) if messages is not None else None
        is_gguf = model_path.suffix.lower() == ".gguf" and model_path.is_file()
        if not is_gguf and not (model_path / "config.json").is_file():
            raise fail(f"no model at {model_path} (no config.json, not a .gguf file)", 2)
        if quantization not in ("none", "fp8"):
            raise fail(f"--quantization must be none or fp8, got {quantization!r}", 2)
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise fail(f"--device must be cpu or cuda, got {device!r}", 2)
        try:
            result = _generate(
                model_path, prompt_ids, prompt, chat, max_tokens, temperature, top_p, top_k,
                seed, quantization, device, dtype, adapter_path, tp,
            )  # fmt: skip
        except RuntimeErrorBase as exc:
            raise fail(str(exc), 2) from None
        if as_json:
            typer.echo(orjson.dumps(result).decode())
        else:
            typer.echo(result["text"] if result["text"] is not None else result["token_ids"])


def _generate(
    model_path: Path,
    prompt_ids: str | None,
    prompt: str | None,
    chat: list[tuple[str, str]] | None,
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    quantization: str,
    device: str,
    dtype: str | None,
    adapter_path: Path | None,
    tp: int,
) -> dict:
    from gpu_runtime import ModelConfig, Runtime, RuntimeConfig, SamplingParams
    from gpu_runtime.gguf_folder import servable_dir
    from gpu_runtime.lora_format import validate_adapter_dir

    model_path = servable_dir(model_path)  # a .gguf file: its folder, weights left in the file
    config = ModelConfig.from_dir(model_path)
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    # Just enough KV cache for this one request, capped by the model's context.
    text_len = len(prompt or "") + sum(len(c) + 64 for _, c in chat or [])
    wanted = (len(ids) if ids else 4 * text_len) + max_tokens + 1
    kv_len = min(wanted, config.max_position_embeddings)
    # One slot exactly as wide as the adapter, or no LoRA layers at all.
    rank = validate_adapter_dir(model_path, adapter_path, 1 << 16).rank if adapter_path else 1
    rt = Runtime(
        model_path,
        RuntimeConfig(
            device=device,
            dtype=dtype,
            kv_cache_len=kv_len,
            quantization=quantization,
            max_adapters=1 if adapter_path else 0,
            max_lora_rank=rank,
            tp=tp,
        ),
    )
    defaults = rt.model_config.sampling_defaults
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        seed=seed,
    )
    with rt:  # stops the helper ranks when tp > 1
        return _run(rt, model_path, ids, prompt, chat, params, adapter_path)


def _run(
    rt: Runtime,
    model_path: Path,
    ids: list[int] | None,
    prompt: str | None,
    chat: list[tuple[str, str]] | None,
    params: SamplingParams,
    adapter_path: Path | None,
) -> dict:
    from gpu_runtime import StepPlan
    from ingest.prompting import PromptBuilder, PromptError

    adapter_key = None
    if adapter_path is not None:
        adapter_key = adapter_path.name or "adapter"
        rt.register_adapter(adapter_key, adapter_path)
    if ids is None:
        if rt.tokenizer is None:
            raise fail(f"--prompt and --messages need {model_path}/tokenizer.json; "
                       "use --prompt-ids", 2)
        # As a request's `prompt` or `messages` become ids on the Kafka path.
        builder = PromptBuilder.for_model(model_path, rt.tokenizer,
                                          rt.model_config.vocab_size)
        try:
            ids = builder.chat(chat).token_ids if chat is not None else builder.text_ids(
                prompt or "")
        except PromptError as exc:
            raise fail(str(exc), 2) from None
    cached = rt.add_sequence("generate", ids, params, adapter_key=adapter_key)
    plan = {"generate": len(ids) - cached}
    generated: list[int] = []
    while True:
        out = rt.execute(StepPlan(plan)).outputs[0]
        generated.append(out.token_id)
        if out.finished:
            break
        plan = {"generate": 1}
    text = rt.tokenizer.decode(generated) if rt.tokenizer is not None else None
    return {
        "prompt_token_ids": ids,
        "token_ids": generated,
        "text": text,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(ids),
        "completion_tokens": len(generated),
    }
