"""The CPU KV cache's memory (`host_memory.zeroed`): zeros, laid out on huge-page
boundaries, lazily backed, and alive as long as the tensor is."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from gpu_runtime.host_memory import HUGE_PAGE, zeroed


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_a_large_cache_is_zero_aligned_and_outlives_its_mapping_handle() -> None:
    shape = (2, 40, 16, 3, 64)  # 1.9 MiB of bfloat16: below a huge page, numpy's path
    small = zeroed(shape, torch.bfloat16, torch.device("cpu"))
    assert small.shape == shape and small.dtype == torch.bfloat16 and not small.any()

    shape = (2, 700, 16, 3, 64)  # 34 MiB of float32: the mapping
    cache = zeroed(shape, torch.float32, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    assert cache.data_ptr() % HUGE_PAGE == 0
    gc.collect()  # nothing but the tensor holds the mapping now
    assert not cache.any()
    before = _anon_huge_kib()
    cache.fill_(1.5)  # every page written: the memory is the tensor's and stays
    assert float(cache.sum()) == 1.5 * cache.numel()
    cache[1, 699, 15, 2, 63] = -2.0
    assert float(cache.view(-1)[-1]) == -2.0
    # Where the kernel grants transparent huge pages on request, the cache got them.
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" not in setting:
        assert _anon_huge_kib() > before
