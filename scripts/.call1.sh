export SWEEP_SHAPES=1x576x576x8,1x1536x1536x8,1x1536x8960x8,1x8960x1536x8,1x2048x2048x8,1x2048x8192x8,1x8192x2048x8,1x4096x4096x8,16x4096x4096x8,16x2048x2048x8
TAIL=6 bash scripts/gpu_validate.sh decode-split-sweep gpu-tests-isolated errors
