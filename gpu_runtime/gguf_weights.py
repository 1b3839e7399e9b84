"""A model's weights read from a GGUF file, its quantized projections kept quantized.

A model folder holding a `.gguf` (and no safetensors) is served from it: the
config, tokenizer and chat template beside it were written from the file's metadata
(`modelfiles.gguf_import`), and here the tensors are read (memory-mapped, with the
`gguf` package's reader), renamed to the Hugging Face names `CausalLM` uses, and
each projection whose tensor is quantized becomes a `QuantizedLinear` (the kernel's
layout, quantized.py); float tensors (the norms, F32/F16/BF16 projections) load as
usual. llama.cpp's converter permutes the rows of a Llama's q and k projections for
its RoPE; the rows are put back here (a row permutation: the quantized blocks run
along a row, so each row's bytes move whole).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gpu_runtime.config import ModelConfig
from gpu_runtime.errors import ModelLoadError
from gpu_runtime.layers import Linear
from gpu_runtime.quantized import (
    KERNEL_QTYPES,
    SUPER,
    QuantizedEmbedding,
    QuantizedLinear,
    requantize_q8_0,
    unpack,
)

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
FLOAT_TYPES = ("F32", "F16", "BF16")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    kind: str  # the GGML type's name: "Q8_0", "F32", ...
    shape: tuple[int, ...]  # GGUF order: the row length first
    data: np.ndarray  # the tensor's bytes, uint8, memory-mapped

    @property
    def rows_and_length(self) -> tuple[int, int]:
        k = self.shape[0]
        return int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1, k


_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def read_tensors(path: Path) -> list[TensorInfo]:
    """The tensors of a GGUF file (v2/v3), their data memory-mapped. The metadata is
    walked over, not parsed (the `gguf` package's reader parses every value, 11 s for
    a tokenizer's 100k strings; this takes a few milliseconds)."""
    import gguf

    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    buf = memoryview(raw)
    at = 0

    def take(size: int) -> bytes:
        nonlocal at
        if at + size > len(buf):
            raise ModelLoadError(f"{path} ends inside its header: not a whole GGUF file")
        out = bytes(buf[at : at + size])
        at += size
        return out

    def u32() -> int:
        return int.from_bytes(take(4), "little")

    def u64() -> int:
        return int.from_bytes(take(8), "little")

    def skip_value(kind: int) -> None:
        nonlocal at
        if kind in _FIXED:
            at += _FIXED[kind]
        elif kind == _STRING:
            length = u64()  # read first: `at += u64()` would add to the old `at`
            at += length
        elif kind == _ARRAY:
            item, count = u32(), u64()
            if item in _FIXED:
                at += _FIXED[item] * count
            else:
                for _ in range(count):
                    skip_value(item)
        else:
            raise ModelLoadError(f"{path}: unknown GGUF value type {kind}")

    if take(4) != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file")
    if u32() not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version not 2 or 3")
    tensor_count, kv_count = u64(), u64()
    alignment = 32
    for _ in range(kv_count):
        key = take(u64()).decode("utf-8", "replace")
        kind = u32()
        if key == "general.alignment" and kind == _UINT32:
            alignment = u32()
        else:
            skip_value(kind)
    infos = []
    for _ in range(tensor_count):
        name = take(u64()).decode()
        shape = tuple(u64() for _ in range(u32()))
        kind, offset = u32(), u64()
        infos.append((name, shape, kind, offset))
    start = -(-at // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            ggml = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name} has unknown type {kind}") from None
        block, size = gguf.GGML_QUANT_SIZES[ggml]
        n_bytes = int(np.prod(shape)) // block * size
        begin = start + offset
        tensors.append(TensorInfo(name, ggml.name, shape, raw[begin : begin + n_bytes]))
    return tensors


def _rope_rows(rows: int, heads: int) -> np.ndarray:
    """The row order undoing llama.cpp's q/k permutation (its `permute`): HF row i is the
    file's row order[i]."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def _raw_rows(tensor: TensorInfo) -> tuple[np.ndarray, int, int, str]:
    """A tensor's rows as [N, bytes a row] uint8 (float types: float32 values), N, K, type."""
    n, k = tensor.rows_and_length
    data = tensor.data
    if tensor.kind == "F32":
        return data.view(np.float32).reshape(n, k), n, k, tensor.kind
    if tensor.kind == "F16":
        return data.view(np.float16).reshape(n, k).astype(np.float32), n, k, tensor.kind
    if tensor.kind == "BF16":
        bits = torch.from_numpy(data.view(np.int16).reshape(n, k).copy()).view(torch.bfloat16)
        return bits.float().numpy(), n, k, tensor.kind
    return data.reshape(n, -1), n, k, tensor.kind


def _quantized(raw: np.ndarray, n: int, k: int, kind: str) -> QuantizedLinear:
    import gguf

    fits = k % SUPER.get(kind, 32) == 0
    if kind in KERNEL_QTYPES and fits:
        unpacked = unpack(kind, raw, k)
    else:
        if k % 32:
            raise ModelLoadError(f"a {kind} tensor of {k} inputs: sluice needs a multiple of 32")
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)
        unpacked = requantize_q8_0(values)
    return QuantizedLinear(unpacked, n, k)


def load_gguf_model(path: Path, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
    """The model of `config` with the weights of the GGUF file at `path`."""
    from gpu_runtime.model import CausalLM

    if torch.device(device).type != "cpu":
        raise ModelLoadError("quantized GGUF weights are served on the CPU; for a GPU, import "
                             "the file as float (`sluice models import-gguf --dtype bfloat16`)")
    _needs_gguf()
    tensors = read_tensors(path)
    with torch.device("meta"):
        model = CausalLM(config)
    floats: dict[str, torch.Tensor] = {}
    converted: dict[str, int] = {}
    formats: dict[str, int] = {}  # tensors by the format they are held in
    quantized_embedding: QuantizedLinear | None = None
    # llama.cpp's converter permutes q/k rows for Llama and Mistral (its LlamaModel), not
    # for Qwen2, as transformers' GGUF reader undoes them
    permuted = config.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    for tensor in tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        raw, n, k, kind = _raw_rows(tensor)
        if permuted and name.endswith("q_proj.weight"):
            raw = raw[_rope_rows(n, config.num_heads)]
        elif permuted and name.endswith("k_proj.weight"):
            raw = raw[_rope_rows(n, config.num_kv_heads)]
        if kind in FLOAT_TYPES:
            values = torch.from_numpy(np.array(raw, dtype=np.float32))  # a copy: maps are read-only
            one_row = name.endswith(("norm.weight", ".bias"))
            floats[name] = values.reshape(-1) if one_row else values
            continue
        if kind not in KERNEL_QTYPES or k % SUPER.get(kind, 32):
            converted[kind] = converted.get(kind, 0) + 1
        module = _quantized(raw, n, k, kind)
        formats[module.fmt] = formats.get(module.fmt, 0) + 1
        if name == "model.embed_tokens.weight":
            quantized_embedding = module
        else:
            _swap(model, name.removesuffix(".weight"), module)
    if converted:
        log.info("GGUF tensors stored as Q8_0 (the kernels do not multiply their format): %s",
                 ", ".join(f"{count} {kind}" for kind, count in sorted(converted.items())))
    tied = not any(t.name == "output.weight" for t in tensors)  # the embedding: the output too
    if quantized_embedding is not None:
        model.model.embed_tokens = QuantizedEmbedding(quantized_embedding, dtype)
        if tied:
            model.lm_head = quantized_embedding  # the same bytes
    elif tied and "model.embed_tokens.weight" in floats:
        floats["lm_head.weight"] = floats["model.embed_tokens.weight"]
    expected = {name for name, p in model.named_parameters() if p.is_meta}
    missing = sorted(expected - floats.keys())
    if missing:
        raise ModelLoadError(f"{path} lacks {len(missing)} tensors: {missing[:4]}")
    state = {name: floats[name].to(dtype) for name in expected}
    model.load_state_dict(state, strict=False, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    # what the runtime reports (worker log, sluice_model_weights): "GGUF 211 Q8_0", ...
    model.weights_format = "GGUF " + ", ".join(
        f"{count} {fmt}" for fmt, count in sorted(formats.items(), key=lambda kv: -kv[1]))
    if converted:
        model.weights_format += " (as Q8_0: " + ", ".join(
            f"{count} {kind}" for kind, count in sorted(converted.items())) + ")"
    return model.eval()


def _needs_gguf() -> None:
    try:
        import gguf  # noqa: F401 - its dequantizer and type table
    except ImportError:
        raise ModelLoadError("serving a GGUF file needs the gguf package: "
                             "pip install 'sluice-engine[gguf]'") from None


def _swap(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if not isinstance(getattr(parent, child, None), Linear):
        raise ModelLoadError(f"GGUF tensor {dotted} is not a projection of this model")
    setattr(parent, child, module)


def gguf_weight_bytes(path: Path) -> int:
    """Bytes the model's weights take once loaded (the memory planner's figure): each
    quantized tensor in the kernel's layout, float tensors as float32."""
    from gpu_runtime.quantized import BLOCK_ROWS, _kernel

    _needs_gguf()
    lib = _kernel()
    total = 0
    for tensor in read_tensors(path):
        n, k = tensor.rows_and_length
        if tensor.kind in FLOAT_TYPES:
            total += n * k * 4
            continue
        qtype = KERNEL_QTYPES.get(tensor.kind, KERNEL_QTYPES["Q8_0"])
        per_block = lib.sluice_qblock_bytes(qtype, k) or lib.sluice_qblock_bytes(1, k)
        total += -(-n // BLOCK_ROWS) * per_block
    return total
