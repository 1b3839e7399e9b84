"""Run as `TRITON_INTERPRET=1 python -m tests.unit.runtime.triton_check` (or with
`--device cuda` on a GPU): Triton vs torch reference.

A separate process because TRITON_INTERPRET must be set before triton is
imported, and other tests may already have imported it.
"""

from __future__ import annotations

import os

import torch


def make_case(seed: int = 0, head_dim: int = 24, block_size: int = 16):
    """Three sequences: a decode, a chunk after cached tokens, a fresh prefill."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, n_kv, heads = 12, 2, 4
    k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g)
    tables = [[7, 2, 9], [4, 0], [11]]
    # (rows computed this step, context after the step) per sequence
    work = [(1, 37), (5, 25), (7, 7)]
    seq_idx, ctx_len = [], []
    for i, (n, ctx) in enumerate(work):
        seq_idx += [i] * n
        ctx_len += list(range(ctx - n + 1, ctx + 1))
    q = torch.randn(len(seq_idx), heads, head_dim, generator=g)
    padded = [t + [0] * (3 - len(t)) for t in tables]
    return (
        q,
        k_cache,
        v_cache,
        torch.tensor(padded, dtype=torch.int32),
        torch.tensor(seq_idx, dtype=torch.int32),
        torch.tensor(ctx_len, dtype=torch.int32),
        head_dim**-0.5,
    )


def check_device() -> str:
    """`--device cuda` runs the compiled kernels on the GPU (benchmarks/gpu.sh); on the
    CPU they run in Triton's interpreter, which must be switched on before import."""
    import sys

    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (or pass --device cuda)")
    return device


def on_device(device: str, case: tuple) -> tuple:
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in case)


def main() -> None:
    device = check_device()
    from gpu_runtime.triton_attention import paged_attention_reference, paged_attention_triton

    # Windows: none; inside one block; exactly a block; across a block boundary.
    for seed, head_dim, window in ((0, 24, None), (1, 32, None), (2, 24, 5), (3, 24, 16),
                                   (4, 32, 20)):
        args = on_device(device, make_case(seed, head_dim))
        got = paged_attention_triton(*args, window=window)
        ref = paged_attention_reference(*args, window=window)
        diff = (got - ref).abs().max().item()
        if diff > 1e-4:
            raise SystemExit(f"mismatch: head_dim={head_dim} window={window} max abs diff {diff}")
        print(f"head_dim={head_dim} window={window}: max abs diff {diff:.2e}")
    print("OK")


if __name__ == "__main__":
    main()
