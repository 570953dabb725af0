#!/usr/bin/env bash
# The crash of `tests/gpu/test_decode_fast_paths.py` followed by `tests/gpu/test_decoding_paths.py` in one
# process ("unspecified launch failure"; each file alone passes): each run below in a process of its own,
# a line each, then memcheck on the failing pair. Logs under $OUT. SKIP_BUILD=1 reuses a built extension.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} HF_HUB_OFFLINE=1
if [ -z "${SKIP_BUILD:-}" ] || ! ls bem/_C*.so >/dev/null 2>&1; then
  BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
PAIR=(tests/gpu/test_decode_fast_paths.py tests/gpu/test_decoding_paths.py)
probe() {  # probe NAME SECONDS ARGS...: one pytest process (scripts/ on the path for the plugin)
  local name=$1 limit=$2
  shift 2
  PYTHONPATH=scripts${PYTHONPATH:+:$PYTHONPATH} timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider \
    --tb=short "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $?, $(grep -E 'passed|failed' "$OUT/$name.log" | tail -1)"
}
# 1. a dropped model's controller graphs collected inside another capture
probe dropped_graphs 120 tests/gpu/test_decoding_paths.py -k dropped_models_controller_graphs
# 2. the pair, as it crashed; then with the garbage collected after every test
probe pair 200 "${PAIR[@]}"
probe pair_collected 200 -p pytest_collect_garbage "${PAIR[@]}"
# 3. the pair with only the fast-path test that captures a whole model, then the first decoding test
probe pair_narrow 150 "${PAIR[@]}" -k "cuda_graph_captured_decode or (equal_the_full_forward and llama-fp32)"
# 4. memcheck on the narrow pair: names the kernel and the address if it is an out-of-bounds access
if command -v compute-sanitizer >/dev/null; then
  timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -m gpu -q -x -p no:cacheprovider \
    "${PAIR[@]}" -k "cuda_graph_captured_decode or (equal_the_full_forward and llama-fp32)" >"$OUT/memcheck.log" 2>&1
  echo "memcheck: exit $?"; grep -E "Invalid|ERROR SUMMARY|at 0x|by thread" "$OUT/memcheck.log" | head -20
else
  echo "memcheck: compute-sanitizer not found"
fi
