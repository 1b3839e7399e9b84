"""Decode and prefill attention on the CPU by small C kernels that read the paged KV
cache in place.

The torch path (`attention.decode_attention`) gathers every decode sequence's keys
and values into a padded copy (`index_select`) and hands it to SDPA, whose CPU
kernel is built for long query blocks: for one query token per sequence it ran
at 10-16 GFLOP/s here, and the gather copies the whole visible cache of every
layer at every step. `native/decode_attention.c` (AVX-512F or AVX2, OpenMP) walks each
sequence's block table instead, one task per (sequence, KV head), its query
heads sharing each key and value read, softmax and sums in float32. (No
well-kept library does this for a torch model on any x86 CPU: torch has no paged
attention op; vLLM's and SGLang's CPU kernels are C++ extensions built with those
engines, IPEX's is tied to Intel CPUs and pinned torch versions.)

Measured per layer on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim
64, blocks of 16), 2 threads, AMD EPYC with avx512_bf16, 1 to 32 sequences of 160
or 512 keys and one of 4,096 (`python -m bench.cpu_kernels` measures it
again): float32 4.2-9.6x the torch path, bfloat16 3.1-4.7x; relative error against
the torch path in float32 2.5e-7 (float32 cache) and 1.7e-3 (bfloat16 cache,
where the torch path's own is 2.2e-3).

Prefill chunks (`NativeDecodeAttention.prefill`, `sluice_prefill_attention`): the
torch path hands a chunk to SDPA's CPU flash attention, which ran a SmolLM2
prefill of 512 tokens at ~54 GFLOP/s here (5.6-5.9 ms a layer, 32 % of the whole
prefill step in bfloat16). The kernel's task is one KV head and a tile of query
positions whose query heads make up to 32 rows, the queries held transposed so a
key's scores for every row of the tile are two vectors of multiply-adds (no
horizontal sums); keys by blocks of 8 from the cache, softmax online per row, the
output accumulated in float32 and rounded once. Measured on that shape, 2
threads: 2.75 ms against SDPA's 5.58 ms in bfloat16, 2.98 against 5.78 in float32
(relative error against the torch path 2e-3 in bfloat16, the output's rounding
and SDPA's bfloat16 weights; 2.5e-7 in float32).

The kernel is compiled at first use with the machine's C compiler (`CC`, else
`cc`), ~1 s, into `~/.cache/sluice/kernels` (`XDG_CACHE_HOME`), keyed by the
source, the flags and the compiler's version; later loads reuse the file. It
shares torch's OpenMP runtime (one thread pool; `libgomp.so.1` is already loaded
from torch). It is built for AVX-512 where the CPU has it (F, BW, VL, DQ), else
for AVX2 with FMA (`native/simd16.h`: the same source, each 16-lane vector a pair
of 256-bit halves; measured on an AVX2-only AMD EPYC (Zen 1), whole float32 decode
steps of SmolLM2 2.6x the torch path at batch 1, 2.0x at 8 sequences, 1.4x at 32).
Where it cannot be used — no compiler, neither instruction set, CUDA, a head
size that is not a multiple of 16 (or above 256), more than 16 query heads per
KV head, a compiled decode step (its graph has attention as an opaque op of its
own), or a probe at load (one small call against the torch path) that fails or
disagrees — attention stays on the torch path and the reason is logged.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gpu_runtime.attention import decode_attention, prefill_attention
from gpu_runtime.compiled import sluice_cache_dir
from gpu_runtime.context import PrefillChunk

log = logging.getLogger(__name__)

NATIVE = Path(__file__).parent / "native"
# One library: decode_layers.c (cpu_decode.py's whole-step kernel) includes
# decode_attention.c; the build key covers every source it reads.
SOURCE = NATIVE / "decode_layers.c"
INCLUDED = (NATIVE / "decode_attention.c", NATIVE / "decode_products.c", NATIVE / "decode_quant.c",
            NATIVE / "simd16.h")
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# The instruction set the library is built for (simd16.h): AVX-512 where the CPU has it,
# else AVX2 with FMA (16 lanes as two halves; no bfloat16 products).
# "avx512vnni": the same with AVX512-VNNI's byte dot products for quantized weights
# (decode_quant.c). F16C (every AVX2 CPU has it): the quantized weights' float16 scales.
ISA_FLAGS = {"avx512vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c",
                            "-mavx512vnni"),
             "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"),
             "avx2": ("-mavx2", "-mfma", "-mf16c")}
MAX_HEAD_DIM = 256
MAX_GROUP = 16  # query heads per KV head (the kernel's register arrays)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def kernel_dir() -> Path:
    return sluice_cache_dir("kernels")


class NativeDecodeAttention:
    """`decode_attention` with lengths instead of a mask: the C kernel, loaded."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        library.sluice_simd_bits.restype = ctypes.c_int
        self.simd_bits = library.sluice_simd_bits()  # 512: AVX-512; 256: AVX2 (simd16.h)
        fn = library.sluice_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # q, stride, kv, out
            ctypes.c_void_p, ctypes.c_void_p,  # block_tables, lens
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int,
        ]  # fmt: skip
        self.fn = fn
        prefill = library.sluice_prefill_attention
        prefill.restype = ctypes.c_int
        prefill.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # q, stride, kv, out
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # table, num_computed, n
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
            ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int,
        ]  # fmt: skip
        self.prefill_fn = prefill

    def __call__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q: [B, H, D] (rows may be strided, heads and dims dense); kv: [2, num_blocks,
        block_size, n_kv, D] contiguous; block_tables: [B, max_blocks] int64; lens: [B]
        int64, keys visible to each row -> [B, H, D]."""
        batch, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype)
        rc = self.fn(
            q.data_ptr(), q.stride(0), kv.data_ptr(), out.data_ptr(),
            block_tables.data_ptr(), lens.data_ptr(),
            batch, num_heads, kv.shape[-2], head_dim, kv.shape[2], kv.shape[1],
            block_tables.shape[1], window or 0, scale, DTYPES[q.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError("the native decode attention failed (a row without keys or "
                               "past its block table, or no memory for its scores)")
        return out

    def prefill(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        block_table: torch.Tensor,
        num_computed: int,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """One sequence's prefill chunk, its keys already in the cache. q: [n, H, D] (rows
        may be strided) at positions num_computed..; block_table: [blocks] int64 covering
        num_computed + n tokens -> [n, H, D]: causal, each row seeing the last `window`
        keys up to its own (all with None)."""
        n, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        block_size, num_blocks = kv.shape[2], kv.shape[1]
        table = block_table.contiguous()
        used = table[: (num_computed + n + block_size - 1) // block_size]
        if (used.numel() * block_size < num_computed + n
                or (used.numel() and not 0 <= int(used.min()) <= int(used.max()) < num_blocks)):
            raise RuntimeError("the native prefill attention was given a block table that does "
                               "not cover its chunk inside the cache")
        out = torch.empty((n, num_heads, head_dim), dtype=q.dtype)
        rc = self.prefill_fn(
            q.data_ptr(), q.stride(0), kv.data_ptr(), out.data_ptr(), table.data_ptr(),
            num_computed, n, num_heads, kv.shape[-2], head_dim, block_size, num_blocks,
            window or 0, scale, DTYPES[q.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            group = num_heads // kv.shape[-2]
            raise RuntimeError(f"the native prefill attention does not take {group} query "
                               f"heads per KV head with head_dim {head_dim}")
        return out


def why_not_native(device: torch.device, dtype: torch.dtype, head_dim: int, group: int,
                   compile: bool) -> str | None:
    """None when this runtime's decode attention can run on the kernel, else the reason."""
    if device.type != "cpu":
        return f"the device is {device.type}"
    if dtype not in DTYPES:
        return f"the kernel reads float32 or bfloat16 caches, not {dtype}"
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of 16 up to {MAX_HEAD_DIM}"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head (the kernel takes up to {MAX_GROUP})"
    if compile:
        return "the decode step is compiled (attention is its graph's own op)"
    _, reason = load()
    return reason


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isa() -> str | None:
    """"avx512" (F, BW, VL, DQ: torch's AVX512 level, as torch reads the CPU, as
    `loader.cpu_has_native_bf16` does), else "avx2" (with FMA), else None."""
    try:
        if torch.cpu._is_avx512_supported():
            return "avx512vnni" if "avx512_vnni" in _cpu_flags() else "avx512"
        if torch.cpu._is_avx2_supported() and "fma" in _cpu_flags():
            return "avx2"
    except AttributeError:  # a torch without the probes: assume neither
        pass
    return None


def runnable_isas() -> list[str]:
    """The instruction sets whose build this CPU runs, the widest first."""
    return {"avx512vnni": ["avx512vnni", "avx512", "avx2"], "avx512": ["avx512", "avx2"],
            "avx2": ["avx2"], None: []}[cpu_isa()]


def build_flags(isa: str) -> tuple[str, ...]:
    return (*COMMON_FLAGS, *ISA_FLAGS[isa])


@functools.cache
def load() -> tuple[NativeDecodeAttention | None, str | None]:
    """The kernel (built if needed, probed) or None and the reason; once per process."""
    isa = cpu_isa()
    if isa is None:
        return None, "the CPU has neither AVX-512F nor AVX2 with FMA"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler (CC, cc or gcc) to build it with"
    try:
        path = _build(compiler, build_flags(isa))
        kernel = NativeDecodeAttention(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building or loading it failed: {exc}"
    reason = _probe(kernel)
    if reason is None:
        runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                    if "libgomp" in line or "libiomp" in line}
        if len(runtimes) > 1:  # two thread pools on the same cores would fight
            log.warning("the native decode attention loaded a second OpenMP runtime: %s",
                        sorted(runtimes))
    return (kernel, None) if reason is None else (None, reason)


def time_prefill(kernel: NativeDecodeAttention, dtype: torch.dtype, num_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int,
                 rounds: int = 5) -> tuple[float, float]:
    """Seconds the kernel and the torch path (`prefill_attention`: SDPA) take for one
    layer's prefill chunks on these heads: 128 rows from the start, then 128 after 128
    cached tokens; best of `rounds`, the two alternating. Which one is faster depends on
    the CPU: the kernel was 1.4-2.0x SDPA on an AMD EPYC, SDPA 1.4-4x the kernel on a
    Xeon whose oneDNN runs AMX (benchmarks/README.md); a few milliseconds at load."""
    gen = torch.Generator().manual_seed(0)
    rows, scale = 128, head_dim ** -0.5
    blocks = (2 * rows + block_size - 1) // block_size
    kv = torch.randn(2, blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.arange(blocks)
    q = torch.randn(rows, num_heads, head_dim, generator=gen).to(dtype)
    flat = [kv[i].flatten(0, 1) for i in (0, 1)]
    cases = [(PrefillChunk(0, rows, computed, table),
              flat[0][computed:computed + rows], flat[1][computed:computed + rows])
             for computed in (0, rows)]

    def native() -> None:
        for chunk, _, _ in cases:
            kernel.prefill(q, kv, table, chunk.num_computed, scale)

    def sdpa() -> None:
        for chunk, k, v in cases:
            prefill_attention(q, k, v, kv, chunk, scale)

    best = {native: float("inf"), sdpa: float("inf")}
    for fn in best:  # first calls set up oneDNN's and the kernel's threads
        fn()
    for _ in range(rounds):
        for fn in best:
            started = time.perf_counter()
            fn()
            best[fn] = min(best[fn], time.perf_counter() - started)
    return best[native], best[sdpa]


def _build(compiler: str, flags: tuple[str, ...]) -> Path:
    source = SOURCE.read_bytes() + b"".join(path.read_bytes() for path in INCLUDED)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    key = hashlib.sha256(source + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    directory = kernel_dir()
    path = directory / f"sluice_native-{key}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # then one atomic rename
        built = Path(tmp) / path.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise subprocess.SubprocessError(
                f"{compiler} exited {result.returncode}: {result.stderr.strip()[-500:]}")
        os.replace(built, path)
    log.info("built the native CPU kernels: %s", path)
    return path


def _probe(kernel: NativeDecodeAttention) -> str | None:
    """Small calls (full and windowed, both dtypes) against the torch path."""
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks, n_kv, group, head_dim = 4, 12, 2, 3, 32
    lens = torch.tensor([1, 7, 13], dtype=torch.int64)
    tables = torch.randperm(num_blocks, generator=gen)[:12].view(3, 4)
    keys = torch.arange(4 * block_size)
    for dtype in DTYPES:
        kv = torch.randn(2, num_blocks, block_size, n_kv, head_dim, generator=gen).to(dtype)
        q = torch.randn(3, n_kv * group, head_dim, generator=gen).to(dtype)
        for window in (None, 5):
            visible = keys[None, :] < lens[:, None]
            if window is not None:
                visible &= keys[None, :] >= lens[:, None] - window
            want = decode_attention(q.float(), kv.float(), tables, visible[:, None, None, :], 0.3)
            try:
                got = kernel(q, kv, tables, lens, 0.3, window).float()
            except Exception as exc:
                return f"the probe call failed: {type(exc).__name__}: {exc}"
            error = ((got - want).norm() / want.norm()).item()
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            if not error <= tolerance:
                return f"the kernel disagrees with the torch path ({dtype}, error {error:.2g})"
            # the prefill kernel: sequence 2's last 6 rows, after 7 cached tokens
            chunk = PrefillChunk(0, 6, 7, tables[2])
            rows = [int(tables[2, p // block_size]) * block_size + p % block_size
                    for p in range(7, 13)]
            k_new, v_new = (kv[i].reshape(-1, n_kv, head_dim)[rows].float() for i in (0, 1))
            q_rows = q.float().repeat(2, 1, 1)
            want = prefill_attention(q_rows, k_new, v_new, kv.float(), chunk, 0.3, window)
            try:
                got = kernel.prefill(q_rows.to(dtype), kv, tables[2], 7, 0.3, window).float()
            except Exception as exc:
                return f"the prefill probe call failed: {type(exc).__name__}: {exc}"
            error = ((got - want).norm() / want.norm()).item()
            if not error <= tolerance:
                return (f"the prefill kernel disagrees with the torch path ({dtype}, error "
                        f"{error:.2g})")
    return None
