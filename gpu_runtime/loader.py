"""Load a Hugging Face model directory into `CausalLM` with one copy of the weights.

The module tree is built on the `meta` device (no memory), each tensor is read
from the safetensors files (memory-mapped) straight onto the target device
and dtype, and `load_state_dict(assign=True)` makes those tensors the
parameters. Sharded checkpoints (`model.safetensors.index.json`) and single
files both work.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_runtime.config import ModelConfig
from gpu_runtime.errors import ModelLoadError
from gpu_runtime.model import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ModelLoadError(f"no safetensors weights in {model_dir} (missing: {missing or 'all'})")
    return files


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
) -> CausalLM:
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = set(model.state_dict().keys())
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name in expected:
                    state[name] = f.get_tensor(name).to(dtype)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(expected - state.keys())
    if missing:
        raise ModelLoadError(
            f"checkpoint in {model_dir} lacks {len(missing)} tensors: {missing[:4]}"
        )
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(
            f"checkpoint in {model_dir} does not match config.json: {exc}"
        ) from exc
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
