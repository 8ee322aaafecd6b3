#!/usr/bin/env bash
# The main job on the embedded default: a tiny GPT-2-style model trained from scratch on 2 CPU ranks
# (gloo) through the local executor: the same entrypoint and environment contract as under SLURM.
# Then batch inference (task: infer): 45 prompts through a tiny GPT-2 made here (random weights, its
# own BPE tokenizer, no hub), one model copy per rank; outputs.jsonl in its run dir.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/hpcgpu submit configs/tiny-gpt2.yaml --executor local --gpus 2 --new "$@"
[ -f runs/models/tiny-gpt2/config.json ] || .venv/bin/python scripts/make_tiny_model.py runs/models/tiny-gpt2
exec .venv/bin/hpcgpu submit configs/tiny-infer.yaml --executor local --new
