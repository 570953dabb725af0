#!/usr/bin/env bash
# Whether two trees build the same kernels: builds the tree given (a .tar.gz of bem/ and setup.py, or a folder)
# beside the checkout's own build, and compares the SASS of every kernel of the two extensions, one function at
# a time. Names are compared with the per-file hash of anonymous namespaces taken out (it follows the source's
# path). Usage: bash scripts/gpu/sass_compare.sh OLD_TREE   (the checkout must be built: bem/_C*.so)
set -eo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
old=$1
rm -rf /tmp/sass_old && mkdir -p /tmp/sass_old
if [ -d "$old" ]; then cp -r "$old"/bem "$old"/setup.py /tmp/sass_old/; else tar xzf "$old" -C /tmp/sass_old; fi
(cd /tmp/sass_old && BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/sass_old_build.log" 2>&1) \
  || { tail -30 "$OUT/sass_old_build.log"; exit 1; }
split_functions() {  # cuobjdump's SASS of $1 -> one file per function under $2, addresses and comments dropped
  mkdir -p "$2"
  cuobjdump -sass "$1" | sed -E 's/_GLOBAL__N__[0-9a-f]{8}_/_GLOBAL__N__X_/g; s/_INTERNAL_[0-9a-f]{8}_/_INTERNAL_X_/g' \
    | awk -v dir="$2" '/Function : /{name=$3; file=dir "/" substr(name, 1, 200); next}
                       file && /^ +\/\*[0-9a-f]+\*\//{sub(/^ +\/\*[0-9a-f]+\*\/ +/, ""); sub(/ *\/\*.*$/, ""); print >> file}'
}
rm -rf /tmp/sass_fn_old /tmp/sass_fn_new
split_functions /tmp/sass_old/bem/_C*.so /tmp/sass_fn_old
split_functions bem/_C*.so /tmp/sass_fn_new
old_n=$(ls /tmp/sass_fn_old | wc -l); new_n=$(ls /tmp/sass_fn_new | wc -l)
same=0; differ=()
for f in /tmp/sass_fn_old/*; do
  n=$(basename "$f")
  if cmp -s "$f" "/tmp/sass_fn_new/$n"; then same=$((same + 1)); else differ+=("$n"); fi
done
only_new=$(comm -13 <(ls /tmp/sass_fn_old) <(ls /tmp/sass_fn_new) | wc -l)
{
  echo "kernels: old build $old_n, new build $new_n; identical SASS: $same; differing or missing: ${#differ[@]}; only in the new build: $only_new"
  for n in "${differ[@]}"; do echo "  differs: $n"; done
} | tee "$OUT/sass_compare.txt"
[ "${#differ[@]}" -eq 0 ]
