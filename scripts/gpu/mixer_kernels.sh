#!/usr/bin/env bash
# Both sequence-mixer kernel families on a CUDA machine in one call: each built as its own module and its GPU
# tests run side by side, then each benchmark alone on the GPU. Logs under $OUT/mlstm and $OUT/fftconv.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/mlstm" "$OUT/fftconv"
(OUT=$OUT/mlstm TESTS_LIMIT=${TESTS_LIMIT:-150} bash scripts/gpu/mlstm.sh tests >"$OUT/mlstm/tests.txt" 2>&1) &
(OUT=$OUT/fftconv TESTS_LIMIT=${TESTS_LIMIT:-150} bash scripts/gpu/fftconv.sh tests >"$OUT/fftconv/tests.txt" 2>&1) &
wait
OUT=$OUT/mlstm BENCH_LIMIT=${BENCH_LIMIT:-100} bash scripts/gpu/mlstm.sh bench-quick >"$OUT/mlstm/bench.txt" 2>&1
OUT=$OUT/fftconv BENCH_LIMIT=${BENCH_LIMIT:-100} bash scripts/gpu/fftconv.sh quick-bench >"$OUT/fftconv/bench.txt" 2>&1
for family in mlstm fftconv; do
    echo "=== $family tests"; grep -E "passed|failed|error|exit" "$OUT/$family/tests.txt" | tail -6
    echo "=== $family bench"; tail -25 "$OUT/$family/bench.txt"
done
