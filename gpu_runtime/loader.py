"""Load a Hugging Face model directory into `CausalLM` with one copy of the weights.

The module tree is built on the `meta` device (no memory), each tensor is read
from the safetensors files (memory-mapped) straight onto the target device
and dtype, and `load_state_dict(assign=True)` makes those tensors the
parameters. Sharded checkpoints (`model.safetensors.index.json`) and single
files both work.

Under tensor parallelism (`layout` given) the tree is built with this rank's
shapes (`ShardLayout.local_config`, vocab-parallel embeddings and LM head) and
each tensor is read through `get_slice`, only the rows or columns this rank
holds (`parallel.py`): a rank never holds the whole model.

With FP8 the projections are built as empty `FP8Linear`s and each weight is
quantized as it is read, so loading peaks at the FP8 model plus one
full-precision tensor, not at the full-precision model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from gpu_runtime.config import ModelConfig
from gpu_runtime.errors import ModelLoadError
from gpu_runtime.fp8 import fp8_shells, quantize_per_channel
from gpu_runtime.gguf_folder import weights_file
from gpu_runtime.gguf_weights import load_gguf_model
from gpu_runtime.model import CausalLM
from gpu_runtime.parallel import ShardLayout, use_vocab_parallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_dtype(config: ModelConfig, device: torch.device | str,
                  native_bf16: bool | None = None) -> str:
    """What `dtype: auto` serves. CUDA: the checkpoint's 16-bit dtype (bfloat16 for a
    float32 one). CPU: bfloat16 for a bfloat16 checkpoint where the CPU multiplies
    bf16 natively (`native_bf16`; None: this machine's CPU, `cpu_has_native_bf16`),
    else float32 (a float16 or float32 checkpoint, or a CPU that would emulate bf16).
    Measured (SmolLM2-135M, 2 threads, `sluice bench cpu`): bf16 1.5-1.7x float32
    at batch 1, prefill and 8 or 32 sequences (benchmarks/README.md)."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind == "cpu":
        native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
        return "bfloat16" if config.torch_dtype == "bfloat16" and native else "float32"
    return config.torch_dtype if config.torch_dtype in ("bfloat16", "float16") else "bfloat16"


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX tiles, as torch reads the CPU."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes: assume emulation
        return False


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
    layout: ShardLayout | None = None,
    group: dist.ProcessGroup | None = None,
    quantization: str = "none",
) -> CausalLM:
    """The model, or with `layout` (and the ranks' `group`) this rank's shard of it.

    With `quantization="fp8"` each projection's weight is quantized as it is read,
    so at most one full-precision tensor is held at a time, never the whole model.
    """
    model_dir = Path(model_dir)
    gguf_file = weights_file(model_dir)
    if gguf_file is not None:  # its quantized tensors stay quantized (gguf_weights.py)
        if layout is not None or quantization != "none":
            raise ModelLoadError("a GGUF model is served on one rank in its own quantization: "
                                 "tp=1 and quantization=none")
        return load_gguf_model(gguf_file, config, dtype, device)
    with torch.device("meta"):
        if layout is None:
            model = CausalLM(config)
        else:
            model = CausalLM(layout.local_config())
            use_vocab_parallel(model, layout, group)
        fp8_weights = fp8_shells(model) if quantization == "fp8" else {}
    expected = set(model.state_dict().keys())
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name not in expected:
                    continue
                tensor = _read(f, name, layout).to(dtype)
                if name in fp8_weights:
                    # Row-parallel shards hold part of each row: their scales span ranks.
                    row_group = group if fp8_weights[name] else None
                    tensor, state[f"{name}_scale"] = quantize_per_channel(tensor, row_group)
                state[name] = tensor
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


def _read(f: object, name: str, layout: ShardLayout | None) -> torch.Tensor:
    if layout is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    shard = layout.tensor_shard(name)
    tensor = sl[:] if shard is None else shard.read(sl, len(sl.get_shape()))
    return torch.zeros_like(tensor) if layout.zero_on_this_rank(name) else tensor
