"""What the benchmark drivers share (infer_throughput.py, train_vs_loops.py, profile_step.py): the GPUs
as nvidia-smi names them (the parent process never touches CUDA: a process of ours on a GPU would make
hpcgpu's busy check warn about it), median and spread, the rotating order of interleaved rounds, the
work dir, and the train models of train_vs_loops.py and its loops (no torch here: the driver imports
none)."""
from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator


def nvidia_smi_names() -> list[str] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()] if proc.returncode == 0 else None


def host_id(args: argparse.Namespace) -> str:
    """This host: its name and, on GPUs, its GPUs' UUIDs (a device tool's fresh machine may reuse a name).
    Rounds pooled from several calls must come from one host, as the issue's interleaving asks."""
    host = socket.gethostname()
    if args.cpu or shutil.which("nvidia-smi") is None:
        return host
    proc = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True)
    uuids = sorted(ln.strip() for ln in proc.stdout.splitlines() if ln.strip()) if proc.returncode == 0 else []
    return f"{host} ({', '.join(uuids)})" if uuids else host


def gpu_name(args: argparse.Namespace) -> str:
    if args.cpu:
        return "CPU"
    names = nvidia_smi_names()
    return f"{len(names)} x {names[0]}" if names else "GPU (nvidia-smi not found)"


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def rotated(names: list[str], k: int) -> list[str]:
    k %= max(1, len(names))
    return names[k:] + names[:k]


@contextlib.contextmanager
def work_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """--work: that dir, made and kept; none given: a temporary dir, removed at the end."""
    if given is not None:
        work = given.resolve()
        work.mkdir(parents=True, exist_ok=True)
        yield work
        return
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --model of train_vs_loops.py and the loops: the shape (layers, hidden, heads; llama's KV heads and MLP
# width), vocab and the defaults of --seq-len / --micro-batch; flags given win. gpt2-124m: GPT-2 124M;
# llama-1b: Llama-3.2-1B's shape (GQA, tied embeddings).
TRAIN_MODELS: dict[str, dict[str, Any]] = {
    "gpt2-124m": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_kv_head": None, "intermediate": None,
                  "vocab": 50304, "seq_len": 1024, "micro_batch": 16},
    "llama-1b": {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_kv_head": 8, "intermediate": 8192,
                 "vocab": 128256, "seq_len": 2048, "micro_batch": 4},
}


def fill_model_defaults(args: argparse.Namespace) -> None:
    """The size flags not given take --model's values."""
    for key, value in TRAIN_MODELS[args.model].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def train_model_config(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The transformers config of `model` at args' sizes, as a mapping with model_type: hpcgpu's
    model.config, and what the loops build."""
    if model == "llama-1b":
        return {"model_type": "llama", "hidden_size": args.n_embd, "intermediate_size": args.intermediate,
                "num_hidden_layers": args.n_layer, "num_attention_heads": args.n_head,
                "num_key_value_heads": args.n_kv_head, "vocab_size": args.vocab,
                "max_position_embeddings": args.seq_len, "tie_word_embeddings": True, "rope_theta": 500000.0,
                "attention_dropout": 0.0, "attn_implementation": "sdpa"}
    cfg: dict[str, Any] = {"model_type": "gpt2", "n_layer": args.n_layer, "n_head": args.n_head,
                           "n_embd": args.n_embd, "n_positions": args.seq_len, "vocab_size": args.vocab,
                           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if args.vocab <= 50256:  # gpt2's bos/eos (50256) would lie outside the vocabulary
        cfg.update(bos_token_id=None, eos_token_id=None)
    return cfg


def ratio_of_runs(results: dict[str, list[dict[str, Any]]], a: str, b: str) -> dict[str, Any] | None:
    """Program a over program b: the ratio of their median tokens/s, and a/b within each round (runs
    carry "round" and "tokens_per_s"); None where either has no run."""
    ra, rb = results.get(a, []), results.get(b, [])
    if not ra or not rb:
        return None
    med = statistics.median(r["tokens_per_s"] for r in ra) / statistics.median(r["tokens_per_s"] for r in rb)
    by_round = {r["round"]: r["tokens_per_s"] for r in rb}
    per_round = [r["tokens_per_s"] / by_round[r["round"]] for r in ra if r["round"] in by_round]
    return {"of_medians": med, "per_round": per_round}
