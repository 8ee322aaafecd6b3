#!/usr/bin/env bash
# All GPU checks of a session in one call (the device machine has torch/transformers, not hpcgpu):
#   tests/gpu, the train-throughput benchmark (1 and 2 GPUs) and the checkpoint benchmark.
# Output files go to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/hpcgpu-gpu-out}"; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpus.txt"
step() { echo "=== $*"; "$@"; echo "=== exit $?"; }
step python3 -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.log"
step python3 benchmarks/checkpoint.py --model gpt2-124m --repeats 3 2>&1 | grep -v Warning | tail -8 | tee "$OUT/checkpoint.log"
step python3 benchmarks/train_throughput.py --gpus "${BENCH_GPUS:-1,2}" 2>&1 | tail -20 | tee "$OUT/train_throughput.log"
