#!/usr/bin/env bash
# Wheels the GPU machine lacks, into .whl/ (git-ignored), to carry into device runs (64 MiB a call):
#   deepspeed (built here from its sdist: pure Python, its ops compile at first use), submitit and the
#   small packages DeepSpeed needs; bitsandbytes (~43 MB) with WITH_BNB=1; tensorboard and what it
#   needs (~20 MB, for the tracker's GPU test) with WITH_TB=1 (not both in one call: 64 MiB); liger-kernel
#   (train.fused_loss, ~1 MB) and peft (train.lora) always; with WITH_FLASHINFER=1 FlashInfer 0.5.3 (issue #46:
#   flashinfer-python 7 MB, pure Python, its kernels JIT-compiled at first use with the machine's nvcc and
#   ninja) and the two wheels it needs that the machine lacks, apache-tvm-ffi (<0.2, 3.3 MB) and
#   nvidia-cudnn-frontend (11.6 MB): ~22 MB, ~29 MB in all with the rest (a call carries 64 MiB, the
#   checkout ~4 MB of it; not with WITH_BNB=1 or WITH_TB=1). $FI_WHEELS: a folder already holding those three
#   (copied, no download). The device machine runs CPython 3.12 on x86_64 Linux: binary wheels are fetched
#   for that, whatever this machine is.
# On the device: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site:$PWD
# (benchmarks/gpu_session.sh's step flashinfer-wheels installs only FlashInfer's three, so that the timed
# start-ups of the inference benchmark import no deepspeed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
mkdir -p .whl
plat=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_28_x86_64 --python-version 3.12 --implementation cp --only-binary=:all:)
pkgs=(submitit hjson pydantic pydantic_core typing_inspection annotated_types liger-kernel peft)
[ "${WITH_BNB:-0}" = 1 ] && pkgs+=(bitsandbytes)
[ "${WITH_TB:-0}" = 1 ] && pkgs+=(tensorboard tensorboard-data-server grpcio absl-py markdown werkzeug protobuf)
if [ "${WITH_FLASHINFER:-0}" = 1 ]; then
  if [ -n "${FI_WHEELS:-}" ]; then
    cp "$FI_WHEELS"/flashinfer_python-0.5.3-*.whl "$FI_WHEELS"/apache_tvm_ffi-0.1*.whl "$FI_WHEELS"/nvidia_cudnn_frontend-*.whl .whl/
  else
    pkgs+=(flashinfer-python==0.5.3 "apache-tvm-ffi<0.2" nvidia-cudnn-frontend==1.32.0)
  fi
fi
"$PY" -m pip download -q --no-deps "${plat[@]}" -d .whl "${pkgs[@]}"
ls .whl/deepspeed-*.whl >/dev/null 2>&1 || "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed
du -sh .whl; ls .whl
