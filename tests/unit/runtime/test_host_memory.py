"""The arena the native decoder's weights live in (`host_memory.HugePageArena`); that a
quantized model's bytes move there is checked in tests/parity/test_gguf_quantized.py."""

from __future__ import annotations

import gc

import pytest
import torch

from gpu_runtime.host_memory import ALIGN, HUGE_PAGE, HugePageArena


def test_the_arena_hands_out_aligned_tensors_that_outlive_it() -> None:
    a = torch.randn(3, 5)
    b = torch.arange(7, dtype=torch.int16)
    arena = HugePageArena(HugePageArena.size_of([(tuple(a.shape), a.dtype),
                                                 (tuple(b.shape), b.dtype)]))
    a2, b2 = arena.empty((3, 5), a.dtype), arena.empty((7,), b.dtype)
    a2.copy_(a)
    b2.copy_(b)
    assert a2.data_ptr() % HUGE_PAGE == 0 and b2.data_ptr() % ALIGN == 0
    assert b2.data_ptr() - a2.data_ptr() == ALIGN  # 60 bytes rounded up to a line
    assert torch.equal(a2, a) and torch.equal(b2, b) and arena.used == 2 * ALIGN
    assert arena.holds(b2) and not arena.holds(b)
    with pytest.raises(ValueError, match="bytes left"):
        arena.empty((1,), torch.float32)
    del arena
    gc.collect()  # the tensors hold the mapping
    a2.add_(1)
    assert torch.equal(a2, a + 1) and torch.equal(b2, b)
