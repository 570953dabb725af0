#!/usr/bin/env bash
# On a machine with two CUDA GPUs: train configs/train_llama_1b.yaml (bf16, gradient checkpointing, packed
# 2048-token sequences, batch 4 per GPU) on one GPU, then on two through `accelerate launch --num_processes 2`
# with DDP and with FSDP, and print each run's tokens/s (all GPUs, and per GPU) and peak memory per GPU from
# the trainer's own metrics. Every run has the same global batch (one GPU: 4 x 2 accumulation steps), so the
# losses of the first logged step agree too. Then the two-GPU tests (NCCL). Logs and metrics under $OUT.
#   STEPS (default 30) optimizer steps per run; LOG_EVERY (5): the first window is warm-up and left out.
#   SKIP_BUILD=1 reuses a built extension; FUSED=0 trains without the fused kernels.
set -o pipefail
OUT=${OUT:-out}
STEPS=${STEPS:-30}
LOG_EVERY=${LOG_EVERY:-5}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import transformers as t, torch, accelerate as a; print('transformers', t.__version__, 'torch', torch.__version__, 'accelerate', a.__version__)"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 2 ] || { echo "needs two CUDA GPUs, found $gpus"; exit 1; }

if [ "${FUSED:-1}" != 0 ] && { [ -z "${SKIP_BUILD:-}" ] || ! ls bem/_C*.so >/dev/null 2>&1; }; then
    start=$(date +%s)  # built once here, not just in time by two processes at once
    BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - start )) s"
fi

CONFIG=configs/train_llama_1b.yaml
COMMON=(training.max_steps="$STEPS" training.batch_size=4 data.max_length=2048 data.packing=true data.eval=null
        training.eval_every=0 training.save_every=0 training.log_every="$LOG_EVERY" logging.console=false)
[ "${FUSED:-1}" = 0 ] && COMMON+=(bem.use_fused_kernels=false)
LAUNCH=(accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision bf16
        --dynamo_backend no -m bem train)

run() {  # run NAME COMMAND...: one training run, its log in $OUT/NAME.log, its metrics in $OUT/NAME/
    local name=$1 begin rc
    shift
    rm -rf "${OUT:?}/$name"
    begin=$(date +%s)
    timeout 900 "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc, $(( $(date +%s) - begin )) s"
    [ "$rc" = 0 ] || tail -30 "$OUT/$name.log"
}

# each run builds the same random 1B base from the config's seed (loading a saved copy instead would draw
# BEM's initial weights from another point of the random stream, and the losses would not compare)
run one env CUDA_VISIBLE_DEVICES=0 python3 -m bem train "$CONFIG" "${COMMON[@]}" \
    training.gradient_accumulation_steps=2 training.output_dir="$OUT/one"
for strategy in ddp fsdp; do
    run "$strategy" env CUDA_VISIBLE_DEVICES=0,1 "${LAUNCH[@]}" "$CONFIG" "${COMMON[@]}" \
        training.gradient_accumulation_steps=1 training.distributed="$strategy" training.output_dir="$OUT/$strategy"
done

python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'run':<6}{'GPUs':>5}{'tokens/s':>11}{'per GPU':>10}{'x one GPU':>10}  {'peak GiB per GPU':<18}"
      f"{'loss, first log':>16}{'last loss':>10}")
baseline = None
for name, gpus in (("one", 1), ("ddp", 2), ("fsdp", 2)):
    path = out / name / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    records = [r for r in records if "loss" in r]
    if len(records) < 2:
        print(f"{name:<6}{gpus:>5}  (no metrics: see {name}.log)")
        continue
    rate = statistics.median(r["tokens_per_s"] for r in records[1:])  # the first window holds the warm-up
    per_gpu = rate / gpus
    if name == "one":
        baseline = per_gpu
    ratio = f"{per_gpu / baseline:.3f}" if baseline else "-"
    peaks = " ".join(f"{p:.2f}" for p in records[-1].get("peak_memory_gib_by_rank", []))
    print(f"{name:<6}{gpus:>5}{rate:>11.0f}{per_gpu:>10.0f}{ratio:>10}  {peaks:<18}"
          f"{records[0]['loss']:>16.4f}{records[-1]['loss']:>10.4f}")
PY

# BEM against PEFT LoRA under the same launches: one GPU, then two with DDP and with FSDP
timeout 900 python3 benchmarks/train_throughput.py --processes 2 --config configs/profile_llama_1b.yaml \
    --setups autocast --batch-size 4 --seq-len 2048 --gradient-checkpointing --json "$OUT/processes.json" \
    >"$OUT/processes.log" 2>&1
echo "throughput against LoRA: exit $?"; tail -12 "$OUT/processes.log"

timeout 600 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_training_multiprocess.py >"$OUT/gpu_tests.log" 2>&1
echo "two-GPU tests: exit $?"; tail -15 "$OUT/gpu_tests.log"
