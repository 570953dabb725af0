#!/usr/bin/env bash
# On a CUDA machine: build the extension, run the GPU tests of the decoding paths and of the wrapped model,
# then profile compiled decoding (static cache + generate's compiled step) against eager decoding on the
# GPT-2 and 1B Llama profile configs. Logs under $OUT; a summary last.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
if [ -n "${ONLY_LOWRANK:-}" ]; then  # build the low-rank kernels alone: the mixers' bindings as empty stubs
    mkdir -p /tmp/mixer_sources && mv bem/kernels/csrc/fftconv* bem/kernels/csrc/mlstm* /tmp/mixer_sources/ 2>/dev/null
    for family in fftconv mlstm; do
        printf '#include <torch/extension.h>\nnamespace bem { void bind_%s(pybind11::module_& m) { (void)m; } }\n' \
            "$family" > "bem/kernels/csrc/${family}_bindings.cpp"
    done
fi
start=$(date +%s)
if [ -z "${SKIP_BUILD:-}" ] || ! ls bem/_C*.so >/dev/null 2>&1; then
BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_decoding_paths.py \
        tests/gpu/test_wrapped_model.py tests/gpu/test_decode_fast_paths.py >"$OUT/gpu_tests.log" 2>&1
    echo "gpu tests: exit $?"; tail -15 "$OUT/gpu_tests.log"
fi
for config in ${PROFILE_CONFIGS:-profile_gpt2 profile_llama_1b}; do
    python3 - "$config" "$OUT" ${COMPILED_ONLY:+--compiled-only} <<'PY'
import sys, yaml
name, out = sys.argv[1], sys.argv[2]
config = yaml.safe_load(open(f"configs/{name}.yaml"))
config["prefill"]["shapes"] = []          # decoding only: eager and compiled
config["train"]["enabled"] = False
config["kernels"]["run_with_profile"] = False
config["output_dir"] = out
config["decode"]["eager"] = "--compiled-only" not in sys.argv
repeats = __import__("os").environ.get("REPEATS")
if repeats:
    config["timing"]["min_repeats"] = config["timing"]["max_repeats"] = int(repeats)
yaml.safe_dump(config, open(f"{out}/{name}_decode.yaml", "w"))
PY
    timeout 420 python3 profile.py --config "$OUT/${config}_decode.yaml" --output-dir "$OUT" >"$OUT/$config.log" 2>&1
    echo "profile $config: exit $?"; grep -E "^decode|^setting|^---" "$OUT/$config.log"
done
