#!/usr/bin/env bash
# Nsight Compute on each fftconv block kernel at NCU_SHAPES (scripts/gpu/fftconv.sh's `ncu` step, after its build):
# every section to stdout, and the per-instruction source page with its stall samples into
# $OUT/ncu_<kernel>_<shape>.csv.gz (SASS lines with their source lines).
set -o pipefail
cd "$(dirname "$0")/.."
for spec in ${NCU_SHAPES:-8x768x8192 8x768x1024}; do
  for kernel in forward_kernel backward_kernel; do
    report=/tmp/ncu_${kernel%%_*}_$spec
    ncu --clock-control none -k "regex:$kernel" -c 1 --set full --import-source yes -f -o "$report" \
      env PYTHONPATH=. python3 scripts/fftconv_ncu.py "$spec" >"$report.log" 2>&1 || { tail -20 "$report.log"; exit 1; }
    echo "===== $kernel $spec"
    ncu -i "$report.ncu-rep" --page details
    ncu -i "$report.ncu-rep" --page source --csv --print-source sass | gzip >"$OUT/ncu_${kernel%%_*}_$spec.csv.gz"
  done
done
