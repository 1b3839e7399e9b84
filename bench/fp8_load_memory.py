"""Peak memory of loading a checkpoint as FP8: quantized while read vs after loading.

    python -m bench.fp8_load_memory MODEL_DIR [--dtype bfloat16]

Each mode loads in a fresh process; a sampler thread records the peak of the
process's anonymous memory (RssAnon), which is what the loaded tensors cost on
the CPU — file pages that safetensors maps are reclaimable and not counted. On a
GPU the same difference is device memory: "after" holds the whole
full-precision model on the device before quantizing it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("full-precision", "fp8-after-load", "fp8-while-loading")


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def _measure(model_dir: Path, mode: str, dtype_name: str) -> None:
    from gpu_runtime.config import ModelConfig
    from gpu_runtime.fp8 import quantize_model_fp8
    from gpu_runtime.loader import load_model, resolve_dtype

    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], _rss_anon_kib())
            time.sleep(0.002)

    config, dtype = ModelConfig.from_dir(model_dir), resolve_dtype(dtype_name)
    before = _rss_anon_kib()
    threading.Thread(target=sample, daemon=True).start()
    if mode == "fp8-while-loading":
        model = load_model(model_dir, config, dtype, "cpu", quantization="fp8")
    else:
        model = load_model(model_dir, config, dtype, "cpu")
        if mode == "fp8-after-load":
            model = quantize_model_fp8(model)
    time.sleep(0.05)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{mode:>18}  peak anonymous memory +{(peak[0] - before) / 1024:7.0f} MiB"
          f"  parameters {held / 2**20:7.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        _measure(args.model_dir, args.mode, args.dtype)
        return
    for mode in MODES:
        subprocess.run([sys.executable, __file__, str(args.model_dir), "--dtype", args.dtype,
                        "--mode", mode], check=True)


if __name__ == "__main__":
    main()
