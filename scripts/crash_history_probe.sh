#!/usr/bin/env bash
# The crash of scripts/gpu_crash_probe.sh's narrow pair, once with inductor's CUDA-graph trees recording where
# each allocation of their pool came from (pytest_cudagraph_history.py), once with CUDA_LAUNCH_BLOCKING=1 (which
# launch fails). VARIANTS=1 adds the pair with the controller's own graphs off and with the row kernel launched
# in order; ONLY_VARIANTS=1 runs those alone. Logs under $OUT.
set -o pipefail
BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
export HF_HUB_OFFLINE=1
PAIR="tests/gpu/test_decode_fast_paths.py tests/gpu/test_decoding_paths.py"
K="cuda_graph_captured_decode or (equal_the_full_forward and llama-fp32)"
pair() {  # pair NAME [pytest options...]: the narrow pair in one process
  local name=$1
  shift
  PYTHONPATH=scripts timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider "$@" $PAIR -k "$K" \
    > "$OUT/$name.log" 2>&1
  echo "$name: exit $?, $(grep -E 'passed|failed' "$OUT/$name.log" | tail -1)"
}
if [ -z "${ONLY_VARIANTS:-}" ]; then
  pair pair_history -p pytest_cudagraph_history --tb=long
  grep -n -E "Data Pointer|File \"/work/main/bem" "$OUT/pair_history.log" | head -30
  CUDA_LAUNCH_BLOCKING=1 pair pair_blocking --tb=long
  grep -n -E "^bem/.*py:[0-9]+: " "$OUT/pair_blocking.log" | head -20
fi
if [ -n "${VARIANTS:-}${ONLY_VARIANTS:-}" ]; then
  BEM_CONTROLLER_GRAPHS=0 pair pair_no_controller_graphs --tb=short
  BEM_DECODE_ROWS_PDL=0 pair pair_rows_in_order --tb=short
fi
