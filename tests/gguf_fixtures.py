"""GGUF files for the quantized-serving tests, made from the bundled SmolLM2 file.

The `gguf` package quantizes Q8_0, Q5_0, Q5_1, Q4_0 and Q4_1 as llama.cpp does; it
only reads the K-quants, so `quantize_q4_k` and `quantize_q6_k` below write valid
Q4_K and Q6_K blocks (a plain min/max fit, not llama.cpp's search: the test needs
real blocks of that format, which the `gguf` package's dequantizer then reads back as
the reference)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [n, k] (k % 256 == 0) -> Q4_K blocks [n, k / 256 * 144] uint8."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    low = np.minimum(g.min(-1), 0.0)
    scale = (g.max(-1) - low) / 15
    offset = -low
    d = scale.max(-1) / 63
    dmin = offset.max(-1) / 63
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(offset / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    step = d16.astype(np.float32)[..., None] * sc
    shift = dmin16.astype(np.float32)[..., None] * mn
    q = np.clip(np.round((g + shift[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, 15)
    q = q.astype(np.uint8).reshape(n, k // 256, 4, 2, 32)  # chunk, low/high half, l
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // 256, 128)
    s = np.zeros((n, k // 256, 12), np.uint8)
    s[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    s[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    head = np.concatenate([d16[..., None].view(np.uint8), dmin16[..., None].view(np.uint8)], -1)
    return np.concatenate([head, s, qs], -1).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [n, k] (k % 256 == 0) -> Q6_K blocks [n, k / 256 * 210] uint8."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // 256, 16, 16)
    scale = np.abs(g).max(-1) / 31
    d = np.abs(scale).max(-1) / 127
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), -128, 127).astype(np.int8)
    d16 = d.astype(np.float16)
    step = d16.astype(np.float32)[..., None] * sc
    q = np.clip(np.round(g / np.where(step != 0, step, 1)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # half, quarter, l
    v1, v2, v3, v4 = (q[..., i, :] for i in range(4))
    ql = np.concatenate([(v1 & 0x0F) | ((v3 & 0x0F) << 4), (v2 & 0x0F) | ((v4 & 0x0F) << 4)], -1)
    qh = (v1 >> 4) | ((v2 >> 4) << 2) | ((v3 >> 4) << 4) | ((v4 >> 4) << 6)
    return np.concatenate([ql.reshape(n, k // 256, 128), qh.reshape(n, k // 256, 64),
                           sc.view(np.uint8), d16[..., None].view(np.uint8)], -1).reshape(n, -1)


def write_variant(source: Path, out: Path, formats: list[tuple[str, str]]) -> Path:
    """`source` with each tensor whose name matches a pattern of `formats` (the first
    that matches; regular expressions over GGUF names) stored in that format; the
    others, and every 1-D tensor, as they are. Metadata kept."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        fmt = next((f for pattern, f in formats if re.search(pattern, tensor.name)), None)
        if fmt is None or len(tensor.shape) == 1:
            kind = gguf.GGMLQuantizationType(tensor.tensor_type)
            data = np.asarray(tensor.data)
            if kind == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(tensor.name, data)
            else:
                writer.add_tensor(tensor.name, data, raw_dtype=kind)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        kind = gguf.GGMLQuantizationType[fmt]
        if fmt == "Q4_K":
            raw = quantize_q4_k(values)
        elif fmt == "Q6_K":
            raw = quantize_q6_k(values)
        else:
            raw = gguf.quants.quantize(values, kind)
        writer.add_tensor(tensor.name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Every format the kernels multiply, and one they do not (Q5_1, stored as Q8_0), mixed
# inside the fused products (q/k in Q5_0, v in Q8_0).
MIXED = [
    (r"^token_embd", "Q8_0"), (r"attn_[qk]\.", "Q5_0"), (r"attn_v\.", "Q8_0"),
    (r"^blk\.0\.attn_output", "Q5_1"), (r"attn_output", "Q4_0"), (r"ffn_(gate|up)", "Q4_1"),
    (r"^blk\.\d*[02468]\.ffn_down", "Q4_K"), (r"ffn_down", "Q6_K"),
]
ALL_Q8_0 = [(r".", "Q8_0")]
