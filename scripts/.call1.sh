TAIL=30 SWEEP_CONFIGS=smollm_135m SWEEP_LIMIT=470 bash scripts/gpu_validate.sh decode-tests compiled-sweep
