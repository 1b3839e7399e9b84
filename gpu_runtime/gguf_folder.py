"""A GGUF file as the model folder the runtime reads, its weights left in the file.

`servable_dir(path)`: a model folder is itself; a `.gguf` file gets a folder in
sluice's cache (`~/.cache/sluice/gguf/<name>-<key>`, the key from the file's path,
size and modification time) holding `config.json`, `generation_config.json` and the
tokenizer files (`tokenizer.json`, `tokenizer_config.json`, the chat template), all
written by transformers from the file's metadata, and `model.gguf`, a link to the
file. `gguf_weights` then reads the tensors from it in their own quantization. The
folder is made whole beside its final name and renamed into place, so a process
stopped half way leaves nothing that looks complete; later calls reuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from gpu_runtime.compiled import sluice_cache_dir
from gpu_runtime.config import SUPPORTED_ARCHITECTURES
from gpu_runtime.errors import ModelLoadError

log = logging.getLogger(__name__)

LINK_NAME = "model.gguf"


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix.lower() == ".gguf" and path.is_file()


def servable_dir(path: str | Path) -> Path:
    """`path` when it is a model folder; for a `.gguf` file, its folder (made once)."""
    path = Path(path).expanduser()
    if not is_gguf_file(path):
        return path
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = sluice_cache_dir("gguf") / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write_metadata(path, staging)
        (staging / LINK_NAME).symlink_to(path)
        try:
            os.rename(staging, folder)
        except OSError:  # another process made it first
            if not (folder / "config.json").is_file():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("the model folder of %s (weights read from the file): %s", path.name, folder)
    return folder


def write_metadata(gguf_file: Path, out: Path) -> str:
    """config.json, generation_config.json and the tokenizer files of `gguf_file` into
    `out` (transformers reads the metadata; no weights are read). Returns the
    architecture's name."""
    try:
        import gguf  # noqa: F401 - transformers needs it; say so before its own error
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise ModelLoadError(f"a GGUF file's config and tokenizer are read with transformers "
                             f"and gguf ({exc}): pip install 'sluice-engine[gguf]'") from None
    hf_logging.disable_progress_bar()
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"transformers could not read {gguf_file}: {exc}") from None
    architecture = (config.architectures or [""])[0] or _architecture(config.model_type)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{name} holds a {architecture or config.model_type}; sluice "
                             f"serves {', '.join(SUPPORTED_ARCHITECTURES)}")
    raw = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        raw.pop(key, None)
    raw["architectures"] = [architecture]
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return architecture


def _architecture(model_type: str) -> str:
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM"}
    return names.get(model_type, "")


def weights_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a model folder serves its weights from, if it has no safetensors."""
    model_dir = Path(model_dir)
    if any(model_dir.glob("*.safetensors")):
        return None
    files = sorted(model_dir.glob("*.gguf"))
    return files[0] if files else None
