"""CPU decode and prefill attention by the C kernels over the paged cache
(`gpu_runtime.cpu_attention`).

The kernels are checked against attention written out here in float64 (a loop over
each row's keys, no paging helpers of ours), and a runtime on them against
transformers and against the torch path (`cpu_native_attention=False`) on the same
checkpoints; the model parity tests run on it too, as it is the CPU default.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

import pytest
import torch

from gpu_runtime import cpu_attention
from gpu_runtime.cpu_attention import why_not_native
from tests.parity.native_kernels import KERNEL, needs_native_kernels
from tests.parity.test_model_parity import VARIANTS
from tests.runtime_support import (
    assert_ragged_run_matches_hf,
    assert_same_ragged_run,
    make_hf_checkpoint,
    make_runtime,
    ragged_run,
)

CPU = torch.device("cpu")
pytestmark = needs_native_kernels


def _reference(q, kv, tables, lens, scale, window):
    """float64 softmax(q k^T * scale) v over each row's visible keys, one row at a time."""
    batch, num_heads, head_dim = q.shape
    block_size, n_kv = kv.shape[2], kv.shape[3]
    group = num_heads // n_kv
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        first = max(0, n - window) if window else 0
        rows = [int(tables[b, p // block_size]) * block_size + p % block_size
                for p in range(first, n)]
        k = kv[0].reshape(-1, n_kv, head_dim)[rows].double()  # [n, n_kv, D]
        v = kv[1].reshape(-1, n_kv, head_dim)[rows].double()
        for h in range(num_heads):
            weights = torch.softmax(k[:, h // group] @ q[b, h].double() * scale, dim=0)
            out[b, h] = weights @ v[:, h // group]
    return out


def _case(dtype, n_kv, group, head_dim, lens, block_size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max((n + block_size - 1) // block_size for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    kv = torch.randn(2, num_blocks, block_size, n_kv, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)  # blocks out of order, as served
    tables = order[: len(lens) * max_blocks].view(len(lens), max_blocks).contiguous()
    q = torch.randn(len(lens), n_kv * group, head_dim, generator=gen).to(dtype)
    return q, kv, tables, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_kv", "group", "head_dim"), [(1, 1, 16), (3, 3, 64), (2, 4, 128),
                                                         (1, 16, 256), (4, 2, 48)])
@pytest.mark.parametrize("window", [None, 1, 5, 16])
def test_kernel_matches_float64_attention(dtype, n_kv, group, head_dim, window) -> None:
    # lengths at, below and across block bounds (block_size 4), one of a single key
    lens = [1, 4, 5, 13, 37]
    q, kv, tables, lens_t = _case(dtype, n_kv, group, head_dim, lens)
    scale = head_dim**-0.5
    want = _reference(q, kv, tables, lens_t, scale, window)
    got = KERNEL(q, kv, tables, lens_t, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    error = (got.double() - want).abs().max().item()
    # float32: summation order and the kernel's exp (relative error < 1e-7); bfloat16:
    # the output's own rounding (2^-9 of values up to ~3).
    assert error <= (1e-5 if dtype == torch.float32 else 1.6e-2), error
    if window is not None and window < max(lens):  # the window changes the answer
        assert (_reference(q, kv, tables, lens_t, scale, None) - want).abs().max() > 1e-3


def test_kernel_reads_strided_query_rows() -> None:
    """The fused q/k product hands q over as a view whose rows are longer than H * D."""
    q, kv, tables, lens = _case(torch.float32, 3, 3, 64, [9, 30, 2])
    wide = torch.randn(3, 12, 64)
    wide[:, :9] = q
    view = wide[:, :9]
    assert not view.is_contiguous()
    assert torch.equal(KERNEL(view, kv, tables, lens, 0.125), KERNEL(q, kv, tables, lens, 0.125))


def test_a_row_it_cannot_read_is_an_error_not_garbage() -> None:
    q, kv, tables, lens = _case(torch.float32, 1, 1, 16, [3, 5])
    for bad_lens, bad_tables in ((torch.tensor([0, 5]), tables),  # no keys
                                 (torch.tensor([3, 9]), tables),  # past its 2-block table
                                 (lens, tables.clone().fill_(kv.shape[1]))):  # past the cache
        with pytest.raises(RuntimeError, match="native decode attention failed"):
            KERNEL(q, kv, bad_tables, bad_lens, 0.25)


def _prefill_case(dtype, n_kv, group, head_dim, num_computed, n, block_size=4, seed=0):
    """One sequence's chunk: q [n, H, D] at positions num_computed.., its table, and
    the same rows as decode rows (a table and a length each) for `_reference`."""
    gen = torch.Generator().manual_seed(seed)
    total = num_computed + n
    blocks = (total + block_size - 1) // block_size
    kv = torch.randn(2, blocks + 5, block_size, n_kv, head_dim, generator=gen).to(dtype)
    table = torch.randperm(blocks + 5, generator=gen)[: blocks + 1]  # out of order, one spare
    q = torch.randn(n, n_kv * group, head_dim, generator=gen).to(dtype)
    lens = torch.arange(num_computed + 1, total + 1)
    return q, kv, table, table.repeat(n, 1), lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_kv", "group", "head_dim"), [(1, 1, 16), (3, 3, 64), (2, 4, 128),
                                                         (1, 16, 256), (4, 2, 48)])
@pytest.mark.parametrize("window", [None, 1, 5, 16])
@pytest.mark.parametrize(("num_computed", "n"), [(0, 1), (0, 37), (6, 29), (13, 3)])
def test_prefill_kernel_matches_float64_attention(dtype, n_kv, group, head_dim, window,
                                                  num_computed, n) -> None:
    # chunks from the start and after cached tokens; tiles of 32 // group positions,
    # so 37 rows end in a partial tile; key blocks of 8 cross the cache's blocks of 4
    q, kv, table, tables, lens = _prefill_case(dtype, n_kv, group, head_dim, num_computed, n)
    scale = head_dim**-0.5
    want = _reference(q, kv, tables, lens, scale, window)
    got = KERNEL.prefill(q, kv, table, num_computed, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    error = (got.double() - want).abs().max().item()
    assert error <= (1e-5 if dtype == torch.float32 else 1.6e-2), error


def test_prefill_kernel_reads_strided_query_rows() -> None:
    q, kv, table, _, _ = _prefill_case(torch.float32, 3, 3, 64, 5, 20)
    wide = torch.randn(20, 12, 64)
    wide[:, :9] = q
    view = wide[:, :9]
    assert not view.is_contiguous()
    assert torch.equal(KERNEL.prefill(view, kv, table, 5, 0.125),
                       KERNEL.prefill(q, kv, table, 5, 0.125))


def test_a_prefill_table_it_cannot_read_is_an_error_not_garbage() -> None:
    q, kv, table, _, _ = _prefill_case(torch.float32, 1, 1, 16, 3, 6)  # 9 tokens, 3 blocks
    for bad in (table[:2],  # does not cover the chunk
                table.clone().fill_(kv.shape[1]),  # past the cache
                table.clone().fill_(-1)):
        with pytest.raises(RuntimeError, match="does not cover its chunk"):
            KERNEL.prefill(q, kv, bad, 3, 0.25)


@pytest.mark.parametrize("variant", ["gqa", "tied_mha_bias", "mistral_window",
                                     "qwen2_mixed_window"])
def test_native_runtime_matches_transformers_and_the_torch_path(variant, tmp_path) -> None:
    path, hf = make_hf_checkpoint(tmp_path, **VARIANTS[variant])
    # prefill chunks by the kernel too, whichever is faster on this CPU (timed at load)
    rt = make_runtime(path, device="cpu", cpu_native_prefill=True)
    assert rt.runner.native_attention is KERNEL and rt.runner.native_prefill
    native = ragged_run(rt)
    assert native[3] > 0  # some steps mixed decodes with prefill chunks
    assert_ragged_run_matches_hf(hf, native, tol=2e-4)
    off = make_runtime(path, device="cpu", cpu_native_attention=False)
    assert off.runner.native_attention is None
    assert_same_ragged_run(native, ragged_run(off), tol=1e-4)


def test_prefill_chunks_take_the_path_set_or_timed_faster(tmp_path, monkeypatch) -> None:
    """cpu_native_prefill=False: prefill chunks on SDPA, decode rows still on the kernel,
    the same tokens; None (the default): the faster of the two as `time_prefill` measures
    them on the model's heads."""
    from gpu_runtime import ranks

    native_s, sdpa_s = cpu_attention.time_prefill(KERNEL, torch.bfloat16, 9, 3, 64, 16,
                                                  rounds=2)
    assert 0 < native_s < 1 and 0 < sdpa_s < 1
    path, _ = make_hf_checkpoint(tmp_path, **VARIANTS["gqa"])
    on = ragged_run(make_runtime(path, device="cpu", cpu_native_prefill=True))
    off_rt = make_runtime(path, device="cpu", cpu_native_prefill=False)
    assert off_rt.runner.native_attention is KERNEL and not off_rt.runner.native_prefill
    chunks = []
    monkeypatch.setattr(KERNEL, "prefill", lambda *args: chunks.append(args))
    off = ragged_run(off_rt)
    monkeypatch.undo()
    assert not chunks and off[3] > 0  # mixed steps ran, no chunk reached the kernel
    assert_same_ragged_run(on, off, tol=1e-4)
    for native_s, sdpa_s in ((0.001, 0.002), (0.002, 0.001)):
        monkeypatch.setattr(ranks, "time_prefill", lambda *a, n=native_s, s=sdpa_s: (n, s))
        rt = make_runtime(path, device="cpu")
        assert rt.runner.native_prefill is (native_s < sdpa_s)


def test_no_kernel_where_it_cannot_serve() -> None:
    assert "cuda" in why_not_native(torch.device("cuda"), torch.float32, 64, 3, compile=False)
    assert "float16" in why_not_native(CPU, torch.float16, 64, 3, compile=False)
    assert "head_dim 72" in why_not_native(CPU, torch.float32, 72, 3, compile=False)
    assert "32 query heads" in why_not_native(CPU, torch.float32, 64, 32, compile=False)
    assert "compiled" in why_not_native(CPU, torch.float32, 64, 3, compile=True)
    assert why_not_native(CPU, torch.bfloat16, 64, 3, compile=False) is None


def test_the_build_is_cached_and_a_failing_compiler_is_reported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = os.environ.get("CC") or "cc"
    flags = cpu_attention.build_flags(cpu_attention.cpu_isa())
    first = cpu_attention._build(compiler, flags)
    assert first.parent == tmp_path / "sluice" / "kernels"
    stamp = first.stat().st_mtime_ns
    assert cpu_attention._build(compiler, flags) == first and first.stat().st_mtime_ns == stamp
    assert list(first.parent.iterdir()) == [first]  # no temporary left behind
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", broken)
    with pytest.raises(subprocess.SubprocessError, match="exited"):
        cpu_attention._build(compiler, flags)


@pytest.mark.parametrize("isa", ["avx512vnni", "avx512", "avx2"])
def test_each_instruction_set_build_agrees_with_the_torch_path(isa) -> None:
    """The AVX2 build (16 lanes as two halves, simd16.h) runs on AVX-512 CPUs too, so
    there both builds are checked; the library in use is the widest (`load`)."""
    if isa not in cpu_attention.runnable_isas():
        pytest.skip(f"this CPU does not run the {isa} build")
    compiler = os.environ.get("CC") or "cc"
    path = cpu_attention._build(compiler, cpu_attention.build_flags(isa))
    kernel = cpu_attention.NativeDecodeAttention(ctypes.CDLL(str(path)))
    assert kernel.simd_bits == {"avx512vnni": 512, "avx512": 512, "avx2": 256}[isa]
    assert cpu_attention._probe(kernel) is None
    widest = cpu_attention.runnable_isas()[0]
    assert KERNEL.simd_bits == {"avx512vnni": 512, "avx512": 512, "avx2": 256}[widest]
