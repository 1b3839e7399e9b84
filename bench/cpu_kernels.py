"""`python -m bench.cpu_kernels [--threads N]`: the CPU's linear-layer options
on SmolLM2-135M's shapes, with the weights cold in cache.

The 210 layer weights of the model (30 layers x q, k, v, o, gate, up, down; 425 MB
in float32, more than any cache) are multiplied in turn, as a decode step does, at
M = 1, 8 and 32 rows, best of 5 passes. Candidates for the engine's CPU path, each
beside `F.linear` on row-major float32 weights:

- `kmajor`: the same weights stored K-major (transposed, contiguous);
- `mkl_packed`: MKL's packed sgemm (`torch.ops.mkl._mkl_linear`; one pack per M);
- `onednn_f32`: oneDNN's prepacked float32 weights, one pack for every M (the
  engine's CPU path: `gpu_runtime.cpu_linear`);
- `onednn_bf16`: the same in bfloat16;
- `bf16`: `F.linear` in bfloat16;
- `int8_bf16`: int8 weight-only, per output channel, bf16 activations
  (`torch.ops.aten._weight_int8pack_mm`), with its relative error.

Prints one line per M; milliseconds for the 210 weights (lower is better).

Then decode attention over a paged cache of SmolLM2's shape (9 query heads, 3 KV
heads, head_dim 64, blocks of 16 out of order) for 1 to 32 sequences: the torch
path (`gpu_runtime.attention.decode_attention`: gather + SDPA) beside the native
kernel (`gpu_runtime.cpu_attention`), microseconds per layer (best of 5 passes of
20 calls) and each one's relative error against the torch path in float32.

Then prefill attention of one sequence's chunk (128 or 512 query rows, from the
start or after 384 cached tokens) on the same shape: the torch path
(`gpu_runtime.attention.prefill_attention`: SDPA's CPU flash attention) beside
the native kernel (`NativeDecodeAttention.prefill`), microseconds per layer and
the relative errors against the torch path in float32.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_runtime.attention import decode_attention, prefill_attention
from gpu_runtime.context import PrefillChunk
from gpu_runtime.cpu_attention import load as load_native_attention
from gpu_runtime.cpu_linear import PACK_ROWS

HIDDEN, INTER, KV = 576, 1536, 192
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN),
          (INTER, HIDDEN), (HIDDEN, INTER)] * 30


def _pass_ms(fns: list[Callable[[torch.Tensor], torch.Tensor]],
             inputs: dict[int, torch.Tensor], passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for fn, (_, k) in zip(fns, SHAPES, strict=True):
            fn(inputs[k])
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def _onednn_ms(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    """`_pass_ms` over `weights` packed as the engine packs them (`cpu_linear`)."""
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
    return _pass_ms(
        [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
         for p in packed], inputs)


def measure(m: int, weights: list[torch.Tensor]) -> dict[str, float]:
    x32 = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
    xbf = {k: v.to(torch.bfloat16) for k, v in x32.items()}
    out = {"row_major": _pass_ms([lambda x, w=w: F.linear(x, w) for w in weights], x32)}
    kmajor = [w.t().contiguous().t() for w in weights]
    out["kmajor"] = _pass_ms([lambda x, w=w: F.linear(x, w) for w in kmajor], x32)
    del kmajor
    if torch._C.has_mkl:
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
        out["mkl_packed"] = _pass_ms(
            [lambda x, p=p, w=w: torch.ops.mkl._mkl_linear(x, p, w, None, m)
             for p, w in zip(packed, weights, strict=True)], x32)
        del packed
    if torch.backends.mkldnn.is_available():
        out["onednn_f32"] = _onednn_ms(weights, x32)
    bf16 = [w.to(torch.bfloat16) for w in weights]
    out["bf16"] = _pass_ms([lambda x, w=w: F.linear(x, w) for w in bf16], xbf)
    if torch.backends.mkldnn.is_available():
        out["onednn_bf16"] = _onednn_ms(bf16, xbf)
    del bf16
    quantized = []
    for w in weights:
        scale = w.abs().amax(dim=1) / 127.0
        quantized.append((torch.clamp((w / scale[:, None]).round(), -128, 127).to(torch.int8),
                          scale.to(torch.bfloat16)))
    out["int8_bf16"] = _pass_ms(
        [lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s in quantized],
        xbf)
    q, s = quantized[4]
    ref = F.linear(x32[HIDDEN], weights[4])
    got = torch.ops.aten._weight_int8pack_mm(xbf[HIDDEN], q, s).float()
    out["int8_relative_error"] = ((got - ref).norm() / ref.norm()).item()
    return out


def _calls_us(fn: Callable[[], torch.Tensor], calls: int = 20, passes: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - started)
    return best / calls * 1e6


def attention_rows() -> list[dict[str, object]]:
    """The torch path and the native kernel on the same paged cache, per case."""
    native, reason = load_native_attention()
    rows: list[dict[str, object]] = []
    block_size, n_kv, heads, head_dim, scale = 16, 3, 9, 64, 0.125
    for dtype in (torch.float32, torch.bfloat16):
        for batch, keys in ((1, 160), (8, 160), (32, 160), (8, 512), (32, 512), (1, 4096)):
            gen = torch.Generator().manual_seed(batch * keys)
            blocks = keys // block_size
            kv32 = torch.randn(2, batch * blocks + 1, block_size, n_kv, head_dim, generator=gen)
            tables = torch.randperm(batch * blocks + 1, generator=gen)[: batch * blocks]
            tables = tables.view(batch, blocks).contiguous()
            lens = torch.randint(keys // 2, keys + 1, (batch,), generator=gen)
            q32 = torch.randn(batch, heads, head_dim, generator=gen)
            mask = (torch.arange(keys)[None, :] < lens[:, None])[:, None, None, :]
            kv, q = kv32.to(dtype), q32.to(dtype)
            want = decode_attention(q.float(), kv.float(), tables, mask, scale)

            def error(got: torch.Tensor, want: torch.Tensor = want) -> float:
                return ((got.float() - want).norm() / want.norm()).item()

            row: dict[str, object] = {
                "dtype": str(dtype).removeprefix("torch."), "sequences": batch, "keys": keys,
                "torch_us": _calls_us(lambda q=q, kv=kv, t=tables, m=mask:
                                      decode_attention(q, kv, t, m, scale)),
                "torch_error": error(decode_attention(q, kv, tables, mask, scale)),
            }
            if native is not None:
                row["native_us"] = _calls_us(lambda q=q, kv=kv, t=tables, n=lens:
                                             native(q, kv, t, n, scale))
                row["native_error"] = error(native(q, kv, tables, lens, scale))
                row["speedup"] = row["torch_us"] / row["native_us"]
            else:
                row["native"] = reason
            rows.append(row)
    return rows


def prefill_attention_rows() -> list[dict[str, object]]:
    """The torch path and the native kernel on one prefill chunk, per case."""
    native, reason = load_native_attention()
    rows: list[dict[str, object]] = []
    block_size, n_kv, heads, head_dim, scale = 16, 3, 9, 64, 0.125
    for dtype in (torch.float32, torch.bfloat16):
        for num_computed, n in ((0, 128), (0, 512), (384, 128)):
            gen = torch.Generator().manual_seed(num_computed + n)
            total = num_computed + n
            blocks = (total + block_size - 1) // block_size
            kv32 = torch.randn(2, blocks + 3, block_size, n_kv, head_dim, generator=gen)
            table = torch.randperm(blocks + 3, generator=gen)[:blocks]
            q32 = torch.randn(n, heads, head_dim, generator=gen)
            chunk = PrefillChunk(0, n, num_computed, table)
            kv, q = kv32.to(dtype), q32.to(dtype)

            k_new, v_new = (kv[i][table].flatten(0, 1)[num_computed:total] for i in (0, 1))

            def torch_path(q=q, k=k_new, v=v_new, kv=kv, chunk=chunk) -> torch.Tensor:
                return prefill_attention(q, k, v, kv, chunk, scale)

            want = prefill_attention(q.float(), k_new.float(), v_new.float(), kv.float(),
                                     chunk, scale)

            def error(got: torch.Tensor, want: torch.Tensor = want) -> float:
                return ((got.float() - want).norm() / want.norm()).item()

            row: dict[str, object] = {
                "dtype": str(dtype).removeprefix("torch."), "cached": num_computed,
                "rows": n, "torch_us": _calls_us(torch_path, calls=5),
                "torch_error": error(torch_path()),
            }
            if native is not None:
                row["native_us"] = _calls_us(lambda q=q, kv=kv, t=table, c=num_computed:
                                             native.prefill(q, kv, t, c, scale), calls=5)
                row["native_error"] = error(native.prefill(q, kv, table, num_computed, scale))
                row["speedup"] = row["torch_us"] / row["native_us"]
            else:
                row["native"] = reason
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    size = sum(w.numel() * 4 for w in weights)
    print(f"{len(weights)} weights, {size / 1e6:.0f} MB in float32, {args.threads} threads; "
          "ms per pass over all of them")
    for m in (1, 8, 32):
        figures = measure(m, weights)
        print(f"M={m:>2}  " + "  ".join(f"{k} {v:.3f}" if k.endswith("error") else
                                       f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    print("decode attention, us per layer (error: relative to the torch path in float32)")
    for row in attention_rows():
        print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in row.items()), flush=True)
    print("prefill attention, us per layer (error: relative to the torch path in float32)")
    for row in prefill_attention_rows():
        print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
