"""GGUF's quantized weights served as they are: Q8_0, Q6_K, Q5_0, Q4_K, Q4_0 and Q4_1.

A GGUF tensor is rows of blocks (llama.cpp's formats). At load each quantized
projection is unpacked here (numpy, vectorised) and laid out again for the native
kernels (`native/decode_quant.c`: blocks of 32 output rows, each one stream, the
weights' bytes then their scales), which multiply by it directly, in the decode
kernel's one call over every layer and, for prefill chunks and larger steps, through
`QuantizedLinear` (the same products, up to 4,096 rows a call). The layout holds the
same bits as the file (Q8_0, Q5_0 and Q6_K its size; the K-quants' 6-bit scales are kept a
byte each, Q4_0/Q4_1's scales as the K-quants' are: a few % more), and nothing else is
held: no float copy of any projection.

Formats the kernels do not multiply (Q5_1, Q2_K..Q5_K, the IQ kinds) are read with the
`gguf` package's dequantizer and stored as Q8_0 again (logged): the values move by at
most half of an 8-bit step of each block's range.

The embedding table stays quantized too: its rows are dequantized as tokens are
looked up (`QuantizedEmbedding`), and a tied LM head multiplies by the same bytes.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gpu_runtime.context import StepContext
from gpu_runtime.errors import ModelLoadError
from gpu_runtime.native_abi import Proj

log = logging.getLogger(__name__)

# the kernel's format numbers (decode_quant.c)
KERNEL_QTYPES = {"Q8_0": 1, "Q5_0": 2, "Q6_K": 3, "Q4_K": 4, "Q4_0": 5, "Q4_1": 5}
SUPER = {"Q6_K": 256, "Q4_K": 256}  # inputs per super-block (the others: 32)
BLOCK_ROWS = 32
MAX_ROWS = 128  # rows of the decode kernel's calls (decode_layers.c MAX_ROWS)
LINEAR_ROWS = 4096  # rows a QuantizedLinear call takes (decode_layers.c QLINEAR_ROWS)


class QuantizedWeightError(ModelLoadError):
    pass


@dataclass(slots=True)
class Unpacked:
    """A quantized [N, K] weight unpacked row-major, values as the kernel stores them."""

    fmt: str  # "Q8_0", ... (one of KERNEL_QTYPES)
    q: np.ndarray  # [N, K] uint8 (Q8_0: q + 128; Q5_0: 0..31, its fifth bits held apart;
    #                Q6_K: 0..63; 4-bit: 0..15)
    d: np.ndarray  # [N, K / super] float16
    dmin: np.ndarray | None = None  # [N, K / super] float16 (4-bit formats)
    sc: np.ndarray | None = None  # [N, K / 16] int8 (Q6_K) or [N, K / 32] uint8 (4-bit)
    mins: np.ndarray | None = None  # [N, K / 32] uint8 (4-bit)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def unpack(fmt: str, raw: np.ndarray, k: int) -> Unpacked:
    """raw: [N, bytes per row] uint8 of GGUF blocks of `fmt` -> the values and scales."""
    n = raw.shape[0]
    if fmt == "Q8_0":
        b = raw.reshape(n, k // 32, 34)
        q = b[..., 2:].reshape(n, k) ^ np.uint8(0x80)
        return Unpacked(fmt, q, _f16(b[..., 0:2]))
    if fmt == "Q5_0":
        b = raw.reshape(n, k // 32, 22)
        qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")[..., 0]  # [n, k/32]
        qs = b[..., 6:]  # [n, k/32, 16]
        bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [n, k/32, 32]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # values 0..15, 16..31
        q = (low | (bits.astype(np.uint8) << 4)).reshape(n, k)
        return Unpacked(fmt, q, _f16(b[..., 0:2]))
    if fmt in ("Q4_0", "Q4_1"):
        size = 18 if fmt == "Q4_0" else 20
        b = raw.reshape(n, k // 32, size)
        qs = b[..., size - 16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        d = _f16(b[..., 0:2])
        groups = k // 32
        if fmt == "Q4_0":  # d * (q - 8)
            dmin, mins = d * np.float16(8), np.ones((n, groups), np.uint8)
        else:  # d * q + m
            dmin, mins = -_f16(b[..., 2:4]), np.ones((n, groups), np.uint8)
        return Unpacked(fmt, q, d, dmin, np.ones((n, groups), np.uint8), mins)
    if fmt == "Q4_K":
        b = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        s = b[..., 4:16].astype(np.uint8)  # [n, sb, 12]
        sc = np.empty((*s.shape[:-1], 8), np.uint8)
        mins = np.empty_like(sc)
        sc[..., :4], mins[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
        sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
        mins[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 64 values per 32 bytes
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
        return Unpacked(fmt, q, d, dmin, sc.reshape(n, k // 32), mins.reshape(n, k // 32))
    if fmt == "Q6_K":
        b = raw.reshape(n, k // 256, 210)
        ql = b[..., 0:128].reshape(n, -1, 2, 64)
        qh = b[..., 128:192].reshape(n, -1, 2, 32)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, k // 16)
        d = _f16(b[..., 208:210])
        lo, hi = ql[..., :32], ql[..., 32:]
        parts = [(lo & 0x0F) | (((qh >> 0) & 3) << 4), (hi & 0x0F) | (((qh >> 2) & 3) << 4),
                 (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)]
        q = np.stack(parts, axis=3).reshape(n, k)  # per 128: l, l+32, l+64, l+96
        return Unpacked(fmt, q.astype(np.uint8), d, sc=sc)
    raise QuantizedWeightError(f"no unpacking for {fmt}")


def _blocks(a: np.ndarray, rows: int) -> np.ndarray:
    """[N, G] per-row values -> [N/32 padded, G, 32] (each block's 32 rows side by side)."""
    padded = np.zeros((rows, *a.shape[1:]), a.dtype)
    padded[: a.shape[0]] = a
    blocks = padded.reshape(rows // BLOCK_ROWS, BLOCK_ROWS, -1).transpose(0, 2, 1)
    return np.ascontiguousarray(blocks).reshape(rows // BLOCK_ROWS, -1).view(np.uint8)


def pack(u: Unpacked) -> np.ndarray:
    """The kernel's layout of `u` (decode_quant.c's header): [blocks, block bytes] uint8.
    numpy's reference for the native packer (`pack_native`), which loads use."""
    n, k = u.q.shape
    rows = -(-n // BLOCK_ROWS) * BLOCK_ROWS
    nb = rows // BLOCK_ROWS
    q = np.zeros((rows, k), np.uint8)
    q[:n] = u.q
    if u.fmt == "Q8_0":
        weights = q.reshape(nb, BLOCK_ROWS, k // 4, 4).transpose(0, 2, 1, 3)
        parts = [weights, _blocks(u.d, rows)]
        return np.concatenate([np.ascontiguousarray(p).reshape(nb, -1) for p in parts], axis=1)
    low = q & 0x0F
    halves = low.reshape(nb, BLOCK_ROWS, k // 8, 2, 4)
    weights = (halves[..., 0, :] | (halves[..., 1, :] << 4)).transpose(0, 2, 1, 3)
    if u.fmt == "Q6_K":
        # per 8 inputs: the 128 bytes of low bits, then 64 of high bit pairs: byte b holds
        # those of byte b of the rows 0-15 and rows 16-31 vectors, low and high nibble
        pairs = (q >> 4).reshape(nb, 2, 16, k // 8, 2, 4)  # [row half, row, step, nibble, j]
        plane = (pairs[:, 0, :, :, 0] | pairs[:, 0, :, :, 1] << 2
                 | pairs[:, 1, :, :, 0] << 4 | pairs[:, 1, :, :, 1] << 6)  # [nb, 16, k/8, 4]
        steps = np.empty((nb, k // 8, 192), np.uint8)
        steps[..., :128] = weights.reshape(nb, k // 8, 128)
        steps[..., 128:] = plane.transpose(0, 2, 1, 3).reshape(nb, k // 8, 64)
        parts = [steps, _blocks(u.d, rows), _blocks(u.sc, rows)]
        return np.concatenate([np.ascontiguousarray(p).reshape(nb, -1) for p in parts], axis=1)
    if u.fmt == "Q5_0":
        # the fifth bits: per 8 inputs, one 64-bit mask per 64 bytes of low bits as the
        # kernel loads them (16 rows x 4 inputs), bit i for byte i
        fifth = (q >> 4).reshape(nb, 2, 16, k // 8, 2, 4).transpose(0, 3, 1, 4, 2, 5)
        masks = np.packbits(fifth.reshape(nb, k // 8, 2, 2, 64), axis=-1, bitorder="little")
        parts = [weights, masks, _blocks(u.d, rows)]
    else:
        parts = [weights, _blocks(u.d, rows), _blocks(u.dmin, rows), _blocks(u.sc, rows),
                 _blocks(u.mins, rows)]
    return np.concatenate([np.ascontiguousarray(p).reshape(nb, -1) for p in parts], axis=1)


def pack_native(u: Unpacked) -> np.ndarray:
    """`pack(u)` by the native library (decode_quant.c's pack_block), on the runtime's
    threads: numpy's strided shuffles took ~3 s of a 1B-class Q4_K_M file's load."""
    lib = _kernel()
    n, k = u.q.shape
    qtype = KERNEL_QTYPES[u.fmt]
    bytes_per_block = lib.sluice_qblock_bytes(qtype, k)
    out = np.empty((-(-n // BLOCK_ROWS), bytes_per_block), np.uint8)
    arrays = [np.ascontiguousarray(a) if a is not None else None
              for a in (u.q, u.d, u.dmin, u.sc, u.mins)]
    pointers = [a.ctypes.data if a is not None else None for a in arrays]
    if bytes_per_block == 0 or lib.sluice_pack(qtype, n, k, *pointers, out.ctypes.data,
                                               torch.get_num_threads()) != 0:
        raise QuantizedWeightError(f"{u.fmt} [{n}, {k}]: the kernel does not take this shape")
    return out


def requantize_q8_0(weight: np.ndarray) -> Unpacked:
    """float [N, K] -> Q8_0 as llama.cpp quantizes it (per 32: d = max|w| / 127)."""
    n, k = weight.shape
    w = weight.astype(np.float32).reshape(n, k // 32, 32)
    d = np.abs(w).max(axis=-1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.round(w * inv[..., None]), -127, 127).astype(np.int8)
    return Unpacked("Q8_0", q.reshape(n, k).view(np.uint8) ^ np.uint8(0x80), d.astype(np.float16))


def _kernel():
    from gpu_runtime.cpu_attention import load

    kernel, reason = load()
    if kernel is None:
        raise QuantizedWeightError(f"quantized weights need the native CPU kernels: {reason}")
    return bind(kernel.library)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The native library with its quantized entry points' signatures set."""
    if getattr(lib, "_sluice_quant_bound", False):
        return lib
    lib.sluice_qlinear.restype = ctypes.c_int
    lib.sluice_qlinear.argtypes = [ctypes.POINTER(Proj), ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.sluice_quant_scratch_bytes.restype = ctypes.c_int64
    lib.sluice_quant_scratch_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.sluice_qblock_bytes.restype = ctypes.c_int64
    lib.sluice_qblock_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.sluice_dequantize_rows.restype = None
    lib.sluice_dequantize_rows.argtypes = [ctypes.POINTER(Proj), ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_void_p]
    lib.sluice_quant_vnni.restype = ctypes.c_int
    lib.sluice_pack.restype = ctypes.c_int
    lib.sluice_pack.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                *[ctypes.c_void_p] * 6, ctypes.c_int]
    lib._sluice_quant_bound = True
    return lib


def uses_vnni() -> bool:
    return bool(_kernel().sluice_quant_vnni())


class QuantizedLinear(nn.Module):
    """y = x W^T with W quantized in the kernel's layout (`pack`). `packed` is a uint8
    parameter (frozen) so the module moves and counts like any other."""

    def __init__(self, u: Unpacked, out_features: int, in_features: int) -> None:
        super().__init__()
        self.fmt = u.fmt
        self.qtype = KERNEL_QTYPES[u.fmt]
        self.in_features, self.out_features = in_features, out_features
        blocks = pack_native(u)
        expected = _kernel().sluice_qblock_bytes(self.qtype, in_features)
        if blocks.shape[1] != expected:
            raise QuantizedWeightError(
                f"{u.fmt} [{out_features}, {in_features}]: packed {blocks.shape[1]} bytes a "
                f"block, the kernel reads {expected}")
        self.packed = nn.Parameter(torch.from_numpy(blocks.reshape(-1)), requires_grad=False)
        self.bias = None
        self._struct = None  # (packed pointer, struct) of the last call

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def struct(self) -> Proj:
        ptr = self.packed.data_ptr()
        if self._struct is None or self._struct[0] != ptr:
            self._struct = (ptr, Proj(ptr, None, self.out_features, self.in_features,
                                       self.qtype, None, None))
        return self._struct[1]

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        lib = _kernel()
        shape = x.shape
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        flat = x.reshape(-1, self.in_features).to(dtype).contiguous()
        out = torch.empty((flat.shape[0], self.out_features), dtype=dtype)
        chunk = min(LINEAR_ROWS, flat.shape[0])
        scratch = torch.empty(lib.sluice_quant_scratch_bytes(chunk, self.in_features),
                              dtype=torch.uint8)
        struct, bf16 = self.struct(), int(dtype == torch.bfloat16)
        for start in range(0, flat.shape[0], chunk):
            rows = min(chunk, flat.shape[0] - start)
            rc = lib.sluice_qlinear(ctypes.byref(struct), flat[start].data_ptr(), rows,
                                    out[start].data_ptr(), bf16, torch.get_num_threads(),
                                    scratch.data_ptr())
            if rc != 0:
                raise RuntimeError(f"the quantized product refused {rows} rows of "
                                   f"{self.in_features} ({self.fmt})")
        return out.view(*shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [N, K] (tests and references)."""
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), self.in_features), dtype=torch.float32)
        _kernel().sluice_dequantize_rows(ctypes.byref(self.struct()), ids.data_ptr(), ids.numel(),
                                         out.data_ptr())
        return out


class QuantizedEmbedding(nn.Module):
    """The embedding's lookup on a quantized table (its rows dequantized as read)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError("token id out of the embedding's range")
        return self.table.rows(ids.reshape(-1)).view(*ids.shape, -1).to(self.dtype)
