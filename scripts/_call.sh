#!/usr/bin/env bash
# session 19 call 4: the training table on every config, and SmolLM's and GPT-2's gated training rows
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
TAIL=2 TRAIN_REPEATS=10 TRAIN_LIMIT=110 bash scripts/gpu_validate.sh train-sweep > /tmp/validate.txt 2>&1
grep -E "exit" /tmp/validate.txt
rm -f "$OUT/build.log"
for name in smollm_135m gpt2; do
python3 -c 'import sys, yaml
c = yaml.safe_load(open(f"configs/profile_{sys.argv[1]}.yaml"))
c["prefill"]["shapes"] = []; c["decode"]["batch_sizes"] = []; c["decode"]["compiled"] = False
c["kernels"] = {"run_with_profile": False}; c["timing"]["max_seconds"] = 12.0
yaml.safe_dump(c, open(f"/tmp/train_only_{sys.argv[1]}.yaml", "w"), sort_keys=False)' $name
timeout 110 python3 profile.py --config /tmp/train_only_$name.yaml --output-dir /tmp/profile > "$OUT/profile_train_$name.txt" 2>&1
echo "profile $name exit $?"
done
for f in "$OUT"/train_*.log; do grep -E "^(smollm|gpt2|qwen2|llama|phi3)|Error|error" "$f"; done > "$OUT/train_table.txt"
rm -f "$OUT"/train_*.log
cat "$OUT/train_table.txt"
grep -hE "^train|^setting" "$OUT"/profile_train_*.txt
