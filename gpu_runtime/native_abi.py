"""The native kernels' argument structs shared by their Python callers (cpu_decode.py,
quantized.py): field for field decode_products.c's `sluice_proj`."""

from __future__ import annotations

import ctypes


class Proj(ctypes.Structure):
    # qtype 0: `cpu_decode.blocked` float weights; else quantized.py's layout (per block
    # qtypes and byte offsets where a fused product's parts are stored in different formats)
    _fields_ = [("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64),
                ("qtype", ctypes.c_int64), ("block_qtypes", ctypes.c_void_p),
                ("block_offsets", ctypes.c_void_p)]
