#!/usr/bin/env bash
# GPU tests (GPU_TESTS: files, one pytest process; ERROR_TESTS: files, another), then two probes in one call: (1) which half of a hand-captured decoding step followed by a compiled `generate`
# breaks the latter (scripts/capture_then_compile_probe.py, each variant in its own process, in parallel);
# (2) where a training step's time goes, BEM against LoRA (scripts/train_breakdown.py). Logs under $OUT.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
start=$(date +%s)
BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
if [ -n "${GPU_TESTS:-}" ]; then
  timeout ${TESTS_LIMIT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short $GPU_TESTS >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?, $(( $(date +%s) - start )) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -12
fi
if [ -n "${ERROR_TESTS:-}" ]; then
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short $ERROR_TESTS >"$OUT/error_tests.log" 2>&1
  echo "error tests: exit $?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/error_tests.log" | tail -6
fi
for variant in ${PROBE_VARIANTS-bem-then-bem plain-then-plain bem-then-plain plain-then-bem eager-bem-then-bem nographs}; do
  extra=()
  [ "$variant" = nographs ] && extra=(env BEM_CONTROLLER_GRAPHS=0)
  timeout 200 "${extra[@]}" env PYTHONPATH=. python3 scripts/capture_then_compile_probe.py "$variant" >"$OUT/probe_$variant.log" 2>&1 &
done
wait
for log in "$OUT"/probe_*.log; do tail -1 "$log"; done
echo "probes: $(( $(date +%s) - start )) s"
for spec in ${TRAIN_SPECS-smollm_135m:bf16}; do
  name=${spec%%:*}; rest=${spec#*:}; setup=${rest%%:*}; extra=${rest#"$setup"}
  timeout ${TRAIN_LIMIT:-150} python3 scripts/train_breakdown.py --config "configs/profile_$name.yaml" --setup "$setup" \
    ${extra:+${extra//:/ }} >"$OUT/train_${name}_$setup.log" 2>&1
  echo "train $spec: exit $?, $(( $(date +%s) - start )) s"
  grep -v "^\s*$" "$OUT/train_${name}_$setup.log" | grep -v Warning | head -${TRAIN_LINES:-60}
done
