#!/usr/bin/env bash
# Per kernel of the built extension: registers/shared memory, and how many of its global loads are
# 16 bytes wide and how many tensor-core instructions it issues (a check that costs no GPU time).
so=$(ls bem/_C*.so | head -1)
cuobjdump --dump-resource-usage "$so" | grep -A1 -E "stream_kernel|decode_linear_kernel|lowrank_update_kernel" \
  | grep -oE "(kernelI[^E]*E|REG:[0-9]+|SHARED:[0-9]+|LOCAL:[0-9]+)" | paste -sd' ' | sed 's/ kernelI/\nkernelI/g'
echo
cuobjdump --dump-sass "$so" | awk '
  /Function : / { name = $3; next }
  name ~ /stream_kernel/ {
    if ($0 ~ /LDG\.E\.128/) ldg128[name]++; else if ($0 ~ /LDG/) ldg[name]++;
    if ($0 ~ /HMMA/) mma[name]++;
    if ($0 ~ /STL|LDL/) local_mem[name]++;
  }
  END { for (n in mma) printf "%s\n  LDG.128 %d, other LDG %d, HMMA %d, local %d\n", n, ldg128[n], ldg[n], mma[n], local_mem[n] }'
