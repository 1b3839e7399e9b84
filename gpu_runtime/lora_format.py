"""PEFT LoRA adapter directories: read, validate against a base model, load to host.

An adapter is `adapter_config.json` + `adapter_model.safetensors` as written by
PEFT's `save_pretrained`, tensors named::

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

with `lora_A` [r, in_features] and `lora_B` [out_features, r]. The delta of a
projection is `scale * (x A^T) B^T`, `scale = lora_alpha / r`, or
`lora_alpha / sqrt(r)` with `use_rslora`. Validation needs only config.json
and the safetensors header (`validate_adapter_dir`), so the control plane can
call it without a model on the device.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_runtime.config import ModelConfig, read_json
from gpu_runtime.errors import AdapterError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What an adapter directory holds, validated against one base model."""

    path: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    scale: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora
    target_modules: tuple[str, ...]  # subset of PROJECTIONS, in that order
    layers: tuple[int, ...]  # layers with at least one adapted projection


# (layer, projection) -> (A [r, in] float32, B [out, r] float32, unscaled)
AdapterTensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shape(config: ModelConfig, proj: str) -> tuple[int, int]:
    """(out_features, in_features) of one projection of the base model."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter),
    }[proj]  # fmt: skip


def _read_config(adapter_dir: Path, max_lora_rank: int) -> tuple[int, float, bool]:
    """(rank, lora_alpha, use_rslora) from adapter_config.json, after the checks."""
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{adapter_dir} is not a PEFT LoRA adapter: no {CONFIG_FILE}")
    raw = read_json(path, AdapterError)
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {raw['peft_type']!r} is not LORA")
    unsupported = [
        k for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern") if raw.get(k)
    ]
    if raw.get("bias", "none") != "none":
        unsupported.append("bias")
    if raw.get("fan_in_fan_out"):
        unsupported.append("fan_in_fan_out")
    if unsupported:
        raise AdapterError(f"{path}: unsupported LoRA options {unsupported}")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(PROJECTIONS))
        if bad:
            raise AdapterError(
                f"{path}: unsupported target modules {bad}; supported: {', '.join(PROJECTIONS)}"
            )
    try:
        rank, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{path}: missing or bad r / lora_alpha: {exc}") from exc
    if not 1 <= rank <= max_lora_rank:
        raise AdapterError(
            f"{path}: rank r={rank} exceeds max_lora_rank={max_lora_rank}"
            if rank > max_lora_rank
            else f"{path}: rank r={rank} must be >= 1"
        )
    return rank, alpha, bool(raw.get("use_rslora", False))


def _tensor_shapes(adapter_dir: Path) -> dict[str, tuple[int, ...]]:
    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(f"{adapter_dir} is not a PEFT LoRA adapter: no {WEIGHTS_FILE}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types
        raise AdapterError(f"{path} is not a readable safetensors file: {exc}") from exc


def _check_tensors(
    config: ModelConfig, shapes: dict[str, tuple[int, ...]], rank: int, path: Path
) -> dict[tuple[int, str], tuple[str, str]]:
    """Map (layer, projection) -> (A name, B name); raise on any mismatch."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, shape in shapes.items():
        m = _KEY.match(name)
        if m is None or m.group(2) not in PROJECTIONS:
            raise AdapterError(
                f"{path}: unsupported tensor {name!r}; only LoRA A/B weights of "
                f"{', '.join(PROJECTIONS)} in model.layers.N are supported"
            )
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= config.num_layers:
            raise AdapterError(
                f"{path}: tensor {name!r} is for layer {layer}; "
                f"the base model has {config.num_layers} layers"
            )
        out_f, in_f = projection_shape(config, proj)
        expected = (rank, in_f) if which == "A" else (out_f, rank)
        if shape != expected:
            raise AdapterError(
                f"{path}: tensor {name!r} has shape {list(shape)}, expected {list(expected)} "
                f"(rank {rank}, base {proj} is [{out_f}, {in_f}])"
            )
        found.setdefault((layer, proj), {})[which] = name
    pairs = {}
    for key, names in found.items():
        if set(names) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {key[0]} {key[1]} has lora_A or lora_B only")
        pairs[key] = (names["A"], names["B"])
    if not pairs:
        raise AdapterError(f"{path}: no LoRA weights found")
    return pairs


def _inspect(
    config: ModelConfig, adapter_dir: Path, max_lora_rank: int
) -> tuple[AdapterInfo, dict[tuple[int, str], tuple[str, str]]]:
    rank, alpha, rslora = _read_config(adapter_dir, max_lora_rank)
    pairs = _check_tensors(config, _tensor_shapes(adapter_dir), rank, adapter_dir)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    targets = tuple(p for p in PROJECTIONS if any(k[1] == p for k in pairs))
    info = AdapterInfo(
        adapter_dir, rank, alpha, rslora, scale, targets, tuple(sorted({k[0] for k in pairs}))
    )
    return info, pairs


def validate_adapter_dir(
    model_dir: str | Path, adapter_dir: str | Path, max_lora_rank: int
) -> AdapterInfo:
    """Check an adapter against a base model without loading either; raises `AdapterError`."""
    from gpu_runtime.gguf_folder import servable_dir

    return _inspect(ModelConfig.from_dir(servable_dir(model_dir)), Path(adapter_dir),
                    max_lora_rank)[0]


def load_adapter(
    config: ModelConfig, adapter_dir: str | Path, max_lora_rank: int
) -> tuple[AdapterInfo, AdapterTensors]:
    """Validate, then read every A/B pair as float32 CPU tensors (unscaled)."""
    info, pairs = _inspect(config, Path(adapter_dir), max_lora_rank)
    tensors: AdapterTensors = {}
    with safe_open(str(info.path / WEIGHTS_FILE), framework="pt") as f:
        for key, (a_name, b_name) in pairs.items():
            tensors[key] = (f.get_tensor(a_name).float(), f.get_tensor(b_name).float())
    return info, tensors
