#!/usr/bin/env bash
# On a machine with two CUDA GPUs, within one call's time (DEADLINE seconds, default 570), most important first:
#   1. the two-GPU tests (NCCL; tiny models without the extension, so they run while it builds);
#   2. BEM against PEFT LoRA under the same launches: one GPU, then two with DDP and with FSDP
#      (benchmarks/train_throughput.py --processes 2, the Llama 1B config, b4 s2048 per GPU);
#   3. `bem train` on configs/train_llama_1b.yaml on one GPU, then through `accelerate launch --num_processes 2`
#      with DDP and with FSDP, with the same global batch (one GPU: 4 x 2 accumulation steps): tokens/s, peak
#      memory per GPU and the losses, from the trainer's own metrics.
# A step that would not fit in the time left is skipped and says so. Logs and metrics under $OUT.
#   STEPS (default 16) optimizer steps per training run; LOG_EVERY (2): the first window is warm-up, left out.
#   PROBE=1: the FSDP probe first (below).
#   REPEATS (5): timed steps per variant in the benchmark. SKIP=tests,bench,train leaves steps out.
#   PROFILE=1: the benchmark also traces two steps per launch and variant (operator tables in $OUT/profile).
#   TRAIN_STRATEGIES (default "ddp fsdp"): the `bem train` launches on two GPUs. TESTS_K, TEST_ROUNDS: which
#   two-GPU tests run (pytest -k), and how many times. BENCH_STRATEGIES (default ddp,fsdp): the benchmark's launches.
set -o pipefail
OUT=${OUT:-out}
STEPS=${STEPS:-16}
LOG_EVERY=${LOG_EVERY:-2}
DEADLINE=$(( $(date +%s) + ${DEADLINE:-570} ))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-20} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import transformers as t, torch, accelerate as a; print('transformers', t.__version__, 'torch', torch.__version__, 'accelerate', a.__version__)"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 2 ] || { echo "needs two CUDA GPUs, found $gpus"; exit 1; }
SUMMARY=()
skipped() { [[ ",${SKIP:-}," == *",$1,"* ]]; }
left() { echo $(( DEADLINE - $(date +%s) )); }

run() {  # run NAME SECONDS COMMAND...: one step, its log in $OUT/NAME.log; skipped when the time left is short
    local name=$1 limit=$2 begin rc
    shift 2
    [ "$(left)" -gt 20 ] || { SUMMARY+=("$name: skipped, no time left"); return; }
    [ "$limit" -le "$(left)" ] || limit=$(left)
    begin=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    SUMMARY+=("$name: exit $rc, $(( $(date +%s) - begin )) s (limit $limit s)")
    [ "$rc" = 0 ] || tail -15 "$OUT/$name.log"
}

# the extension builds in the background while the tests (which train without it) run
build_rc=0
needs_build() { ! skipped bench || ! skipped train; }  # the tests and the probe train without the extension
if needs_build && { [ -z "${SKIP_BUILD:-}" ] || ! ls bem/_C*.so >/dev/null 2>&1; }; then
    ( start=$(date +%s); BEM_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; rc=$?
      echo "build: exit $rc, $(( $(date +%s) - start )) s" >"$OUT/build.status"; exit $rc ) &
    build_pid=$!
fi
# BEM_DISABLE_KERNELS: a test process must not load the extension the build finishes meanwhile (a run and its
# resumption would then compute with different kernels)
# TESTS_K picks tests by pytest's -k; TEST_ROUNDS (default 1) runs them that many times (is a failure flaky?)
# PROBE=1: where runs of the same FSDP training part ways (scripts/fsdp_resume_probe.py): PROBE_ROUNDS runs of
# PROBE_STEPS steps without checkpoints, then the same with a device synchronisation and a barrier around the
# controller's gradient all-reduce (PROBE_VARIANTS, default "plain sync")
if [ -n "${PROBE:-}" ]; then
    for sync in ${PROBE_VARIANTS:-plain sync}; do
        [ "$sync" = sync ] && sync=1 || sync=""
        run "probe${sync:+_sync}" 200 env BEM_DISABLE_KERNELS=1 PROBE_SYNC=$sync python3 scripts/fsdp_resume_probe.py \
            --rounds "${PROBE_ROUNDS:-4}" --steps "${PROBE_STEPS:-3}" --save-every 0 --out "$OUT"
        tail -n 30 "$OUT/probe${sync:+_sync}.log"
    done
fi
if ! skipped tests; then
    for round in $(seq "${TEST_ROUNDS:-1}"); do
        run "gpu_tests_$round" 240 env BEM_DISABLE_KERNELS=1 python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
            --tb=short ${TESTS_K:+-k "$TESTS_K"} tests/test_training_multiprocess.py
    done
fi
if [ -n "${build_pid:-}" ]; then
    wait "$build_pid" || build_rc=$?
    SUMMARY+=("$(cat "$OUT/build.status")")
    [ "$build_rc" = 0 ] || { tail -30 "$OUT/build.log"; printf '%s\n' "${SUMMARY[@]}"; exit 1; }
fi

skipped bench || run throughput 300 python3 benchmarks/train_throughput.py --processes 2 \
    --config configs/profile_llama_1b.yaml --setups autocast --batch-size 4 --seq-len 2048 \
    --gradient-checkpointing --repeats "${REPEATS:-5}" --json "$OUT/processes.json" \
    --strategies "${BENCH_STRATEGIES:-ddp,fsdp}" \
    ${PROFILE:+--profile "$OUT/profile"}

CONFIG=configs/train_llama_1b.yaml
COMMON=(training.max_steps="$STEPS" training.batch_size=4 data.max_length=2048 data.packing=true data.eval=null
        training.eval_every=0 training.save_every=0 training.log_every="$LOG_EVERY" logging.console=false)
LAUNCH=(accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision bf16 --dynamo_backend no)
# GC_PROBE=1: every run through scripts/gc_pause_probe.py (the garbage collector's pauses in the loop, under
# $OUT/gc); a strategy named NAME_unfrozen in TRAIN_STRATEGIES runs NAME without bem train's frozen setup
entry() {  # entry RUN [--unfrozen]: what runs `bem train` for RUN
    if [ -n "${GC_PROBE:-}" ]; then echo scripts/gc_pause_probe.py --gc-out "$OUT/gc/$1" $2; else echo -m bem train; fi
}
# each run builds the same random 1B base from the config's seed, so the losses compare
RUNS=(one)
if ! skipped train; then
    run train_one 100 env CUDA_VISIBLE_DEVICES=0 python3 $(entry one) "$CONFIG" "${COMMON[@]}" \
        training.gradient_accumulation_steps=2 training.output_dir="$OUT/one"
    for name in ${TRAIN_STRATEGIES:-ddp fsdp}; do
        strategy=${name%_unfrozen} unfrozen=""
        [ "$strategy" != "$name" ] && unfrozen=--unfrozen
        run "train_$name" 100 env CUDA_VISIBLE_DEVICES=0,1 "${LAUNCH[@]}" $(entry "$name" $unfrozen) "$CONFIG" \
            "${COMMON[@]}" training.gradient_accumulation_steps=1 training.distributed="$strategy" \
            training.output_dir="$OUT/$name"
        RUNS+=("$name")
    done
    # ACCUMULATING=1: twice the global batch, how much of a step's cost is paid once per optimizer step
    if [ -n "${ACCUMULATING:-}" ]; then
        run train_ddp_accumulating 100 env CUDA_VISIBLE_DEVICES=0,1 "${LAUNCH[@]}" $(entry ddp_accumulating) \
            "$CONFIG" "${COMMON[@]}" training.gradient_accumulation_steps=2 training.distributed=ddp \
            training.output_dir="$OUT/ddp_accumulating"
        RUNS+=(ddp_accumulating)
    fi
    [ -n "${GC_PROBE:-}" ] && grep -h "generation\|no collection" "$OUT"/train_*.log
    python3 - "$OUT" "${RUNS[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'run':<17}{'GPUs':>5}{'tokens/s':>11}{'per GPU':>10}{'x one GPU':>10}  {'peak GiB per GPU':<18}"
      f"{'losses, every log':<40}")
baseline = None
for name in sys.argv[2:]:
    gpus = 1 if name == "one" else 2
    path = out / name / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    records = [r for r in records if "loss" in r]
    if len(records) < 2:
        print(f"{name:<17}{gpus:>5}  (no metrics: see train_{name}.log)")
        continue
    rates = [r["tokens_per_s"] for r in records[1:]]  # the first window holds the warm-up
    rate = statistics.median(rates)
    per_gpu = rate / gpus
    if name == "one":
        baseline = per_gpu
    ratio = f"{per_gpu / baseline:.3f}" if baseline else "-"
    peaks = " ".join(f"{p:.2f}" for p in records[-1].get("peak_memory_gib_by_rank", []))
    print(f"{name:<17}{gpus:>5}{rate:>11.0f}{per_gpu:>10.0f}{ratio:>10}  {peaks:<18}"
          + " ".join(f"{r['loss']:.4f}" for r in records))
    print(f"{'':<11}tokens/s of each window: " + " ".join(f"{r['tokens_per_s']:.0f}" for r in records)
          + f"  (after the first: {min(rates):.0f} to {max(rates):.0f})")
PY
fi
[ -f "$OUT/throughput.log" ] && tail -8 "$OUT/throughput.log"
printf '%s\n' "${SUMMARY[@]}"
# a call brings back few files: the logs and metrics in one archive, the weights left behind
# (tar's exit 1 is "a file changed as it was read": console.log, still being written, is left out anyway)
(cd "$OUT" && find . -name '*.safetensors' -delete && { tar czf logs.tgz --warning=no-file-changed --exclude=logs.tgz \
   --exclude=console.log . ; [ $? -le 1 ]; } && find . -mindepth 1 ! -name logs.tgz ! -name console.log \
   ! -name processes.json -delete)
