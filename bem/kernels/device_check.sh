#!/usr/bin/env bash
# Build the extension, run the GPU tests and the benchmark on a CUDA machine; logs under $OUT (or ./out).
# Usage: bash bem/kernels/device_check.sh [quick|full|tests]
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 \
  || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
python3 -c "import bem.kernels as k; print('KERNELS_AVAILABLE', k.KERNELS_AVAILABLE)"
PYTEST="python3 -m pytest -m gpu -q -rf --tb=short --timeout=900 -p no:cacheprovider"
# The error-path tests run in their own process so a crash there cannot hide the other results.
$PYTEST tests/gpu --ignore=tests/gpu/test_kernel_errors.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -60
$PYTEST tests/gpu/test_kernel_errors.py tests/test_kernel_dispatch.py 2>&1 | tee "$OUT/pytest_errors.log" | tail -30
[ "${1:-quick}" = tests ] && exit 0
python3 -m bem.kernels.bench $([ "${1:-quick}" = quick ] && echo --quick) --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.log" | tail -${BENCH_TAIL:-60}
