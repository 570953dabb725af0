#!/usr/bin/env bash
# The crash of `tests/gpu/test_decode_fast_paths.py` followed by `tests/gpu/test_decoding_paths.py` in one
# process ("unspecified launch failure"; each file alone passes): each run below in a process of its own,
# a line each. Logs under $OUT. SKIP_BUILD=1 reuses a built extension. CRASH_STEPS names the runs (default: the
# first five):
#   dropped_graphs, pair, pair_collected, pair_narrow, memcheck  - where it fails and under which conditions;
#   pair_history         - the narrow pair with inductor's CUDA-graph trees recording each pool allocation's origin;
#   pair_blocking        - the narrow pair with CUDA_LAUNCH_BLOCKING=1: which launch fails;
#   pair_no_controller_graphs, pair_rows_in_order - the narrow pair with the controller's own graphs off, and with
#                          the row kernel launched in order;
#   pair_no_clearing     - the narrow pair with the controller's clearing of cuBLAS's workspaces around its
#                          captures turned off (scripts/pytest_no_workspace_clearing.py);
#   workspace            - scripts/cublas_workspace_probe.py: after a dropped capture, with and without the
#                          controller's clearing of cuBLAS's workspaces around its captures, and with no capture
#                          before (a process each).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} HF_HUB_OFFLINE=1
if [ -z "${SKIP_BUILD:-}" ] || ! ls bem/_C*.so >/dev/null 2>&1; then
  BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
PAIR=(tests/gpu/test_decode_fast_paths.py tests/gpu/test_decoding_paths.py)
NARROW="cuda_graph_captured_decode or (equal_the_full_forward and llama-fp32)"
probe() {  # probe NAME SECONDS ARGS...: one pytest process (scripts/ on the path for the plugins)
  local name=$1 limit=$2
  shift 2
  PYTHONPATH=scripts${PYTHONPATH:+:$PYTHONPATH} timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider \
    --tb=short "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $?, $(grep -E 'passed|failed' "$OUT/$name.log" | tail -1)"
}
for step in ${CRASH_STEPS:-dropped_graphs pair pair_collected pair_narrow memcheck}; do
  case $step in
    # a dropped model's controller graphs collected inside another capture
    dropped_graphs) probe dropped_graphs 120 tests/gpu/test_decoding_paths.py -k dropped_models_controller_graphs ;;
    # the pair, as it crashed; then with the garbage collected after every test
    pair) probe pair 200 "${PAIR[@]}" ;;
    pair_collected) probe pair_collected 200 -p pytest_collect_garbage "${PAIR[@]}" ;;
    # the pair with only the fast-path test that captures a whole model, then the first decoding test
    pair_narrow) probe pair_narrow 150 "${PAIR[@]}" -k "$NARROW" ;;
    pair_history) probe pair_history 200 -x --tb=long -p pytest_cudagraph_history "${PAIR[@]}" -k "$NARROW"
      grep -n -E "Data Pointer|File \"/work/main/bem" "$OUT/pair_history.log" | head -30 ;;
    pair_blocking) CUDA_LAUNCH_BLOCKING=1 probe pair_blocking 200 -x --tb=long "${PAIR[@]}" -k "$NARROW"
      grep -n -E "^bem/.*py:[0-9]+: " "$OUT/pair_blocking.log" | head -20 ;;
    pair_no_controller_graphs) BEM_CONTROLLER_GRAPHS=0 probe "$step" 200 -x "${PAIR[@]}" -k "$NARROW" ;;
    pair_rows_in_order) BEM_DECODE_ROWS_PDL=0 probe "$step" 200 -x "${PAIR[@]}" -k "$NARROW" ;;
    pair_no_clearing) probe "$step" 200 -x -p pytest_no_workspace_clearing "${PAIR[@]}" -k "$NARROW" ;;
    workspace) for flags in "--no-fix" "--no-fix --no-foreign" "" "--no-foreign"; do
        PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 scripts/cublas_workspace_probe.py $flags \
          >>"$OUT/workspace.log" 2>&1
        echo "workspace [$flags]: exit $?, $(tail -1 "$OUT/workspace.log")"
      done ;;
    # memcheck on the narrow pair: names the kernel and the address if it is an out-of-bounds access
    memcheck) if command -v compute-sanitizer >/dev/null; then
        timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -m gpu -q -x -p no:cacheprovider \
          "${PAIR[@]}" -k "$NARROW" >"$OUT/memcheck.log" 2>&1
        echo "memcheck: exit $?"; grep -E "Invalid|ERROR SUMMARY|at 0x|by thread" "$OUT/memcheck.log" | head -20
      else
        echo "memcheck: compute-sanitizer not found"
      fi ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
