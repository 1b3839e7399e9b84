"""`sluice models import-gguf`: a GGUF file as a Hugging Face model directory sluice serves.

transformers reads GGUF (with the `gguf` package) and dequantizes the weights;
it refuses to save a model loaded that way, so the weights are written here with
safetensors, beside the config, the generation config and the tokenizer files
(`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) it rebuilt
from the file's metadata. With `dtype` the result is plain float weights
(what a GPU serves); without it the folder keeps the file itself as `model.gguf`
beside the metadata, served in its own quantization (gpu_runtime/gguf_weights.py).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.config import SUPPORTED_ARCHITECTURES


class GgufImportError(ValueError):
    pass


def import_gguf(gguf_file: Path, out_dir: Path, *, dtype: str | None = None,
                say: Callable[[str], None] = print) -> Path:
    """Writes the model to `out_dir` (made whole in a temporary folder beside it first,
    so an interrupted import never leaves a half model that looks complete). dtype None:
    the file's quantization kept; else its weights dequantized to that dtype."""
    if dtype is None:
        return _import_quantized(gguf_file, out_dir, say)
    try:
        import gguf  # noqa: F401 - transformers needs it; say so before its own error
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise GgufImportError(f"import-gguf needs the gguf package ({exc}); "
                              "pip install gguf") from None
    gguf_file = gguf_file.resolve()
    if not gguf_file.is_file():
        raise GgufImportError(f"no such file: {gguf_file}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise GgufImportError(f"{out_dir} is not an empty folder; choose a new one")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise GgufImportError(f"--dtype must be float32, bfloat16 or float16, not {dtype!r}")
    folder, name = str(gguf_file.parent), gguf_file.name
    say(f"reading the tokenizer of {name}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        say("reading and dequantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch_dtype)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise GgufImportError(f"transformers could not read {gguf_file}: {exc}") from None
    architecture = type(model).__name__
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GgufImportError(f"{name} holds a {architecture}; sluice serves "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
    try:
        say("writing the weights with safetensors")
        _write(model, tokenizer, staging, save_file)
        if out_dir.exists():
            out_dir.rmdir()  # empty: checked above
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(f"wrote {architecture} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
        f"parameters, {dtype}) to {out_dir}")
    return out_dir


def _write(model, tokenizer, out: Path, save_file) -> None:
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain floats
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the embedding is the output layer
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def _import_quantized(gguf_file: Path, out_dir: Path, say: Callable[[str], None]) -> Path:
    """The metadata's files and the GGUF itself (a hard link where the file system
    allows, else a copy) as `model.gguf`."""
    import os

    from gpu_runtime.errors import ModelLoadError
    from gpu_runtime.gguf_folder import LINK_NAME, write_metadata

    gguf_file = gguf_file.resolve()
    if not gguf_file.is_file():
        raise GgufImportError(f"no such file: {gguf_file}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise GgufImportError(f"{out_dir} is not an empty folder; choose a new one")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        say(f"reading the config and tokenizer of {gguf_file.name}")
        try:
            architecture = write_metadata(gguf_file, staging)
        except ModelLoadError as exc:
            raise GgufImportError(str(exc)) from None
        try:
            os.link(gguf_file, staging / LINK_NAME)
        except OSError:  # another file system, or links refused: a copy
            say("copying the file")
            shutil.copyfile(gguf_file, staging / LINK_NAME)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(f"wrote {architecture} to {out_dir} (weights in {LINK_NAME}, quantization kept)")
    return out_dir
