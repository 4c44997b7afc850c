#!/usr/bin/env bash
# The GPU benchmark (BENCHMARKS.md, "GPU"): GPT-Neo-2.7B-shaped, one GPU, the core issue's fp16
# ZeRO-2 + CPU-offload config and bf16 ZeRO-2 without offload, through tuneq and the bare loop.
# Prints tokens/s, MFU and peak GPU memory; writes benchmarks/results/gpu-<date>.json.
#   bash benchmarks/gpu.sh [--only bf16] [--steps 10] [--output FILE]
# On a host without CUDA it runs a small shape on the CPU path (fp16 off), to show it works.
set -euo pipefail
cd "$(dirname "$0")/.."
make install
exec .venv/bin/python -m benchmarks.gpu "$@"
