"""The native CPU kernels' library (gpu_runtime/native), loaded once for the tests
that need it: they skip, with the reason, where it cannot be built or loaded."""

from __future__ import annotations

import pytest

from gpu_runtime.cpu_attention import load

KERNEL, NOT_HERE = load()
needs_native_kernels = pytest.mark.skipif(KERNEL is None, reason=f"no native kernel: {NOT_HERE}")
