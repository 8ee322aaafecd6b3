#!/usr/bin/env bash
# All GPU checks of a session, in two phases that each fit one device call (10 min):
#   phase 1: tests/gpu, the checkpoint benchmark, train throughput (hpcgpu vs torchrun) for $BENCH_GPUS
#   phase 2: DeepSpeed vs DDP ($DS_MODELS on 2 GPUs, ZeRO-3 preempt/resume), then the width checks
#            (benchmarks/four_gpus.py: launchers + ZeRO-2 at every width up to the GPU count; subset
#            and preemption when 4+ GPUs)
#   infer:   tests/gpu/test_gpu_infer.py (split over 2 GPUs, int8/int4: carry bitsandbytes) and one
#            round of benchmarks/infer_throughput.py (pooled over calls: run the phase 3 times on one
#            warm machine); with INFER_SCALING=1 instead, the data-parallel scaling up to 4 GPUs (~5 min)
#   train:   one interleaved round of benchmarks/train_vs_loops.py (hpcgpu vs the minimal and the careful
#            hand-written loops, 1 and 2 GPUs; 1,2,4 where 4+), pooled over calls in /tmp/tvl: run the
#            phase 3 times on one warm machine for median and spread
# The device machine has torch/transformers but not hpcgpu: PYTHONPATH points at this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/hpcgpu-gpu-out}"; mkdir -p "$OUT"
phase="${1:-1}"
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi -L | tee "$OUT/gpus.txt"
step() { echo "=== $*"; "$@"; echo "=== exit $?"; }
if [ "$phase" = infer ] && [ "${INFER_SCALING:-0}" = 1 ]; then
  widths=1,2; [ "$ngpu" -ge 4 ] && widths=1,2,4
  step python3 benchmarks/infer_throughput.py --scaling --gpus "$widths" --scaling-rows 1536 --repeats 3 --work /tmp/ib \
    2>&1 | tee "$OUT/infer_scaling.log" | tail -12
elif [ "$phase" = infer ]; then
  [ -f /tmp/ib/.tested ] || { step python3 -m pytest tests/gpu/test_gpu_infer.py -q -s -p no:cacheprovider -rs 2>&1 | grep -vE "Warning|warn\(" \
    | tee "$OUT/gpu_infer_tests.log" | tail -30; mkdir -p /tmp/ib && touch /tmp/ib/.tested; }
  step python3 benchmarks/infer_throughput.py --variants "plain,plain sorted nocudnn,hpcgpu" --rows 768 --repeats 1 \
    --work /tmp/ib --append /tmp/ib/rounds.json 2>&1 | tee "$OUT/infer_throughput.log" | tail -25
elif [ "$phase" = train ]; then
  gpus="${BENCH_GPUS:-1,2}"; [ "$ngpu" -ge 4 ] && gpus="${BENCH_GPUS:-1,2,4}"
  mkdir -p /tmp/tvl
  step python3 benchmarks/train_vs_loops.py --gpus "$gpus" --repeats 1 --work /tmp/tvl --append /tmp/tvl/rounds.json \
    --deadline 540 2>&1 | tee "$OUT/train_vs_loops.log" | tail -30
elif [ "$phase" = 1 ]; then
  step python3 -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 | grep -vE "Warning|warn\(" | tee "$OUT/gpu_tests.log" | tail -40
  step python3 benchmarks/checkpoint.py --model gpt2-124m --repeats 4 2>&1 | grep -v Warning | tee "$OUT/checkpoint.log" | tail -8
  gpus="${BENCH_GPUS:-1,2}"; [ "$ngpu" -ge 4 ] && gpus="${BENCH_GPUS:-1,2,4}"
  step python3 benchmarks/train_throughput.py --gpus "$gpus" 2>&1 | tee "$OUT/train_throughput.log" | tail -20
else
  step python3 benchmarks/deepspeed_bench.py --gpus 2 --models "${DS_MODELS:-gpt2-124m}" --steps 16 --skip 5 2>&1 \
    | tee "$OUT/deepspeed_bench.log" | tail -20
  for n in 1 2 4 8; do
    [ "$n" -le "$ngpu" ] || break
    parts=zero2; [ "$n" -ge 2 ] && parts=launchers,zero2
    [ "$n" -ge 4 ] && parts="launchers,zero2,subset,preempt"
    subset=0,2,3; [ "$n" -ge 8 ] && subset=0,1,4,7
    step python3 benchmarks/four_gpus.py --gpus "$n" --only "$parts" --subset "$subset" --steps 16 --skip 5 2>&1 \
      | tee "$OUT/width_$n.log" | tail -12
  done
fi
