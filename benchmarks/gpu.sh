#!/usr/bin/env bash
# GPU mode of the benchmark harness: a Llama-3-8B-shaped random-weight model on one GPU,
# bf16 and fp8, decode at batch 1/16/64/256, prefill, 4 LoRA adapters vs none, and the
# fraction of the H200's 4.8 TB/s HBM reached at batch 1. No broker, no download.
#
#   benchmarks/gpu.sh [OUT.json] [--tiny --device cpu]      # ~5 min on one H200
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/gpu-$(date +%Y%m%d-%H%M%S).json}"
shift || true
exec "${PYTHON:-python}" -m benchmarks.gpu --json "$out" "$@"
