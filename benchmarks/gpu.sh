#!/usr/bin/env bash
# The GPU benchmark (BENCHMARKS.md, "GPU"): one GPU, the bare loop vs tuneq (kernels and compile
# auto) on GPT-Neo-2.7B bf16 ZeRO-2, Llama-3.2-3B bf16 ZeRO-2 and GPT-Neo-2.7B fp16 ZeRO-2 + CPU
# offload. Prints tokens/s, MFU, peak GPU memory and the loss curves; writes
# benchmarks/results/gpu-<date>.json after every run.
#   bash benchmarks/gpu.sh [--only neo-bf16,llama-bf16,neo-fp16-offload] [--steps 10] [--output FILE]
# A short device lease fits one or two rows: pick them with --only, and keep TUNEQ_BENCH_TMP on a
# disk that outlives the call so models are not rebuilt. On a host without CUDA it runs small
# shapes on the CPU path (fp16 off), to show it works.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1; then
    make install EXTRAS=dev,gpu  # Liger Kernel: training.kernels
else
    make install
fi
exec .venv/bin/python -m benchmarks.gpu "$@"
