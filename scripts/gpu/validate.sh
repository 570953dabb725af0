#!/usr/bin/env bash
# Whole-project run on a CUDA machine: build the extension once, then the requested steps, each with
# its own time limit and log under $OUT; a one-line summary per step is printed last.
# Usage: bash scripts/gpu/validate.sh [probe] [errors] [kernel-tests] [gpu-tests] [gpu-tests-isolated]
#        [mixer-tests] [mixer-errors]
#        [fftconv-bench] [mlstm-bench] [mlstm-tests] [training-tests] [sweep] [profile] [train] [train-sweep] [breakdown]
#        [prefill-breakdown] [compiled-breakdown] [controller-profile] [host-cost] [host-cost-ranks] [gemm-tests] [decode-tests] [train-repeat-probe] [inference-tests] [eager-sweep] [compiled-sweep] [compiled-sweep-pack-off] [compiled-host] [warmup-probe]
#        [decode-steps] [train-memory] [quality] [sass-compare] [quant4-tests] [quant4-bench] [nf4-profile] [tma-tests] [bench] [bench-shapes] [mode-sweep] [conv1d-sweep] [decode-split-sweep] [conv1d-split-sweep] [backward-sweep] [sass] [ncu] [cpu-tests]   (bench-shapes reads
#        BENCH_SHAPES, e.g. 1x4096x4096x8,...; the sweeps read SWEEP_SHAPES the same way, or sweep their
#        default shapes; prefill-breakdown reads BREAKDOWN_MODEL: llama-1b or gpt2; sweep reads SWEEP_CONFIGS,
#        comma-separated profile names, default all; train-sweep reads TRAIN_CONFIGS, space-separated;
#        KEEP_BUILD=1 keeps a build made earlier in the same call; NO_BUILD=1 builds nothing)
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
SUMMARY=()
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if ls .whl/mlstm_kernels-*.whl >/dev/null 2>&1; then  # TFLA for the mLSTM benchmark, when its wheel was carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mlstm_site .whl/mlstm_kernels-*.whl \
    && export PYTHONPATH=/tmp/mlstm_site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ -n "${NEWEST:-}" ] && ls .whl/transformers-*.whl >/dev/null 2>&1; then  # NEWEST=1: the carried transformers
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/newest_site \
    .whl/transformers-*.whl && export PYTHONPATH=/tmp/newest_site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f .whl/bnb_site.tar.gz ]; then  # bitsandbytes (its package, CPU and CUDA 13.0 libraries), when carried
  mkdir -p /tmp/bnb_site && tar xzf .whl/bnb_site.tar.gz -C /tmp/bnb_site \
    && export PYTHONPATH=/tmp/bnb_site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" 2>/dev/null || echo "no bitsandbytes"

start=$(date +%s)
if [ -n "${KEEP_BUILD:-}" ] && ls bem/_C*.so >/dev/null 2>&1; then  # a second run in the same call
  SUMMARY+=("build: kept")
elif [ -n "${NO_BUILD:-}" ]; then  # steps that run no kernel of ours (quality: the PyTorch reference paths)
  rm -rf build bem/_C*.so
  export BEM_JIT=0  # and no build just in time either
  SUMMARY+=("build: none (NO_BUILD)")
else
  rm -rf build bem/_C*.so  # a warm machine keeps the last build: always build from scratch
  BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  SUMMARY+=("build: $(( $(date +%s) - start )) s")
fi

source "$(dirname "${BASH_SOURCE[0]}")/step.sh"  # step NAME SECONDS COMMAND...

for what in "$@"; do
  case $what in
    probe) step probe 120 python3 scripts/exception_probe.py ;;
    gpu-tests) step gpu_tests ${GPU_TESTS_LIMIT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu \
        --ignore=tests/gpu/test_kernel_errors.py ;;
    # each GPU test file in a process of its own: a crash in one cannot fail the files after it
    # ISOLATED_FILES: only these (space-separated names, e.g. "test_mlstm test_wrapped_model")
    gpu-tests-isolated) for file in tests/gpu/test_*.py; do
        case $file in *kernel_errors*) continue ;; esac
        [ -z "${ISOLATED_FILES:-}" ] || [[ " $ISOLATED_FILES " == *" $(basename "$file" .py) "* ]] || continue
        step "isolated_$(basename "$file" .py)" 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short "$file"
      done ;;
    kernel-tests) step kernel_tests 200 python3 -m pytest -m gpu -q --maxfail=10 -p no:cacheprovider \
        tests/gpu/test_kernel_forward.py tests/gpu/test_decode_kernels.py tests/gpu/test_fused_gemm.py tests/gpu/test_kernel_backward.py \
        tests/gpu/test_kernel_compile_graphs.py ;;
    # the TMA decode kernel (linear mode 9): its float64 tests, the modes' agreement and the kernels' error messages
    tma-tests) step tma_tests 240 python3 -m pytest -m gpu -q --maxfail=10 -p no:cacheprovider -rf --tb=short \
        tests/gpu/test_kernel_forward.py tests/gpu/test_decode_kernels.py tests/gpu/test_kernel_errors.py \
        -k "tma or every_linear_mode or kernel_errors" ;;
    mode-sweep) step mode_sweep 420 env PYTHONPATH=. python3 scripts/linear_mode_sweep.py ${SWEEP_SHAPES:+--shapes "$SWEEP_SHAPES"} ;;
    conv1d-sweep) step conv1d_sweep 420 env PYTHONPATH=. python3 scripts/linear_mode_sweep.py --conv1d \
        ${SWEEP_SHAPES:+--shapes "$SWEEP_SHAPES"} ;;
    decode-split-sweep) step decode_split_sweep 300 env PYTHONPATH=. python3 scripts/decode_split_sweep.py \
        ${SWEEP_SHAPES:+--shapes "$SWEEP_SHAPES"} ;;
    conv1d-split-sweep) step conv1d_split_sweep ${CONV1D_SWEEP_LIMIT:-200} env PYTHONPATH=. python3 scripts/decode_split_sweep.py --conv1d ${SWEEP_ONLY:+--only "$SWEEP_ONLY"} \
        ${SWEEP_SHAPES:+--shapes "$SWEEP_SHAPES"} ;;
    backward-sweep) step backward_sweep 420 env PYTHONPATH=. python3 scripts/backward_sweep.py ${SWEEP_SHAPES:+--shapes "$SWEEP_SHAPES"} ;;
    bench-shapes) step bench_shapes 400 python3 -m bem.kernels.bench --shapes "$BENCH_SHAPES" --json "$OUT/bench.json" ;;
    sass) step sass 120 bash scripts/sass_summary.sh ;;
    ncu) step ncu 240 ncu --clock-control none -k regex:'stream_kernel|gemv|nvjet|gemm' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
        env PYTHONPATH=. python3 scripts/ncu_kernels.py ;;
    # Nsight Compute on the decode kernels and cuBLAS at DECODE_NCU_SHAPES (scripts/decode_ncu.sh)
    decode-ncu) step decode_ncu ${NCU_LIMIT:-300} bash scripts/decode_ncu.sh ;;
    errors) step kernel_errors 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_kernel_errors.py ;;
    # the mixers' kernels from the whole extension (built above with the system compiler); the tests that make
    # the bindings throw run in a process of their own, so that a crash there cannot take the others' results
    mixer-tests) step mixer_tests ${MIXER_TESTS_LIMIT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        --tb=short -o faulthandler_timeout=120 tests/gpu/test_fftconv.py tests/gpu/test_mlstm.py \
        -k "not refuse and not bad_operands" ;;
    # the paths a training step takes: both backward paths, the eager and the compiled one, whole models
    training-tests) step training_tests 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
        tests/gpu/test_backward_paths.py tests/gpu/test_kernel_backward.py tests/gpu/test_kernel_compile_graphs.py \
        tests/gpu/test_wrapped_model.py ;;
    mlstm-tests) step mlstm_tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
        tests/gpu/test_mlstm.py -k "not refuse and not bad_operands" ;;
    # one training-throughput run per profile config, each with its own log, so a cut-off keeps the others
    train-sweep) for name in ${TRAIN_CONFIGS:-smollm_135m qwen2_1.5b gpt2 llama_1b phi3_mini}; do
        step "train_$name" ${TRAIN_LIMIT:-120} python3 benchmarks/train_throughput.py \
          --config "configs/profile_$name.yaml" --repeats ${TRAIN_REPEATS:-5} --json "$OUT/train_$name.json"
      done ;;
    mixer-errors) step mixer_errors 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
        tests/gpu/test_fftconv.py tests/gpu/test_mlstm.py -k "refuse or bad_operands" ;;
    fftconv-bench) step fftconv_bench ${BENCH_LIMIT:-240} python3 -m bem.kernels.bench --fftconv --json "$OUT/fftconv_bench.json" ;;
    mlstm-bench) step mlstm_bench ${BENCH_LIMIT:-300} python3 -m bem.kernels.bench --mlstm --json "$OUT/mlstm_bench.json" ;;
    sweep) step sweep ${SWEEP_LIMIT:-540} python3 profile.py --sweep ${SWEEP_CONFIGS:-} --output-dir "$OUT" ;;
    # the eager settings only (compiled decoding off, at most EAGER_MAX_SECONDS of timed repeats a setting):
    # copies of the configs named in SWEEP_CONFIGS (comma-separated), one report each and the sweep's table
    eager-sweep) mkdir -p /tmp/eager_configs && paths=()
      for name in ${SWEEP_CONFIGS//,/ }; do
        sed -e 's/^  compiled: true.*/  compiled: false/' -e "s/^  max_seconds: .*/  max_seconds: ${EAGER_MAX_SECONDS:-8.0}/" \
          "configs/profile_$name.yaml" >"/tmp/eager_configs/profile_$name.yaml"
        paths+=("/tmp/eager_configs/profile_$name.yaml")
      done
      step eager_sweep ${SWEEP_LIMIT:-540} python3 profile.py --sweep "$(IFS=,; echo "${paths[*]}")" --output-dir "$OUT" ;;
    # the compiled-decoding settings only (no prefill, eager decoding or training; at most
    # COMPILED_MAX_SECONDS of timed repeats a setting; COMPILED_BATCHES, e.g. 1,16, instead of the config's
    # batch sizes; COMPILED_LORA=0 leaves the LoRA peer out): copies of the configs named in SWEEP_CONFIGS
    compiled-sweep|compiled-sweep-pack-off) mkdir -p /tmp/compiled_configs && paths=()
      for name in ${SWEEP_CONFIGS//,/ }; do
        python3 -c 'import sys, yaml
name, seconds = sys.argv[1], float(sys.argv[2])
config = yaml.safe_load(open(f"configs/profile_{name}.yaml"))
config["prefill"]["shapes"], config["train"]["enabled"] = [], False
config.setdefault("kernels", {})["run_with_profile"] = False
config["decode"].update(eager=False, compiled=True)
config["timing"]["max_seconds"] = seconds
if sys.argv[3]:
    config["decode"]["batch_sizes"] = [int(b) for b in sys.argv[3].split(",")]
config["lora"] = config.get("lora", True) and sys.argv[4] != "0"
yaml.safe_dump(config, open(f"/tmp/compiled_configs/profile_{name}.yaml", "w"), sort_keys=False)' \
          "$name" "${COMPILED_MAX_SECONDS:-10.0}" "${COMPILED_BATCHES:-}" "${COMPILED_LORA:-1}"
        paths+=("/tmp/compiled_configs/profile_$name.yaml")
      done
      # compiled-sweep-pack-off: the same sweep without the adapter pack (scripts/profile_pack_off.py)
      off=${what#compiled-sweep}
      step "compiled_sweep${off//-/_}" ${SWEEP_LIMIT:-540} env PYTHONPATH=. python3 \
        "$([ -n "$off" ] && echo scripts/profile_pack_off.py || echo profile.py)" \
        --sweep "$(IFS=,; echo "${paths[*]}")" --output-dir "$OUT/sweep${off//-/_}" ;;
    profile) step profile 300 python3 profile.py --config configs/profile_llama_1b.yaml --output-dir "$OUT" ;;
    train) step train 300 python3 benchmarks/train_throughput.py --config configs/profile_llama_1b.yaml \
        --json "$OUT/train.json" ;;
    bench) step bench 480 python3 -m bem.kernels.bench --json "$OUT/bench.json" ;;
    breakdown) step breakdown 300 env PYTHONPATH=. python3 scripts/decode_breakdown.py ;;
    host-cost) step host_cost ${HOST_COST_LIMIT:-300} env PYTHONPATH=. python3 scripts/host_cost.py \
        ${HOST_COST_CONFIGS:+--configs "$HOST_COST_CONFIGS"} --json "$OUT/host_cost.json" ;;
    # the one-call rows at other ranks (HOST_COST_RANKS, space-separated)
    host-cost-ranks) for rank in ${HOST_COST_RANKS:-16 32}; do
        step "host_cost_r$rank" 120 env PYTHONPATH=. python3 scripts/host_cost.py --calls-only --rank "$rank" \
          ${HOST_COST_CONFIGS:+--configs "$HOST_COST_CONFIGS"} --json "$OUT/host_cost_r$rank.json"
      done ;;
    gemm-tests) step gemm_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
        tests/gpu/test_fused_gemm.py tests/gpu/test_kernel_forward.py tests/gpu/test_decode_kernels.py ;;
    # the train step's repeats as the profiler times them, three ways (TRAIN_PROBE_CONFIG: a profile name)
    train-repeat-probe) for how in "" "--no-pause" "--collect"; do
        step "train_probe${how:+_${how#--}}" 120 env PYTHONPATH=. python3 scripts/train_repeat_probe.py \
          --config "configs/profile_${TRAIN_PROBE_CONFIG:-llama_1b}.yaml" --repeats ${TRAIN_PROBE_REPEATS:-16} $how
      done ;;
    # the decoding kernels' tests alone (after a change to their dispatch)
    decode-tests) step decode_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
        tests/gpu/test_kernel_forward.py tests/gpu/test_decode_kernels.py -k decode tests/gpu/test_decode_fast_paths.py ;;
    # the inference paths of a wrapped layer and model, each file in a process of its own
    inference-tests) for file in test_decode_fast_paths test_wrapped_model test_decoding_paths; do
        step "inference_$file" ${INFERENCE_TESTS_LIMIT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
          --tb=short "tests/gpu/$file.py"
      done ;;
    # the routing controller alone at every profile config's shapes; CONTROLLER_BEFORE: an earlier controller.py
    controller-profile) step controller_profile ${CONTROLLER_LIMIT:-240} python3 scripts/controller_profile.py \
        ${CONTROLLER_CONFIGS:+--configs $CONTROLLER_CONFIGS} ${CONTROLLER_BEFORE:+--before "$CONTROLLER_BEFORE"} \
        --json "$OUT/controller_profile.json" ;;
    # decoding timed step by step (scripts/decode_steps.py): DECODE_CONFIGS (profile names), DECODE_ARGS (its flags)
    # the SASS of every kernel against a build of SASS_BEFORE (a tree or a .tar.gz of bem/ and setup.py)
    sass-compare) step sass_compare ${SASS_LIMIT:-240} bash scripts/gpu/sass_compare.sh "${SASS_BEFORE:-.whl/before_split.tar.gz}" ;;
    # the 4-bit linear: its GPU tests, and the CPU tests that need bitsandbytes
    quant4-tests) step quant4_tests ${QUANT4_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
        tests/gpu/test_quant4_kernel.py tests/gpu/test_quant4_prefill.py tests/test_quant4_layout.py \
        tests/test_quantized_bases.py ;;
    quant4-bench) step quant4_bench ${QUANT4_BENCH_LIMIT:-200} python3 -m bem.kernels.bench --quant4 --json "$OUT/quant4_bench.json" ;;
    # where a training step's memory goes, BEM against LoRA (MEMORY_CONFIG: a profile name; MEMORY_ARGS, e.g.
    # "--setup bf16 --allocations")
    train-memory) step train_memory ${MEMORY_LIMIT:-240} env PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} python3 \
        scripts/train_memory_probe.py --config "configs/profile_${MEMORY_CONFIG:-qwen2_0.5b_nf4}.yaml" ${MEMORY_ARGS:-} ;;
    # the quality benchmark at the H200 settings of docs/quality.md (QUALITY_ARGS: suites, seeds, ...), 16 runs at
    # once; its JSON, log and plot in one archive (a call returns a limited number of files)
    quality) mkdir -p "$OUT/quality" && step quality ${QUALITY_LIMIT:-500} env PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} \
        python3 benchmarks/quality.py --base-width 512 --base-layers 8 --pretrain-steps 1500 --lr 1e-3 --jobs 16 \
        --threads 1 --cache-dir /tmp/quality_cache --json "$OUT/quality/quality.json" --plot "$OUT/quality/quality.png" \
        ${QUALITY_ARGS:---suites multitask --seeds 3}; tar czf "$OUT/quality.tar.gz" -C "$OUT" quality && rm -rf "$OUT/quality" ;;
    nf4-profile) step nf4_profile ${NF4_LIMIT:-300} python3 profile.py --config configs/profile_qwen2_0.5b_nf4.yaml \
        --repeats ${NF4_REPEATS:-5} --output-dir "$OUT/nf4" ;;
    decode-steps) step "decode_steps${DECODE_TAG:+_$DECODE_TAG}" ${DECODE_LIMIT:-400} env PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} \
        python3 scripts/decode_steps.py $(for c in ${DECODE_CONFIGS:-llama_1b}; do echo --config "configs/profile_$c.yaml"; done) \
        ${DECODE_ARGS:-} --json "$OUT/decode_steps${DECODE_TAG:+_$DECODE_TAG}.json" ;;
    # a compiled decoding step's device time by kernel kind, base against BEM (BREAKDOWN_CONFIGS: profile names)
    compiled-breakdown) step compiled_breakdown ${BREAKDOWN_LIMIT:-300} env PYTHONPATH=. python3 \
        scripts/compiled_decode_breakdown.py $(for c in ${BREAKDOWN_CONFIGS:-smollm_135m}; do echo --config \
        "configs/profile_$c.yaml"; done) --batch "${BREAKDOWN_BATCH:-1,16}" --json "$OUT/compiled_breakdown.json" ;;
    # a compiled decoding step's host time by profiler event, base against BEM (COMPILED_HOST_CONFIG: a profile name)
    compiled-host) step compiled_host ${BREAKDOWN_LIMIT:-300} env PYTHONPATH=. python3 scripts/compiled_step_host.py \
        --config "configs/profile_${COMPILED_HOST_CONFIG:-smollm_135m}.yaml" --batch "${COMPILED_HOST_BATCH:-1}" ;;
    # how many generates compiled decoding takes to reach its speed, base against BEM, with dynamo's and the
    # CUDA-graph trees' logs (PROBE_CONFIG, PROBE_BATCH, PROBE_CALLS, PROBE_ORDER: interleaved or separate); the
    # stack traces under each CUDA-graph message are dropped (a graph re-recorded every step wrote 775 MB of them)
    warmup-probe) export PROBE_CONFIG PROBE_BATCH PROBE_CALLS PROBE_ORDER PROBE_LOGS
      step "warmup_probe_${PROBE_ORDER:-interleaved}" ${PROBE_LIMIT:-300} bash -c 'set -o pipefail
        PYTHONPATH=. TORCH_LOGS=${PROBE_LOGS:-cudagraphs,recompiles,perf_hints} python3 scripts/compiled_warmup_probe.py \
          --config "configs/profile_${PROBE_CONFIG:-phi3_mini}.yaml" --batch "${PROBE_BATCH:-16}" \
          --calls "${PROBE_CALLS:-4}" --order "${PROBE_ORDER:-interleaved}" 2>&1 \
          | grep -v -E "\[__cudagraphs\]( {2,}|$| $)"' ;;
    prefill-breakdown) step prefill_breakdown 300 env PYTHONPATH=. python3 scripts/prefill_breakdown.py \
        ${BREAKDOWN_MODEL:+--model "$BREAKDOWN_MODEL"} ;;
    cpu-tests) step cpu_tests 300 python3 -m pytest -q -x -p no:cacheprovider tests --ignore=tests/gpu ;;
    *) echo "unknown step $what" >&2; exit 2 ;;
  esac
done
printf '%s\n' "${SUMMARY[@]}"
if [ -n "${ARCHIVE:-}" ]; then  # a call brings back few files: every log in one archive
  (cd "$OUT" && tar czf /tmp/logs.tgz --exclude=console.log . && find . -mindepth 1 ! -name console.log -delete \
     && mv /tmp/logs.tgz .)
fi
