#!/usr/bin/env bash
# The crash of scripts/gpu_crash_probe.sh's narrow pair, once with inductor's CUDA-graph trees recording where
# each allocation of their pool came from (pytest_cudagraph_history.py), once with CUDA_LAUNCH_BLOCKING=1 (which
# kernel fails). Logs under $OUT.
set -o pipefail
BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
export HF_HUB_OFFLINE=1
PAIR="tests/gpu/test_decode_fast_paths.py tests/gpu/test_decoding_paths.py"
K="cuda_graph_captured_decode or (equal_the_full_forward and llama-fp32)"
[ -n "${ONLY_VARIANTS:-}" ] || PYTHONPATH=scripts timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider -p pytest_cudagraph_history --tb=long $PAIR -k "$K" > $OUT/pair_history.log 2>&1
echo "pair_history: exit $?"; grep -E "passed|failed" $OUT/pair_history.log | tail -2
[ -n "${ONLY_VARIANTS:-}" ] || CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=scripts timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider --tb=long $PAIR -k "$K" > $OUT/pair_blocking.log 2>&1
echo "pair_blocking: exit $?"; grep -E "passed|failed" $OUT/pair_blocking.log | tail -2
grep -n -E "Error|error:|Data Pointer|File \"/work/main/bem" $OUT/pair_history.log | head -30
grep -n -E "Error|error:|File \"/work/main/bem" $OUT/pair_blocking.log | head -20
# Variants (VARIANTS=1): the controller's own graphs off; the row kernel launched in order (no programmatic launch)
if [ -n "${VARIANTS:-}" ]; then
  BEM_CONTROLLER_GRAPHS=0 timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider --tb=short $PAIR -k "$K" > $OUT/pair_no_controller_graphs.log 2>&1
  echo "pair_no_controller_graphs: exit $?"; grep -E "passed|failed" $OUT/pair_no_controller_graphs.log | tail -1
  BEM_DECODE_ROWS_PDL=0 timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider --tb=short $PAIR -k "$K" > $OUT/pair_rows_in_order.log 2>&1
  echo "pair_rows_in_order: exit $?"; grep -E "passed|failed" $OUT/pair_rows_in_order.log | tail -1
fi
