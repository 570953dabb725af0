#!/usr/bin/env bash
# Nsight Compute on the decode kernels and cuBLAS's GEMM (or GEMV, at one token) beside them at
# DECODE_NCU_SHAPES (after a build): the sections to $OUT/decode_ncu.txt, and each kernel's stall reasons by
# region from its source page.
# DECODE_NCU_MODE / DECODE_NCU_SPLIT: one kernel and split instead of the dispatch's (9: the TMA kernel).
set -o pipefail
cd "$(dirname "$0")/.."
shapes=${DECODE_NCU_SHAPES:-16x1536x8960x8,16x2048x8192x8,16x8192x2048x8}
report=/tmp/decode_ncu
ncu --clock-control none -k "regex:decode_|nvjet|gemm|gemv|splitK" --set full --import-source yes -f -o "$report" \
  env PYTHONPATH=. python3 scripts/ncu_kernels.py --decode "$shapes" \
  --mode "${DECODE_NCU_MODE:-0}" --split "${DECODE_NCU_SPLIT:-0}" >"$report.log" 2>&1 || { tail -20 "$report.log"; exit 1; }
ncu -i "$report.ncu-rep" --page details >"$OUT/decode_ncu.txt"
ncu -i "$report.ncu-rep" --page source --csv --print-source sass | gzip >"$OUT/decode_ncu_source.csv.gz"
grep -E "^  [a-z_A-Z].*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Block Limit|Waves Per SM|Grid Size|Cluster Size" "$OUT/decode_ncu.txt" | cut -c1-150
