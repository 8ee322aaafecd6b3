#!/usr/bin/env bash
# Why hpcgpu infer scales worse to 4 replicas than to 2: is it the host (4 generate loops bound by
# Python/launch time slowing each other), torch's threads, or hpcgpu? One call on a 4-GPU machine:
#   1. the host: CPU model, cgroup quota, NUMA and GPU topology
#   2. the plain generate loop (benchmarks/plain_generate.py --sort) alone on GPU 0, then 4 copies at
#      once, one per GPU, no coordination at all: if each copy slows as hpcgpu's replicas do, the
#      host is the limit, not hpcgpu
#   3. hpcgpu's scaling 1 -> 4 as shipped, with OMP_NUM_THREADS=1, and with infer.kv_cache static
# A snapshot of the busiest threads is taken in the middle of each 4-way run.
#   bash benchmarks/infer_contention.sh [ROWS]      (default 1024 rows; PYTHONPATH = this checkout)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/hpcgpu-gpu-out}"; mkdir -p "$OUT"
rows="${1:-1024}"; work=/tmp/ib-contention; mkdir -p "$work"
snapshot() {  # snapshot SECONDS TAG: the busiest threads after SECONDS
  (sleep "$1"; { echo "--- $2"; top -H -b -n 1 -w 200 | head -45; } >> "$OUT/contention_top.txt") &
}
echo "=== host"
{ nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null; lscpu | grep -E "Model name|^CPU\(s\)|Socket|NUMA|MHz|Thread"; \
  nvidia-smi topo -m; } 2>&1 | tee "$OUT/contention_host.txt"
echo "=== hpcgpu scaling 1,4 as shipped (also makes the model and the rows)"
python3 benchmarks/infer_throughput.py --scaling --gpus 1,4 --scaling-rows "$rows" --repeats 1 --work "$work" \
  --json "$OUT/contention_shipped.json" 2>&1 | tail -5
model=$(ls -d "$work"/model-* | head -1); data="$work/scaling-rows.jsonl"
plain() {  # plain GPU TAG
  CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/plain_generate.py --model "$model" --input "$data" \
    --output "$work/plain-$2-$1.jsonl" --batch-size 64 --max-new-tokens 128 --sort --no-cudnn-attention \
    2>/dev/null | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print('$2 GPU $1', \
    f\"{d['rows_per_s']:.2f} rows/s, loop {d['elapsed_s']:.1f} s\")"
}
echo "=== plain generate: alone on GPU 0, then 4 at once"
plain 0 alone
snapshot 30 "4 plain loops at once"
for g in 0 1 2 3; do plain $g together & done; wait
echo "=== hpcgpu scaling 1,4 with OMP_NUM_THREADS=1"
python3 benchmarks/infer_throughput.py --scaling --gpus 1,4 --scaling-rows "$rows" --repeats 1 --work "$work" \
  --child-env OMP_NUM_THREADS=1 --json "$OUT/contention_omp1.json" 2>&1 | tail -5
echo "=== hpcgpu scaling 1,4 with infer.kv_cache static"
snapshot 75 "hpcgpu 4 replicas, static cache (if the 1-replica run took ~60 s)"
python3 benchmarks/infer_throughput.py --scaling --gpus 1,4 --scaling-rows "$rows" --repeats 1 --work "$work" \
  --kv-cache static --json "$OUT/contention_static.json" 2>&1 | tail -5
wait
