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
#   steps NAME...: named pieces, in the order given, each skipped once less than its estimate is left of
#            the call's $CALL_BUDGET seconds (default 570): infer-throughput (issue #14's: 3 rounds, plain
#            vs hpcgpu, gpt2-350m, 768 rows),
#            issue #32's inference steps (benchmarks/infer_throughput.py; each stops starting measurements
#            once the call's budget would run out (--deadline) and prints what it has; rounds pooled over
#            calls in /tmp/ib/*.json with --rounds-total, so the same step in the next call completes
#            them, and a finished step costs only its printout (~15 s); output in $OUT/infer_<step>.{log,json}):
#              infer-headline  llama-400m, 8..510-token prompts, batch 64, 128 new tokens:
#                              $HEADLINE_VARIANTS (default plain, hf static, hf continuous, hpcgpu,
#                              hpcgpu auto) to $HEADLINE_ROUNDS measurements each (default 3, hf
#                              continuous 1: the issue measured it below plain), $HEADLINE_ROWS base rows
#                              (default 384: ~25 s of the plain loop at ~2,000 tok/s), the fast ones
#                              with $HEADLINE_SCALE x the rows (more rows drawn alike; --adapt raises a
#                              scale whose loop came out under 20 s). ~3.5-4 min a round on an H200
#                              (each process ~12-40 s of start-up, hf static's compile ~30-60 s), so 3
#                              rounds take ~2 calls
#              infer-e2e       issue #46's end-to-end figures: $E2E_VARIANTS (default hpcgpu auto, hpcgpu auto
#                              again, plain) on $E2E_ROWS rows (default 384: one small job),
#                              every variant the same rows (scale 1, $E2E_SCALE to change), $E2E_ROUNDS rounds
#                              (default 1), pooled in /tmp/ib/e2e-<rows>.json: wall from each process's start to
#                              its outputs written beside the loop alone, both against plain; hpcgpu auto starts
#                              with an empty compile cache (FlashInfer JIT and torch.compile cold), hpcgpu auto
#                              again right after it with what it left (the cached start-up).
#                              ~4 min on an H200 (plain ~45 s, auto ~60-120 s cold, again ~30 s, varlen ~45 s,
#                              the model made once ~30 s). infer-e2e-large: the same at $E2E_LARGE_ROWS (1536)
#                              rows, every variant (plain's loop ~2 min): ~6 min, a call of its own
#              infer-extras    hpcgpu batches (the previous engine) and hpcgpu norefill, $EXTRA_ROUNDS
#                              (default 1) each, pooled with the headline (one report): ~2 min
#              infer-skewed    prompts 8..128, 512 new tokens, $STOP_SHARE (default 1/3) of the rows
#                              ending early on a calibrated stop string: hpcgpu vs hpcgpu norefill,
#                              $SKEWED_ROUNDS rounds (default 3), $SKEWED_ROWS rows (default 512) x
#                              $SKEWED_SCALE; ~30 s of calibration once, then ~2-2.5 min a round
#              infer-gpt2      gpt2-350m, issue #14's workload, $GPT2_VARIANTS (default plain, hpcgpu,
#                              hpcgpu auto), $GPT2_ROUNDS (default 1) rounds of $GPT2_ROWS (512) rows:
#                              ~2.5 min a round
#            infer-scaling (SCALING_ROUNDS rounds of SCALING_ROWS rows (default 4096) of $SCALING_MODEL
#            (default llama-400m) at SCALING_GPUS replica counts, default 1,2[,4], batch 64 per replica,
#            the spec's default engine (slots; SCALING_ENGINE=batches: the previous one), pooled over
#            calls in /tmp/ib; a round ~ rows x sum(1/width) / $SCALING_RATE (rows/s of one replica,
#            default 90) of loops + ~45 s a process), infer-tests,
#            flashinfer-wheels (#46: pip-installs FlashInfer's three wheels from .whl (scripts/gpu_wheels.sh
#            WITH_FLASHINFER=1; carry .whl) into /tmp/site, on PYTHONPATH for the later steps: ~10 s),
#            flashinfer-probe (#46: benchmarks/decode_attention_probe.py's varlen and flashinfer rows on the
#            engine's shape, 512 slots x 640, FlashInfer's JIT cache in an emptied /tmp/fi-probe-ws so that
#            its compile time shows: ~1.5-3 min; the "graph" rows are benchmarks/flashinfer_graph.py, which
#            failed on an H100: see RESULTS.md, issue #46),
#            doctor-tests (#33's doctor on every GPU, a stalled rank under NCCL named within its timeout,
#            and the slot engine's GPU tests; ~4 min on 2 GPUs), observe-tests (#17), own-model-tests (#18: SyncBN, OOM fallback, gradient checkpointing's
#            peak memory), dataparallel (README's DataParallel figure), train-round ($TRAIN_ROUNDS train_vs_loops rounds, default 1, of $TRAIN_PROGRAMS
#            (default all three; "minimal,hpcgpu" is enough for the 1-GPU side of the scaling); the deadline stops
#            between runs, and the next call completes a cut round),
#            train-variants (one round at $VARIANT_GPUS GPUs (default 2) of $VARIANT_PROGRAMS (default minimal,hpcgpu)
#            and hpcgpu with $TRAIN_VARIANTS set, default
#            with torch's 25 MiB DDP buckets and without train.gc_every: what each bought; pooled in /tmp/tvl/variants.json; TRAIN_VARIANTS="old@.ab/old" runs an
#            earlier commit's package beside this one: `git archive REV hpcgpu | tar -x -C .ab/old`, carry .ab),
#            train-profile (benchmarks/profile_step.py: hpcgpu and the minimal loop profiled alike, 2 GPUs),
#            profile-test (tests/gpu: train.profile's kernel and NCCL times on 2 GPUs),
#            mfu-gpt2, mfu-llama, mfu (both) (#15 part 3, the MFU goals: $MFU_ROUNDS train_vs_loops rounds,
#            default 1, at 1 GPU of $MFU_PROGRAMS (default minimal,hpcgpu; "hpcgpu" saves a run) and hpcgpu with $MFU_VARIANTS_GPT2 / $MFU_VARIANTS_LLAMA
#            set (defaults below; "" for none), for gpt2-124m (600 timed steps, ~65 s a run) and llama-1b
#            (150 timed steps of ~0.18 s on an H200, ~130 s a run with a cold compile and the 5 GB final
#            save); pooled per model in /tmp/tvl-mfu/<model>.json (other variants: another file, rm it);
#            $MFU_LLAMA_FITS (default 480) lowers the time mfu-llama needs left to start: its deadline stops between runs;
#            the report gives PASS/FAIL against the goals (35% / 40%) for every hpcgpu program)
#            ab-train, ab-infer (a refactor's spot check, before/after interleaved in one call: this checkout
#            against the package in .ab/old, `git archive REV hpcgpu | tar -x -C .ab/old`, carry .ab):
#            ab-train: $AB_ROUNDS train_vs_loops rounds (default 1, pooled over calls in /tmp/tvl-ab) of hpcgpu
#            and hpcgpu+old at $AB_GPUS (default 1,2), $AB_STEPS timed steps (default 600); ab-infer: 3 rounds of
#            infer_throughput's $AB_ROWS rows (default 768), hpcgpu and hpcgpu old, the call's budget left its deadline
#            ($AB_INFER_FITS s needed to start, default 330)
#            lora-tests (#35: tests/gpu/test_gpu_lora.py: LoRA at 1 GPU compiled in bf16, QLoRA int4, and with 2 GPUs
#            LoRA's DDP curve against the 1-GPU one; $LORA_TESTS_K: a pytest -k; runs kept in $LORA_TEST_DIR,
#            default /tmp/lora-tests, so a later -k two_gpus reuses the 1-GPU run; ~2.5 min, +1.5 with 2 GPUs),
#            lora-bench (#35: benchmarks/lora_bench.py, Llama-3.2-1B shape, seq 2048, LoRA r=16: hpcgpu vs a peft
#            loop vs HF Trainer + peft, $LORA_ROUNDS interleaved rounds (default 3) of $LORA_SECONDS s (default
#            20; ~130-160 s a run with a cold compile cache on an H200), then the memory table (full / LoRA / LoRA+gc / QLoRA, ~1.5 min) and hpcgpu's
#            own peaks; the deadline stops between runs; $LORA_BENCH_FLAGS: more flags),
#            lora (both; with 2+ GPUs overlapped: the rounds alone on GPU 0 and half the cores, the 1-GPU tests
#            then the memory table on GPU 1 and the other cores, then the 2-GPU test),
#            fsdp-tests (#36: tests/gpu/test_gpu_fsdp.py, 2 GPUs: a tiny Llama under fsdp against DDP's curve,
#            stopped at 2 GPUs and resumed at 1 and at 2, model/ through from_pretrained; 6 short runs, ~2-2.5 min;
#            $FSDP_TESTS_K: a pytest -k; runs kept in $FSDP_TEST_DIR, default /tmp/fsdp-tests),
#            fsdp (#36: benchmarks/fsdp_bench.py, Llama-3.2-1B shape at 2 GPUs, seq 2048, micro 4, bf16, compile
#            off for all: fsdp vs DeepSpeed ZeRO-3 vs DDP, $FSDP_ROUNDS interleaved rounds (default 3) of
#            $FSDP_SECONDS s of steady state (default 20); the call's budget left is its deadline: a run's seconds
#            are cut (to 10 at least) only where that completes one more round, and a run that would end past it
#            is not started. A run is ~50-75 s of wall (start-up, 10 warm-up steps, the 5 GB final save), so one
#            round needs ~3.5 min, two ~7.5, three ~11 (not one call); tok/s, rank 0's peak allocated and NVML's
#            per GPU, fsdp/zero3 against 1.15 (deepspeed carried: .whl into /tmp/site); $FSDP_BENCH_FLAGS: more
#            flags (--compile auto: as the plan decides; --strategies fsdp,fsdp-bf16,zero3,ddp))
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
T0=$SECONDS
fits() {  # fits SECONDS: is there that much left of this call's budget?
  local left=$(( ${CALL_BUDGET:-570} - (SECONDS - T0) ))
  [ "$1" -le "$left" ] && return 0
  echo "=== skipped (needs ~$1 s, $left s left of the call)"; return 1
}
inv_sum() { local t=0 w; for w in ${1//,/ }; do t=$(( t + 1000 / w )); done; echo "$t"; }  # 1000 x sum of 1/width
# what the seventh session of 2026-11-27 left to measure (benchmarks/RESULTS.md): three rounds of the larger
# micro batch that passed once (GPT-2 36.4% at micro 32 on an H200, 33.9% on an H100; Llama 47.9% at micro 8),
# now with the loss compiled apart from the model (logits_loss); the default hpcgpu run is micro 16 / 4
MFU_GPT2_DEFAULT="m32:train.micro_batch_size=32,train.global_batch_size=32"
MFU_LLAMA_DEFAULT="m8:train.micro_batch_size=8,train.global_batch_size=8"
mfu_round() {  # mfu_round MODEL VARIANTS [train_vs_loops flags...]: one interleaved round at 1 GPU, minimal vs hpcgpu
  local model="$1" variants="$2"; shift 2
  mkdir -p /tmp/tvl-mfu
  step python3 benchmarks/train_vs_loops.py --gpus 1 --repeats "${MFU_ROUNDS:-1}" --programs "${MFU_PROGRAMS:-minimal,hpcgpu}" \
    --hpcgpu-variants "$variants" --model "$model" "$@" --work /tmp/tvl-mfu --append "/tmp/tvl-mfu/$model.json" \
    --json "$OUT/mfu_$model.json" --deadline $(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 20 )) 2>&1 \
    | tee "$OUT/mfu_$model.log" | tail -25
}
infer32() {  # infer32 NAME [infer_throughput flags...]: one of issue #32's steps, its deadline the call's budget left
  local name="$1"; shift
  mkdir -p /tmp/ib
  # shellcheck disable=SC2086  # INFER_FLAGS: more flags for every step (--bandwidth-tbs 3.35; --smoke: a CPU check)
  step python3 benchmarks/infer_throughput.py "$@" ${INFER_FLAGS:-} --work /tmp/ib --json "$OUT/infer_$name.json" \
    --deadline $(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 15 )) 2>&1 | tee -a "$OUT/infer_$name.log" \
    | grep -v "^\[infer_throughput\] round" | tail -60
}
pin() { local cores="$1"; shift; if command -v taskset >/dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
pytest_gpu() { python3 -m pytest -q -s -p no:cacheprovider -rs "$@" 2>&1 | grep -vE "Warning|warn\(" ; }
run_step() {
  local widths=1,2; [ "$ngpu" -ge 4 ] && widths=1,2,4
  case "$1" in
    infer-throughput) fits 330 && step python3 benchmarks/infer_throughput.py --model gpt2-350m --variants "plain,hpcgpu" \
        --rows 768 --repeats 3 --work /tmp/ib --json "$OUT/infer_throughput.json" 2>&1 | tee "$OUT/infer_throughput.log" | tail -25 ;;
    infer-headline) fits 100 && infer32 headline --model llama-400m --rows "${HEADLINE_ROWS:-384}" \
        --variants "${HEADLINE_VARIANTS:-plain,hf static,hf continuous,hpcgpu,hpcgpu auto}" \
        --scale "${HEADLINE_SCALE:-hf static=5,hpcgpu=6,hpcgpu auto=20}" \
        --rounds-total "${HEADLINE_ROUNDS:-3,hf continuous=1}" --append /tmp/ib/headline.json ;;
    infer-e2e|infer-e2e-large) local rows="${E2E_ROWS:-384}"; [ "$1" = infer-e2e-large ] && rows="${E2E_LARGE_ROWS:-1536}"
      fits 200 && infer32 "e2e-$rows" --model llama-400m --rows "$rows" \
        --variants "${E2E_VARIANTS:-hpcgpu auto,hpcgpu auto again,plain}" --scale "${E2E_SCALE:-}" \
        --no-adapt --min-seconds 0 --rounds-total "${E2E_ROUNDS:-1}" --append "/tmp/ib/e2e-$rows.json" ;;
    flashinfer-wheels) fits 30 && mkdir -p /tmp/site && step python3 -m pip install -q --no-index --no-deps --target /tmp/site \
        .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl .whl/nvidia_cudnn_frontend-*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site" \
        && step python3 -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__)" ;;
    flashinfer-probe) fits 150 && rm -rf /tmp/fi-probe-ws && step env FLASHINFER_WORKSPACE_BASE=/tmp/fi-probe-ws \
        timeout 240 python3 benchmarks/decode_attention_probe.py --forms "varlen,flashinfer,flashinfer graph,flashinfer graph tc" 2>&1 \
        | tee "$OUT/flashinfer_probe.log" | tail -20 \
        && step env FLASHINFER_WORKSPACE_BASE=/tmp/fi-probe-ws timeout 120 python3 benchmarks/decode_attention_probe.py \
        --slots 128 --forms "varlen,flashinfer graph,flashinfer graph tc" 2>&1 | tee -a "$OUT/flashinfer_probe.log" | tail -8 ;;
    infer-extras) fits 100 && infer32 extras --model llama-400m --rows "${HEADLINE_ROWS:-384}" \
        --variants "hpcgpu batches,hpcgpu norefill" --scale "${EXTRA_SCALE:-hpcgpu norefill=6}" \
        --rounds-total "${EXTRA_ROUNDS:-1}" --append /tmp/ib/headline.json ;;
    infer-skewed) fits 120 && infer32 skewed --model llama-400m --workload skewed --rows "${SKEWED_ROWS:-512}" \
        --variants "${SKEWED_VARIANTS:-hpcgpu,hpcgpu norefill}" --scale "${SKEWED_SCALE:-hpcgpu=2,hpcgpu norefill=2}" \
        --stop-share "${STOP_SHARE:-0.3333}" --rounds-total "${SKEWED_ROUNDS:-3}" --append /tmp/ib/skewed.json ;;
    infer-gpt2) fits 100 && infer32 gpt2 --model gpt2-350m --rows "${GPT2_ROWS:-512}" \
        --variants "${GPT2_VARIANTS:-plain,hpcgpu,hpcgpu auto}" --scale "${GPT2_SCALE:-hpcgpu=4,hpcgpu auto=12}" \
        --rounds-total "${GPT2_ROUNDS:-1}" --append /tmp/ib/gpt2.json ;;
    infer-scaling) local sw="${SCALING_GPUS:-$widths}"
      fits $(( ${SCALING_ROUNDS:-1} * (${SCALING_ROWS:-4096} * $(inv_sum "$sw") / (${SCALING_RATE:-90} * 1000) \
        + 45 * $(tr , ' ' <<<"$sw" | wc -w)) )) \
      && step python3 benchmarks/infer_throughput.py --scaling --model "${SCALING_MODEL:-llama-400m}" \
        ${SCALING_ENGINE:+--engine "$SCALING_ENGINE"} --gpus "$sw" --scaling-rows "${SCALING_ROWS:-4096}" \
        --repeats "${SCALING_ROUNDS:-1}" --work /tmp/ib --append "/tmp/ib/scaling-${SCALING_MODEL:-llama-400m}.json" \
        --json "$OUT/infer_scaling.json" 2>&1 | tee -a "$OUT/infer_scaling.log" | tail -12 ;;
    infer-tests) fits 120 && pytest_gpu tests/gpu/test_gpu_infer.py -k "two_replicas or split" \
        | tee -a "$OUT/gpu_tests.log" | tail -15 ;;
    observe-tests) fits 90 && pytest_gpu tests/gpu/test_gpu_observe.py | tee -a "$OUT/gpu_tests.log" | tail -15 ;;
    doctor-tests) fits 240 && pytest_gpu tests/gpu/test_gpu_doctor.py tests/gpu/test_gpu_stall.py tests/gpu/test_gpu_slots.py \
        | tee -a "$OUT/gpu_tests.log" | tail -60 ;;
    profile-test) fits 90 && pytest_gpu tests/gpu/test_gpu_train.py -k profile | tee -a "$OUT/gpu_tests.log" | tail -30 ;;
    own-model-tests) fits 180 && pytest_gpu tests/gpu/test_gpu_prepare.py tests/gpu/test_gpu_train.py \
        tests/gpu/test_gpu_layer.py -k "sync_batchnorm or does_not_fit or gradient_checkpointing" \
        | tee -a "$OUT/gpu_tests.log" | tail -20 ;;
    dataparallel) fits 220 && step python3 benchmarks/dataparallel.py --gpus 2 --repeats 3 --modes one,dp 2>&1 \
        | tee "$OUT/dataparallel.log" | tail -8 ;;
    train-round) fits 200 && mkdir -p /tmp/tvl && step python3 benchmarks/train_vs_loops.py --gpus "${BENCH_GPUS:-1,2}" \
        --programs "${TRAIN_PROGRAMS:-minimal,careful,hpcgpu}" --repeats "${TRAIN_ROUNDS:-1}" --work /tmp/tvl --append /tmp/tvl/rounds.json \
        --deadline $(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 20 )) 2>&1 | tee "$OUT/train_vs_loops.log" | tail -30 ;;
    train-variants) fits 300 && mkdir -p /tmp/tvl && step python3 benchmarks/train_vs_loops.py --gpus "${VARIANT_GPUS:-2}" --repeats 1 \
        --programs "${VARIANT_PROGRAMS:-minimal,hpcgpu}" --hpcgpu-variants "${TRAIN_VARIANTS:-b25:distributed.ddp.bucket_cap_mb=25;nogc:train.gc_every=0}" \
        --work /tmp/tvl --append /tmp/tvl/variants.json --deadline $(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 20 )) 2>&1 \
        | tee "$OUT/train_variants.log" | tail -30 ;;
    train-profile) fits 240 && mkdir -p /tmp/tvl && step env OUT="$OUT" python3 benchmarks/profile_step.py --gpus 2 --work /tmp/tvl 2>&1 \
        | tee "$OUT/profile_step.log" | grep -vE "^ +[a-zA-Z_:.]+ +[0-9.]+%" | tail -40
      # profile_step.py copies each program's traces to $OUT/profile/{minimal,hpcgpu}: one archive comes back, not ~8 files
      [ -d "$OUT/profile" ] && tar czf "$OUT/profiles.tgz" -C "$OUT" profile && rm -rf "$OUT/profile" ;;
    ab-train) fits 200 && mkdir -p /tmp/tvl-ab && step python3 benchmarks/train_vs_loops.py --gpus "${AB_GPUS:-1,2}" \
        --programs hpcgpu --hpcgpu-variants "old@.ab/old" --repeats "${AB_ROUNDS:-1}" ${AB_STEPS:+--steps "$AB_STEPS"} --work /tmp/tvl-ab \
        --append /tmp/tvl-ab/rounds.json --json "$OUT/ab_train.json" \
        --deadline $(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 20 )) 2>&1 | tee "$OUT/ab_train.log" | tail -30 ;;
    ab-infer) fits "${AB_INFER_FITS:-330}" && step python3 benchmarks/infer_throughput.py --model gpt2-350m --variants "hpcgpu,hpcgpu old" --old-checkout .ab/old \
        --rows "${AB_ROWS:-768}" --repeats 3 --work /tmp/ib-ab --json "$OUT/ab_infer.json" \
        --deadline $(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 15 )) 2>&1 | tee "$OUT/ab_infer.log" | tail -25 ;;
    mfu) run_step mfu-gpt2; run_step mfu-llama ;;
    lora-tests) fits "${LORA_TESTS_FITS:-150}" && HPCGPU_LORA_TEST_DIR="${LORA_TEST_DIR:-/tmp/lora-tests}" pytest_gpu tests/gpu/test_gpu_lora.py \
        ${LORA_TESTS_K:+-k "$LORA_TESTS_K"} | tee -a "$OUT/gpu_tests.log" | tail -25 ;;
    lora-bench) fits 240 && mkdir -p /tmp/lora-bench && step python3 benchmarks/lora_bench.py --rounds "${LORA_ROUNDS:-3}" \
        --seconds "${LORA_SECONDS:-20}" --memory-hpcgpu --timeout 240 --work /tmp/lora-bench --json "$OUT/lora_bench.json" \
        --deadline $(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 20 )) ${LORA_BENCH_FLAGS:-} 2>&1 | tee "$OUT/lora_bench.log" | tail -45 ;;
    lora) if [ "$ngpu" -lt 2 ]; then run_step lora-tests; run_step lora-bench; return; fi
      fits 300 || return
      local half=$(( $(nproc) / 2 )) t_lora=$SECONDS end=$(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 130 ))  # 130 s: the 2-GPU test
      mkdir -p /tmp/lora-bench /tmp/lora-mem
      CUDA_VISIBLE_DEVICES=0 pin "0-$(( half - 1 ))" python3 benchmarks/lora_bench.py --rounds "${LORA_ROUNDS:-3}" \
        --seconds "${LORA_SECONDS:-20}" --memory "" --timeout 240 --work /tmp/lora-bench --json "$OUT/lora_bench.json" --deadline "$end" \
        ${LORA_BENCH_FLAGS:-} >"$OUT/lora_bench.log" 2>&1 &
      local bench=$!
      ( export CUDA_VISIBLE_DEVICES=1
        HPCGPU_LORA_TEST_DIR="${LORA_TEST_DIR:-/tmp/lora-tests}" pin "$half-$(( 2 * half - 1 ))" nice \
          python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_gpu_lora.py 2>&1 | grep -vE "Warning|warn\(" \
          | tee -a "$OUT/gpu_tests.log" | tail -25
        pin "$half-$(( 2 * half - 1 ))" nice python3 benchmarks/lora_bench.py --no-throughput --memory-hpcgpu --timeout 180 \
          --work /tmp/lora-mem --json "$OUT/lora_mem.json" --deadline $(( end - (SECONDS - t_lora) )) 2>&1 \
          | tee "$OUT/lora_mem.log" | tail -20 )
      echo "=== waiting for the rounds on GPU 0"; wait "$bench"; echo "=== bench exit $?"; tail -45 "$OUT/lora_bench.log"
      LORA_TESTS_K=two_gpus LORA_TESTS_FITS=90 run_step lora-tests ;;
    fsdp-tests) fits "${FSDP_TESTS_FITS:-170}" && HPCGPU_FSDP_TEST_DIR="${FSDP_TEST_DIR:-/tmp/fsdp-tests}" \
        pytest_gpu tests/gpu/test_gpu_fsdp.py ${FSDP_TESTS_K:+-k "$FSDP_TESTS_K"} | tee -a "$OUT/gpu_tests.log" | tail -30 ;;
    fsdp) fits "${FSDP_FITS:-200}" && mkdir -p /tmp/fsdp-bench && step python3 benchmarks/fsdp_bench.py --gpus 2 \
        --rounds "${FSDP_ROUNDS:-3}" --seconds "${FSDP_SECONDS:-20}" --timeout 300 --work /tmp/fsdp-bench --json "$OUT/fsdp_bench.json" \
        --deadline $(( ${CALL_BUDGET:-570} - (SECONDS - T0) - 15 )) ${FSDP_BENCH_FLAGS:-} 2>&1 | tee "$OUT/fsdp_bench.log" \
        | tail -40 ;;
    mfu-gpt2) fits 300 && mfu_round gpt2-124m "${MFU_VARIANTS_GPT2-$MFU_GPT2_DEFAULT}" ;;
    mfu-llama) fits "${MFU_LLAMA_FITS:-480}" && mfu_round llama-1b "${MFU_VARIANTS_LLAMA-$MFU_LLAMA_DEFAULT}" --steps 150 --warmup 20 \
        --log-every 10 ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}
if [ "$phase" = steps ]; then
  shift
  for s in "$@"; do run_step "$s"; done
  exit 0
fi
if [ "$phase" = infer ] && [ "${INFER_SCALING:-0}" = 1 ]; then
  widths=1,2; [ "$ngpu" -ge 4 ] && widths=1,2,4
  step python3 benchmarks/infer_throughput.py --model gpt2-350m --scaling --gpus "$widths" --scaling-rows 1536 --repeats 3 --work /tmp/ib \
    2>&1 | tee "$OUT/infer_scaling.log" | tail -12
elif [ "$phase" = infer ]; then
  [ -f /tmp/ib/.tested ] || { step python3 -m pytest tests/gpu/test_gpu_infer.py -q -s -p no:cacheprovider -rs 2>&1 | grep -vE "Warning|warn\(" \
    | tee "$OUT/gpu_infer_tests.log" | tail -30; mkdir -p /tmp/ib && touch /tmp/ib/.tested; }
  step python3 benchmarks/infer_throughput.py --model gpt2-350m --variants "plain,plain sorted nocudnn,hpcgpu" --rows 768 --repeats 1 \
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
