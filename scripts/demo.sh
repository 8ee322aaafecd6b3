#!/usr/bin/env bash
# The main job on the embedded default: a tiny GPT-2-style model trained from scratch on 2 CPU ranks
# (gloo) through the local executor: the same entrypoint and environment contract as under SLURM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hpcgpu submit configs/tiny-gpt2.yaml --executor local --gpus 2 --new "$@"
