"""The machine limits the `cpu` scenario holds each engine to: the bytes a decode step
of SmolLM2-135M reads at each precision, the measured multiply-add peak, and the
rooflines (the most tokens/s any engine could reach here on each job)."""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.cpu_workload import PREFILL_LEN, TORCH_ATTENTION, TORCH_DECODE, UNPACKED

BYTES_PER_WEIGHT = {"F32": 4.0, "float32": 4.0, UNPACKED: 4.0, "BF16": 2.0, "bfloat16": 2.0,
                    TORCH_ATTENTION: 2.0, TORCH_DECODE: 2.0,
                    "F16": 2.0, "Q8_0": 34 / 32, "Q4_1": 20 / 32}
SMOLLM2_PARAMS = 134_515_008  # the tied embedding counted once
SMOLLM2_LM_HEAD = 49_152 * 576  # vocabulary x hidden: the tied embedding as the LM head
SMOLLM2_ATTENTION = (30, 9, 64)  # layers, query heads, head dim
ROOFLINE_DTYPES = {"float32": "float32", UNPACKED: "float32", "F32": "float32",
                   TORCH_ATTENTION: "bfloat16", TORCH_DECODE: "bfloat16",
                   "bfloat16": "bfloat16", "BF16": "bfloat16"}
PEAK_ROWS = 512


def step_bytes(variant: str, gguf_file: str | None = None) -> float:
    """Bytes a batch-1 decode step reads for SmolLM2-135M (134.5 M parameters, the tied
    embedding read once as the LM head), at a variant's bytes per weight; for a GGUF
    file served as it is, the file's tensor bytes (each read once a step)."""
    if gguf_file is not None:
        return gguf_tensor_bytes(gguf_file)
    return SMOLLM2_PARAMS * BYTES_PER_WEIGHT[variant]


def gguf_tensor_bytes(path: str) -> float:
    """The bytes of a GGUF file's tensors (its weights at their own precision)."""
    import gguf

    return float(sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors))


def measure_matmul_peak(dtype_name: str) -> float:
    """FLOP/s of SmolLM2's four layer products (q/k/v fused, o, gate/up fused, down) at
    512 rows, best of `F.linear` and oneDNN's packed weights, best of 5: the machine's
    multiply-add rate at this precision (a prefill chunk's shape)."""
    import torch
    import torch.nn.functional as F

    from gpu_runtime.cpu_linear import PACK_ROWS

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dtype)
               for o, i in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
    xs = [torch.randn(PEAK_ROWS, w.shape[1], generator=gen).to(dtype) for w in weights]
    flops = sum(2 * PEAK_ROWS * w.numel() for w in weights)
    products: list[Callable[[], object]] = [
        lambda: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)]]
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
        products.append(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                 for x, p in zip(xs, packed, strict=True)])
    best = float("inf")
    for product in products:
        try:
            product()
        except RuntimeError:  # a oneDNN that refuses this CPU: F.linear's figure stands
            continue
        for _ in range(5):
            started = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - started)
    return flops / best


def roofline_tokens_s(job: str, bytes_per_weight: float, peak_flops: float,
                      bandwidth: float) -> float:
    """The most tokens/s of `job` ("decode_B" or "prefill") on SmolLM2-135M: a decode
    step reads every weight once (at least bytes / bandwidth) and multiplies B rows by
    all of them (at least 2 B params / peak); a prefill of 512 tokens multiplies every
    token by the layer weights and through causal attention, and one row by the LM head."""
    if job == "prefill":
        layers, heads, head_dim = SMOLLM2_ATTENTION
        mean_keys = (PREFILL_LEN + 1) / 2
        attention = 4 * layers * heads * head_dim * mean_keys  # QK^T and PV per token
        per_token = 2 * (SMOLLM2_PARAMS - SMOLLM2_LM_HEAD) + attention
        seconds = (PREFILL_LEN * per_token + 2 * SMOLLM2_LM_HEAD) / peak_flops
        return PREFILL_LEN / max(seconds, SMOLLM2_PARAMS * bytes_per_weight / bandwidth)
    batch = int(job.removeprefix("decode_"))
    step = max(SMOLLM2_PARAMS * bytes_per_weight / bandwidth,
               2 * batch * SMOLLM2_PARAMS / peak_flops)
    return batch / step
