#!/usr/bin/env bash
# One prepared command for a lent GPU (~6 min on one H200): first the checks that
# need the real device, then the GPU benchmark.
#
#  1. the Triton kernels compiled ahead of time for sm_90/sm_80 with their real launch
#     constants (what the compiler requires; also runs without a GPU, in the suite)
#  2. the paged-attention and LoRA kernels, compiled and run on the GPU, vs the torch
#     reference
#  3. the runtime vs transformers (+ PEFT) on the GPU, tp=1 (and tp=2 with two GPUs),
#     eager and with the compiled decode step
#  4. `python -m bench.gpu`: a Llama-3-8B-shaped random-weight model, bf16 and
#     fp8, decode at batch 1/16/64/256, prefill, 4 LoRA adapters vs none, and the
#     fraction of the H200's 4.8 TB/s HBM reached at batch 1 (a table, and JSON)
#
#   benchmarks/gpu.sh [OUT.json] [--tiny --device cpu]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
out="${1:-benchmarks/gpu-$(date +%Y%m%d-%H%M%S).json}"
shift || true
device=cuda
for arg in "$@"; do [ "$arg" = cpu ] && device=cpu; done

step() { echo; echo "== $* ($(date +%T))"; }
step "1/4 Triton kernels compiled for the GPU (sm_90, sm_80)"
"$py" -m pytest -q -p no:cacheprovider tests/unit/runtime/test_triton_compile.py
if [ "$device" = cuda ]; then
  step "2/4 Triton kernels on the GPU vs the torch reference"
  "$py" -m tests.unit.runtime.triton_check --device cuda
  "$py" -m tests.unit.runtime.triton_lora_check --device cuda
  step "3/4 runtime vs transformers/PEFT on the GPU"
  "$py" -m bench.tp_check --device cuda --tp 1
  "$py" -m bench.tp_check --device cuda --tp 1 --compile
  gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
  if [ "$gpus" -ge 2 ]; then "$py" -m bench.tp_check --device cuda --tp 2; fi
else
  step "2/4 and 3/4 need a GPU: skipped on $device"
fi
step "4/4 GPU benchmark -> $out"
exec "$py" -m bench.gpu --json "$out" "$@"
