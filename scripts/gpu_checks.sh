#!/usr/bin/env bash
# The GPU checks, as one bounded script for a CUDA machine (e.g. the device tool, ~10 minutes in all):
#   bash scripts/gpu_checks.sh [OUT_DIR]
# Installs the venv if needed, then runs tests/gpu, the preprocessing benchmark on CUDA and the
# Fuyu-8B-sized benchmark (NF4 and bf16), each under its own timeout, logging to OUT_DIR (figures
# also in OUT_DIR/bench-gpu.json).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MRC_DEVICE=cuda
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
[ -x .venv/bin/python ] || make install > "$out/install.log" 2>&1
timeout 120 .venv/bin/python -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/tests-gpu.log"
timeout 150 .venv/bin/python tests/bench/bench_preprocess.py --device cuda --passes 3 2>&1 | tee "$out/bench-preprocess.log"
timeout 420 .venv/bin/python tests/bench/bench_gpu.py --modes nf4,bf16 --batches 1,8,32 --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.log"
