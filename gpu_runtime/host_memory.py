"""Host memory the CPU kernels stream: anonymous mappings on transparent huge pages.

A decode step reads every weight once and the KV cache's newest slots; with 4 KiB
pages each stream crosses a page (a TLB walk, and the hardware prefetchers stop at
page boundaries) every 4 KiB. Asked for 2 MiB pages (`madvise`, honoured where THP is
`always` or `madvise`), the same kernels read faster: Q4_K products over 116 MB, 2
threads, AMD EPYC, 23.9-24.6 -> 29.0-30.2 GB/s; Q8_0 22.7-25.1 -> 30.7-33.1 GB/s.
Where THP is off the mappings are plain pages and nothing else changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import mmap

import numpy as np
import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # a cache line: each tensor of an arena starts on one


def _huge_mapping(num_bytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping of at least `num_bytes` from a huge page's boundary, asked
    for huge pages; (mapping, offset of that boundary)."""
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # no THP here: 4 KiB pages then
        mapping.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return mapping, (-address) % HUGE_PAGE


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its pages come zeroed from the kernel as they are first
    touched (anonymous memory), instead of being written once up front: a KV cache of a
    few GB costs nothing at start-up (torch.zeros spent 2.4 s of a SmolLM2 load on it).
    The mapping asks for transparent huge pages: a decode step writes each sequence's
    next slot in every layer, and with 4 KiB pages every few tokens of every sequence
    met a first-touch fault (measured: 2.8-4.0 ms of a 16-29 ms step of 8 sequences on
    SmolLM2), where a 2 MiB page faults 512 times less often."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes < HUGE_PAGE:
        return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
    mapping, offset = _huge_mapping(num_bytes)
    # The tensor holds the mapping (a buffer export) for as long as it lives.
    return torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes,
                            offset=offset).view(dtype).view(shape)


class HugePageArena:
    """One huge-page mapping that hands out tensors, each from a cache line's boundary
    (`empty`): the weights a decode step streams, in one place. The tensors
    it hands out hold the mapping for as long as any lives."""

    def __init__(self, num_bytes: int) -> None:
        self.capacity = max(num_bytes, 1)
        mapping, offset = _huge_mapping(self.capacity)
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8, count=self.capacity,
                                       offset=offset)
        self.used = 0

    @staticmethod
    def size_of(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Bytes an arena needs to hand out tensors of these shapes and dtypes."""
        return sum(_aligned(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
                   for shape, dtype in shapes)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of the arena's next bytes (zeros until written)."""
        num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.used + num_bytes > self.capacity:
            raise ValueError(f"the arena has {self.capacity - self.used} bytes left, not "
                             f"{num_bytes}")
        view = self._bytes[self.used : self.used + num_bytes].view(dtype).view(shape)
        self.used += _aligned(num_bytes)
        return view

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s data lies in the arena."""
        start = self._bytes.data_ptr()
        return start <= tensor.data_ptr() < start + self.capacity


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim): a load
    frees its staging copies to the heap, where they would stay resident. No-op where
    the C library has no malloc_trim."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
