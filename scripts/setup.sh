#!/usr/bin/env bash
# Create .venv and install hpcgpu with its test tools. Idempotent; safe to run again.
# torch is pinned by constraints.txt (2.13.0, a CPU build on machines like ours) and installed first,
# so that nothing installed later (transformers, accelerate, deepspeed) pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HPCGPU_VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.hpcgpu-installed"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c constraints.txt "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[dev,deepspeed,tensorboard,wandb,lora]"
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -c "import torch, transformers, submitit, pynvml, hpcgpu; print('hpcgpu', hpcgpu.__version__, '| torch', torch.__version__)"
