#!/usr/bin/env bash
# The fftconv kernels on a CUDA machine, built as a module of their own (bem_fftconv_dev, from
# scripts/fftconv_dev_module.cpp) so that the other families' sources need not compile: the build, the GPU
# tests, the benchmark; each step's log under $OUT, a one-line summary per step last.
#   bash scripts/gpu/fftconv.sh objects            compile the CUDA sources into .fftconv_objects/ here (nvcc
#                                                  13, sm_90a): a run that finds that folder (carry it) only
#                                                  compiles the bindings against torch and links the objects
#   bash scripts/gpu/fftconv.sh [tests] [bench] [quick-bench] [kernel-times] [ncu] [variants]
set -o pipefail
cd "$(dirname "$0")/../.."
NVCC_FLAGS=(-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --use_fast_math -lineinfo -Xcompiler -fPIC
            -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
            -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr)

if [ "$1" = objects ]; then
  rm -rf .fftconv_objects && mkdir -p .fftconv_objects
  for source in bem/kernels/csrc/fftconv/*.cu; do
    name=$(basename "$source" .cu)
    nvcc "${NVCC_FLAGS[@]}" -Xptxas -v -c "$source" -o ".fftconv_objects/$name.o" >".fftconv_objects/$name.log" 2>&1 &
  done
  wait
  grep -l "error" .fftconv_objects/*.log && exit 1
  grep -h "spill" .fftconv_objects/*.log | sort | uniq -c
  exit 0
fi

OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=9.0a BEM_FFTCONV_DEV_MODULE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# bem._C (every family, whatever state the others are in) is neither built nor loaded: these kernels come
# from their own module
export BEM_DISABLE_KERNELS=1 BEM_JIT=0
[ -d .fftconv_objects ] && export BEM_FFTCONV_DEV_OBJECTS=$PWD/.fftconv_objects
SUMMARY=()
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
nvcc --version | tail -1
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"

start=$(date +%s)
build() { python3 -c "from bem.kernels.fftconv import custom_ops; assert custom_ops.extension() is not None"; }
if ! build >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"
  [ -z "$BEM_FFTCONV_DEV_OBJECTS" ] && exit 1
  echo "linking the prebuilt objects failed: compiling the CUDA sources instead"
  unset BEM_FFTCONV_DEV_OBJECTS
  build >"$OUT/build_sources.log" 2>&1 || { tail -60 "$OUT/build_sources.log"; exit 1; }
fi
SUMMARY+=("build: $(( $(date +%s) - start )) s${BEM_FFTCONV_DEV_OBJECTS:+ (prebuilt objects)}")

source "$(dirname "${BASH_SOURCE[0]}")/step.sh"  # step NAME SECONDS COMMAND...

for what in "${@:-tests bench}"; do
  for one in $what; do
    case $one in
      # not the tests that make the bindings throw: a C++ exception through this just-in-time module crashes
      # the process; scripts/gpu/validate.sh's mixer-errors step runs them against bem._C
      tests) step gpu_tests "${TESTS_LIMIT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
          tests/gpu/test_fftconv.py -k "not refuse and not bad_operands" ;;
      cpu-tests) step cpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_fftconv_reference.py ;;
      bench) step bench "${BENCH_LIMIT:-240}" python3 -m bem.kernels.bench --fftconv --json "$OUT/bench.json" ;;
      quick-bench) step bench "${BENCH_LIMIT:-240}" python3 -m bem.kernels.bench --fftconv --quick \
          --json "$OUT/bench.json" ;;
      kernel-times) step kernel_times 150 env PYTHONPATH=. python3 scripts/fftconv_kernel_times.py ;;
      ncu) step ncu "${NCU_LIMIT:-300}" bash scripts/fftconv_ncu.sh ;;
      variants) step variants "${VARIANTS_LIMIT:-300}" bash scripts/fftconv_variants.sh ;;
      *) echo "unknown step $one" >&2; exit 2 ;;
    esac
  done
done
printf '%s\n' "${SUMMARY[@]}"
