#!/usr/bin/env bash
# The mLSTM kernels on a CUDA machine: a module of their sources alone (bem_mlstm_dev, built just in time
# through BEM_MLSTM_DEV_MODULE=1, so the rest of csrc/ need not build), then the requested steps, each with
# its own time limit and log under $OUT; a one-line summary per step last.
# Usage: bash scripts/gpu/mlstm.sh [tests] [bench] [bench-quick]
# TFLA (mlstm_kernels) joins the benchmark when its wheel is in .whl/ (pip download mlstm_kernels --no-deps -d .whl).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
# BEM_JIT=0: the project's own helpers (tests/gpu/kernel_helpers.py) look up bem._C at import; with the
# whole of csrc/ built just in time that alone took minutes.
export BEM_MLSTM_DEV_MODULE=1 BEM_JIT=0 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
SUMMARY=()
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if ls .whl/mlstm_kernels-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mlstm_site .whl/*.whl \
    && export PYTHONPATH=/tmp/mlstm_site${PYTHONPATH:+:$PYTHONPATH}
fi

source "$(dirname "${BASH_SOURCE[0]}")/step.sh"  # step NAME SECONDS COMMAND...

step build 240 python3 -c "from bem.kernels.mlstm import custom_ops; assert custom_ops.extension() is not None, 'no module'"
for what in "$@"; do
  case $what in
    tests) step tests ${TESTS_LIMIT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short -o faulthandler_timeout=100 \
        tests/gpu/test_mlstm.py ;;
    bench) step bench ${BENCH_LIMIT:-300} python3 -m bem.kernels.bench --mlstm --json "$OUT/mlstm_bench.json" ;;
    bench-quick) step bench_quick ${BENCH_LIMIT:-150} python3 -m bem.kernels.bench --mlstm --quick --no-tfla \
        --json "$OUT/mlstm_bench.json" ;;
    *) echo "unknown step $what" >&2; exit 2 ;;
  esac
done
printf '%s\n' "${SUMMARY[@]}"
