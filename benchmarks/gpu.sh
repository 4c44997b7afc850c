#!/usr/bin/env bash
# The GPU benchmark (BENCHMARKS.md, "GPU"): one GPU, the bare loop vs tuneq (kernels and compile
# auto) on GPT-Neo-2.7B bf16 ZeRO-2, Llama-3.2-3B bf16 ZeRO-2 and GPT-Neo-2.7B fp16 ZeRO-2 + CPU
# offload. Prints tokens/s, MFU, peak GPU memory and the loss curves; writes
# benchmarks/results/gpu-<date>.json after every run.
#   bash benchmarks/gpu.sh [--only neo-bf16,llama-bf16,neo-fp16-offload] [--steps 10] [--output FILE]
# A short device lease fits one or two rows: pick them with --only, and keep TUNEQ_BENCH_TMP on a
# disk that outlives the call so models are not rebuilt. On a host without CUDA it runs small
# shapes on the CPU path (fp16 off), to show it works.
#
# A host that cannot reach a package index (the device machines here; an air-gapped box): make
# the wheels on a machine that can (benchmarks/offline_wheels.py writes .whl/), bring them, and
#   TUNEQ_WHEELS=.whl bash benchmarks/gpu.sh [...]
# which runs the host's own python3 (its CUDA build of torch) with the wheels installed into
# TUNEQ_SITE (default /tmp/tuneq-site) ahead of the image's packages on PYTHONPATH, and this
# checkout on it too (tuneq's processes start with `python -P`, which leaves the cwd off sys.path).
set -euo pipefail
wheels=${TUNEQ_WHEELS:+$(realpath "$TUNEQ_WHEELS")}  # relative to where it was called from
cd "$(dirname "$0")/.."
if [ -n "$wheels" ]; then
    site=${TUNEQ_SITE:-/tmp/tuneq-site}
    python3 -m pip install --quiet --no-index --no-deps --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    exec python3 -m benchmarks.gpu "$@"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    make install EXTRAS=dev,gpu  # Liger Kernel: training.kernels
else
    make install
fi
exec .venv/bin/python -m benchmarks.gpu "$@"
