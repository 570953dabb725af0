#!/usr/bin/env bash
# Kernel variants of the fftconv block kernels side by side on one GPU (scripts/gpu/fftconv.sh's `variants` step):
# each VARIANTS entry is a set of nvcc -D switches (comma-separated), built as a dev module of its own (the
# builds in parallel), then each variant's kernel times at VARIANT_SHAPES, in turn.
set -o pipefail
cd "$(dirname "$0")/.."
shapes=${VARIANT_SHAPES:-8x768x8192,8x768x1024}
read -r -a variants <<<"${VARIANTS:?VARIANTS names the variants, e.g. \"-DBEM_FFT_PAIRING=0 -DBEM_FFT_PAIRING=2\"}"
build_log() { echo "/tmp/variant_build_${1//[^A-Za-z0-9]/_}.log"; }
for v in "${variants[@]}"; do
  BEM_FFTCONV_DEV_NVCC_FLAGS="${v//,/ }" MAX_JOBS=8 python3 -c \
    "from bem.kernels.fftconv import custom_ops; assert custom_ops.extension() is not None" >"$(build_log "$v")" 2>&1 &
done
wait
for v in "${variants[@]}"; do
  echo "##### variant: $v"
  BEM_FFTCONV_DEV_NVCC_FLAGS="${v//,/ }" PYTHONPATH=. python3 scripts/fftconv_kernel_times.py --shapes "$shapes" 2>&1 \
    | grep -E "^==|fftconv::" || tail -5 "$(build_log "$v")"
done
