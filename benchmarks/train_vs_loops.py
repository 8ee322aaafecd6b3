"""hpcgpu's train task against two hand-written training loops, measured so that the numbers hold.

    # on a GPU machine (PYTHONPATH=<this checkout> where hpcgpu is not installed; needs torch, numpy,
    # transformers; no yaml). A round (3 programs x 2 GPU counts, defaults) should take ~5-7 min on
    # H100s (a run: ~20-40 s start and compile, ~30 s of steps), the first call ~2-3 min more for
    # priming the compile cache (below):
    PYTHONPATH=$PWD python benchmarks/train_vs_loops.py --gpus 1,2 [--repeats 3]
    # a cap of 10 min per command: the three rounds in three calls on one warm machine, pooled. --work
    # keeps the compile cache, data, logs and run dirs between calls; --deadline starts no run that
    # the longest run so far says would end past it (what was measured is kept: the JSON is rewritten
    # after every run, and a round cut short is completed first by the next call):
    PYTHONPATH=$PWD python benchmarks/train_vs_loops.py --gpus 1,2 --repeats 1 --work /tmp/tvl \
        --append /tmp/tvl/rounds.json --deadline 540          # x3 (or until 3 rounds at each count)
    # (or one GPU count per call, --gpus 1 then --gpus 2, into the same --append file: rounds are
    # counted per GPU count, and the report covers every count in the file)
    # the Llama-style ~1B model (--model below) at 1 GPU, fewer steps (~0.15-0.2 s a step on an H100):
    PYTHONPATH=$PWD python benchmarks/train_vs_loops.py --model llama-1b --gpus 1 --programs minimal,hpcgpu \
        --steps 150 --warmup 20 --work /tmp/tvl-mfu --append /tmp/tvl-mfu/llama-1b.json
    # everything tiny on the CPU (gloo, 1 and 2 ranks), to check the script end to end; measures nothing
    # (--model llama-1b: a tiny Llama, 2 layers, 64 hidden, 4 heads, 2 KV heads, MLP 128, vocab 512):
    python benchmarks/train_vs_loops.py --smoke [--model llama-1b]

The model, --model (from a config, random init, dropout 0, sdpa; the same in all programs):

    gpt2-124m  (default) GPT-2 124M: HF GPT2LMHeadModel, 12 layers, 768 hidden, 12 heads, vocab 50304;
               seq 1024, micro 16 by default; --n-layer, --n-embd, --n-head change its shape
    llama-1b   Llama-3.2-1B's shape: HF LlamaForCausalLM, 16 layers, 2048 hidden, 32 heads, 8 KV heads,
               MLP 8192, vocab 128256, rope_theta 500000, tied embeddings (1.24B params); seq 2048,
               micro 4 by default; its shape is fixed (--n-layer, --n-embd, --n-head: an error). The
               issue's MFU goal for it is 40% on one H100/H200 (GPT-2 124M's: 35%)

--seq-len, --micro-batch and --vocab, when given, win over the model's defaults. The model is part of
the setup (--append pools only rounds of one model).

The three programs, each in a fresh process, same model and settings (bf16 autocast; torch.compile;
fused AdamW; micro 16 (4) x accum 1 per GPU; DDP at 2+ GPUs, none at 1):

    minimal   benchmarks/loop_minimal.py under torchrun --standalone --nproc_per_node N: the ceiling
              (one fixed random batch on the GPU, backward/step/zero_grad, no clipping, no scheduler,
              no loss read back until the end)
    careful   benchmarks/loop_careful.py, the same way: what a careful user writes, nanoGPT-style
              (a host token array, pinned non_blocking copies with prefetch, grad clip 1.0, cosine LR
              with warmup, the loss read every --log-every steps)
    hpcgpu    `python -m hpcgpu submit SPEC --executor local --new --gpus N`, task: train, the spec
              (JSON) mirroring the loops: model.config, data.train a random text file of
              --data-tokens bytes (default 4M, 4096 sequences at seq 2048; byte tokenizer: a token a
              byte, ids < 256 whatever the vocabulary; the loops' host array has as many tokens),
              micro_batch_size 16 (4), global_batch_size micro x accum x N, strategy ddp, precision
              bf16, compile true, grad_clip 1.0, warmup 10, eval off, no checkpoints; the GPU monitor
              at its default (on), as users run it (--hpcgpu-set monitor.enabled=false to see its
              cost). Its data sits on the GPU (it keeps token blocks under 1 GiB there), the
              careful loop's in host memory; the final model it saves is not timed (and is deleted)
    hpcgpu+NAME  --hpcgpu-variants "NAME:key=value,...;...": hpcgpu with those dotted spec keys set (values
              JSON where they parse), run in the same rounds as the others, to measure a setting side by
              side with plain hpcgpu; reported against hpcgpu and minimal, with no targets. NAME@DIR:
              the hpcgpu package in DIR instead (an earlier commit's), to measure what a change bought

How it is measured. Each run does --warmup untimed steps (step 1 compiles), then --steps timed steps
(default 600: ~27 s at ~45 ms/step, GPT-2 124M on an H100; for llama-1b, ~150 ms/step at 40% MFU,
give --steps 150 --warmup 20); runs under --min-seconds (20 s) timed
are flagged with the --steps that would reach it. tok/s = tokens of the timed steps / their time
(tokens = micro x accum x seq x GPUs per step). The loops time the steps between two
torch.cuda.synchronize() calls; hpcgpu's comes from its run dir's metrics.jsonl: "train" records
(step, tokens = tokens seen so far, ms_per_step and tokens_per_s over the steps since the previous
record, mfu), written at step 1, every train.log_every (= --log-every) steps and the last, each timed
on the GPU's clock (runtime/steplog.py); the loops time the same --log-every intervals with CUDA events
(loop_common.py IntervalMarks, read after the loop); each run's line gives the range, median, first and
last of those intervals' ms/step (a wide range: an erratic, host-bound step; first != last: a drift). The timed window is from the record of step
--warmup to the last (--warmup and --steps must be multiples of --log-every): its time is the sum of
ms_per_step x steps of those records, its tokens the difference of "tokens". MFU: hpcgpu's count,
(6 x parameters + 12 x layers x heads x head_dim x seq) x tok/s / (GPUs x dense bf16 peak, 989 TFLOP/s
on an H100); for hpcgpu the record's own mfu/tokens_per_s factor times the timed tok/s.
Time to first step: from this script's launch of the process (time.time() just before Popen) to
step 1 done (the loops: after a synchronize, time.time() printed; hpcgpu: the "time" of the step-1
record, written after its synchronising all-reduce), the same clock for all three; the loops' own
process-start -> step 1 is shown too. torch.compile's caches (TORCHINDUCTOR_CACHE_DIR) are one dir
in the work dir for every run. The cache's primed.json lists the (program, GPU count) pairs that have
compiled into it; the first run of a pair not listed pays for a cold cache, so its time to first step
is left out of the comparison (kept as ttfs_cold_s; its tok/s counts: compiling ends before the timed
steps). --prime runs a short untimed run (2 steps) of each program at every count first, so that
round 1's first-step times count too (default off: ~50-170 s a pair on a GPU).

Programs run interleaved: per round, for each GPU count, the three in an order that rotates each
round (A B C, B C A, C A B). Printed per GPU count: median [min-max] of tok/s, MFU, ms/step, timed
seconds and time to first step for each program; the ratios hpcgpu/minimal and hpcgpu/careful
(ratio of the medians [range of the per-round ratios]), marked "gap smaller than the spread" when
|1 - ratio| < half that range; the 2-GPU scaling tok/s(2) / (2 x tok/s(1)) of each program; and
PASS/FAIL against the targets: hpcgpu >= 1.00x careful and >= 0.97x minimal at each GPU count,
hpcgpu's 2-GPU scaling >= minimal's, hpcgpu's time to first step <= careful's + 2 s; on GPUs, at 1
GPU, each hpcgpu program's median MFU against issue 15's goal for the model (gpt2-124m 0.35, llama-1b
0.40). Fewer than 3 rounds or short measurements are said next to the verdicts.

Writes the report as JSON to $OUT/train_vs_loops.json (or --json PATH; and to --append FILE, which
pools the rounds of earlier calls of the same setup on the same host: its name and GPU UUIDs, so a
fresh device machine starts a new file); every program's stdout/stderr are kept in <work>/logs (a
temporary work dir is removed at the end). Children get NCCL_NVLS_ENABLE=0 and a job
registry in the work dir (HPCGPU_REGISTRY). This process never touches CUDA (hpcgpu's busy-GPU check
would see it); it does not import torch.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import (TRAIN_MODELS, fill_model_defaults, gpu_name, host_id, nvidia_smi_names, rotated, spread,
                          train_model_config, work_dir)
from hpcgpu.contract import startup_phases  # imports nothing of ours, and no torch

REPO = Path(__file__).resolve().parent.parent
LOOPS = {"minimal": REPO / "benchmarks" / "loop_minimal.py", "careful": REPO / "benchmarks" / "loop_careful.py"}
PROGRAMS = ["minimal", "careful", "hpcgpu"]
TARGET_VS_CAREFUL, TARGET_VS_MINIMAL, TARGET_TTFS_SLACK_S = 1.00, 0.97, 2.0
MFU_GOALS = {"gpt2-124m": 0.35, "llama-1b": 0.40}  # issue 15 part 3: on one GPU, hpcgpu or a variant
ORIG_ENV = dict(os.environ)
SETUP_KEYS = ("model", "n_layer", "n_embd", "n_head", "vocab", "seq_len", "micro_batch", "accum", "steps", "warmup",
              "log_every", "compile", "data_tokens", "precision", "lr", "child_env", "hpcgpu_set", "smoke")
DEFAULT_MODEL = "gpt2-124m"  # a setup (an --append file) from before --model is of this one
MODEL_KIND = {"gpt2-124m": "GPT-2", "llama-1b": "Llama"}
# --smoke: each model's tiny shape (the full ones: bench_common.py TRAIN_MODELS)
SMOKE = {
    "gpt2-124m": {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_kv_head": None, "intermediate": None,
                  "vocab": 512, "seq_len": 64, "micro_batch": 4},
    "llama-1b": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "intermediate": 128,
                 "vocab": 512, "seq_len": 64, "micro_batch": 4},
}


def note(msg: str) -> None:
    print(f"[train_vs_loops] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- host facts (no CUDA in this process)

# ---------------------------------------------------------------- children

def child_env(args: argparse.Namespace, work: Path) -> dict[str, str]:
    env = dict(ORIG_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["HPCGPU_REGISTRY"] = str(work / "jobs.db")  # the benchmark's jobs stay out of the user's registry
    env["NCCL_NVLS_ENABLE"] = "0"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cpu:
        env.setdefault("DS_ACCELERATOR", "cpu")  # transformers may import deepspeed, which would warn
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks
        env.setdefault("OMP_NUM_THREADS", "1")  # modest: a rank a core
    for item in args.child_env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def launch(cmd: list[str], env: dict[str, str], log_base: Path, timeout: float,
           cwd: Path = REPO) -> tuple[int, float, str, str]:
    """Run cmd in its own process group; returns (exit code, launch time.time(), stdout, stderr). On
    timeout the whole group (the launcher and its ranks) is ended."""
    log_base.parent.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_base.with_suffix(".out"), log_base.with_suffix(".err")
    with out_path.open("w") as out, err_path.open("w") as err:
        t_launch = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=cwd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_group(proc)
            rc = 124
        except BaseException:  # Ctrl-C, or SIGTERM to this process (a time cap): no ranks left behind
            end_group(proc)
            raise
    return rc, t_launch, out_path.read_text(errors="replace"), err_path.read_text(errors="replace")


def end_group(proc: subprocess.Popen) -> None:
    """End the process group this script started for one program (the launcher and its ranks)."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through launch(), which ends the running program's group


def tail(text: str, n: int = 2500) -> str:
    return text[-n:].rstrip()


def model_of(args: argparse.Namespace) -> str:
    """--model (a namespace without it, profile_step.py's, is of GPT-2 124M)."""
    return getattr(args, "model", DEFAULT_MODEL)


def model_tag(args: argparse.Namespace) -> str:
    """A prefix for the names of logs, specs and run dirs: "" for GPT-2 124M (the names it always had), else
    the model's, so that models sharing a work dir keep theirs apart."""
    return "" if model_of(args) == DEFAULT_MODEL else f"{model_of(args)}-"


def loop_cmd(args: argparse.Namespace, program: str, gpus: int, warmup: int, steps: int) -> list[str]:
    model = model_of(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           str(LOOPS[program]), "--model", model, "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
           "--n-head", str(args.n_head), "--vocab", str(args.vocab), "--seq-len", str(args.seq_len),
           "--micro-batch", str(args.micro_batch), "--accum", str(args.accum), "--steps", str(steps),
           "--warmup", str(warmup), "--compile" if args.compile else "--no-compile",
           "--device", "cpu" if args.cpu else "auto", "--precision", args.precision, "--lr", str(args.lr),
           "--seed", str(args.seed), "--interval", str(args.log_every)]
    if model == "llama-1b":
        cmd += ["--n-kv-head", str(args.n_kv_head), "--intermediate", str(args.intermediate)]
    if program == "careful":
        cmd += ["--log-every", str(args.log_every), "--data-tokens", str(args.data_tokens), "--grad-clip", "1.0",
                "--lr-warmup", "10"]
    return cmd


def run_loop(args: argparse.Namespace, work: Path, program: str, gpus: int, tag: str,
             warmup: int | None = None, steps: int | None = None) -> dict[str, Any]:
    cmd = loop_cmd(args, program, gpus, warmup or args.warmup, steps or args.steps)
    rc, t_launch, out, err = launch(cmd, child_env(args, work),
                                    work / "logs" / f"{model_tag(args)}{tag}-{program}-{gpus}g", args.timeout)
    wall = time.time() - t_launch
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        raise RunFailed(f"{program} at {gpus} GPU(s) failed (exit {rc}; `{' '.join(cmd[1:])}`):\n"
                        f"{tail(out, 1000)}\n{tail(err)}")
    res = json.loads(lines[-1])
    return {"tokens_per_s": res["tokens_per_s"], "ms_per_step": res["ms_per_step"], "mfu": res["mfu"],
            "timed_s": res["timed_s"], "timed_steps": res["timed_steps"],
            "ttfs_s": res["step1_done_unix"] - t_launch, "ttfs_inproc_s": res["ttfs_s"],
            "final_loss": res["final_loss"], "params": res["params"], "device": res["device"],
            "peak_mem_gib": res.get("peak_mem_gib"), "flops_per_token": res["flops_per_token"], "wall_s": wall,
            "interval_ms": res.get("interval_ms")}


class RunFailed(Exception):
    pass


class DeadlineReached(Exception):
    pass


# ---------------------------------------------------------------- hpcgpu

def random_text(path: Path, n_bytes: int, seed: int) -> None:
    """n_bytes of random ASCII: the byte tokenizer makes a token of each byte."""
    rng = random.Random(seed)
    alphabet = (string.ascii_letters + string.digits + " .,\n").encode()
    path.write_bytes(bytes(rng.choices(alphabet, k=n_bytes)))


def set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    """d["a"]["b"]["c"] = value for key "a.b.c", making the dicts on the way."""
    *path, last = key.split(".")
    for part in path:
        d = d.setdefault(part, {})
    d[last] = value


def parse_variants(text: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """--hpcgpu-variants "NAME[@DIR]:key=value,key=value;..." -> ({"hpcgpu+NAME": {key: value}}, {"hpcgpu+NAME":
    DIR}); a value is JSON where it parses (true, 50, "x"), else the string. DIR: another checkout's hpcgpu
    (e.g. an earlier commit's, from `git archive`) runs that program."""
    variants: dict[str, dict[str, Any]] = {}
    checkouts: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        head, _, sets = item.partition(":")
        name, at, checkout = head.partition("@")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or f"hpcgpu+{name}" in variants:
            raise ValueError(f"{item!r}: NAME (letters, digits, '_', '-'; each once) first")
        if at:
            if not (Path(checkout) / "hpcgpu" / "__init__.py").is_file():
                raise ValueError(f"{item!r}: {checkout} has no hpcgpu package (hpcgpu/__init__.py)")
            checkouts[f"hpcgpu+{name}"] = str(Path(checkout).resolve())
        overrides = {}
        for kv in filter(None, sets.split(",")):
            key, eq, value = kv.partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", key.strip()):
                raise ValueError(f"{item!r}: {kv!r} is not key=value (a dotted key)")
            try:
                overrides[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key.strip()] = value
        if not overrides and not at:
            raise ValueError(f"{item!r}: no key=value and no @DIR")
        variants[f"hpcgpu+{name}"] = overrides
    return variants, checkouts


def hpcgpu_spec(args: argparse.Namespace, work: Path, data: Path, gpus: int, max_steps: int, log_every: int,
                name: str, overrides: dict[str, Any] | None = None) -> Path:
    spec = {
        "name": name, "task": "train", "runs_dir": str(work / "runs"),
        "resources": {"gpus": gpus, "cpus_per_gpu": 1 if args.cpu else 4},
        "distributed": {"strategy": "ddp"},  # at 1 GPU the plan makes it "none": no DDP, as the loops
        "model": {"config": train_model_config(model_of(args), args)},
        "data": {"train": str(data), "seq_len": args.seq_len},
        "train": {"global_batch_size": args.micro_batch * args.accum * gpus, "micro_batch_size": args.micro_batch,
                  "max_steps": max_steps, "log_every": log_every, "warmup_steps": 10, "lr": args.lr,
                  "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0, "precision": args.precision,
                  "compile": bool(args.compile), "eval_every": 0, "seed": args.seed},
    }
    for key, value in (overrides or {}).items():  # a --hpcgpu-variants program: the same spec, these keys set
        set_dotted(spec, key, value)
    path = work / f"{name}.spec.json"
    path.write_text(json.dumps(spec, indent=1) + "\n")  # JSON is YAML: no yaml module needed here
    return path


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise RunFailed(f"hpcgpu run {run_dir}: no metrics.jsonl")
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def hpcgpu_timed(recs: list[dict[str, Any]], warmup: int, steps: int) -> dict[str, Any]:
    """tok/s, ms/step and MFU over the steps after `warmup`, from the "train" records."""
    train = sorted((r for r in recs if r.get("kind") == "train"), key=lambda r: r["step"])
    start = next((r for r in train if r["step"] == warmup), None)
    if start is None:
        raise RunFailed(f"hpcgpu: no \"train\" record at step {warmup} (records at "
                        f"{[r['step'] for r in train][:12]}...)")
    seconds, tokens, prev = 0.0, 0, start
    factor = None  # mfu / tokens_per_s: flops_per_token / (peak x world), the same in every record
    intervals = []  # ms/step of each logged interval: a steady step or an erratic one (a host-bound loop)
    for r in train:
        if r["step"] <= warmup:
            continue
        n = r["step"] - prev["step"]
        intervals.append(float(r["ms_per_step"]))
        seconds += float(r["ms_per_step"]) * n / 1000
        tokens += int(r["tokens"]) - int(prev["tokens"])
        if factor is None and isinstance(r.get("mfu"), (int, float)) and r.get("tokens_per_s"):
            factor = float(r["mfu"]) / float(r["tokens_per_s"])
        prev = r
    if prev["step"] != warmup + steps:
        raise RunFailed(f"hpcgpu: the last \"train\" record is at step {prev['step']}, not {warmup + steps}")
    tok_s = tokens / seconds
    return {"tokens_per_s": tok_s, "ms_per_step": 1000 * seconds / steps, "timed_s": seconds, "timed_steps": steps,
            "mfu": tok_s * factor if factor is not None else None,
            "timed_s_wall": float(prev["time"]) - float(start["time"]), "final_loss": prev.get("loss"),
            "peak_mem_gib": prev.get("peak_mem_gib"),
            "interval_ms": {"median": statistics.median(intervals), "min": min(intervals), "max": max(intervals),
                            "first": intervals[0], "last": intervals[-1]}}


def run_hpcgpu(args: argparse.Namespace, work: Path, data: Path, gpus: int, tag: str,
               warmup: int | None = None, steps: int | None = None, program: str = "hpcgpu") -> dict[str, Any]:
    warmup, steps = warmup or args.warmup, steps or args.steps
    prime = tag == "prime"
    variant = program.partition("+")[2]  # its own spec name: its own spec file and run dirs
    name = f"tvl-{model_tag(args)}{gpus}g" + (f"-{variant}" if variant else "") + ("-prime" if prime else "")
    spec = hpcgpu_spec(args, work, data, gpus, warmup + steps, 1 if prime else args.log_every, name,
                       args.variants.get(program))
    cmd = [sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new", "--gpus", str(gpus)]
    for item in args.hpcgpu_set:
        cmd += ["--set", item]
    env, cwd = child_env(args, work), REPO
    checkout = args.checkouts.get(program)
    if checkout is not None:  # that checkout's hpcgpu: first on the path, and the cwd `-m` looks in first
        env["PYTHONPATH"] = os.pathsep.join([checkout, env["PYTHONPATH"]])
        cwd = Path(checkout)
    rc, t_launch, out, err = launch(cmd, env, work / "logs" / f"{model_tag(args)}{tag}-{program}-{gpus}g",
                                    args.timeout, cwd)
    wall = time.time() - t_launch
    if rc != 0:
        raise RunFailed(f"{program} at {gpus} GPU(s) failed (exit {rc}; `{' '.join(cmd[1:])}`):\n{tail(out, 1000)}\n"
                        f"{tail(err)}")
    found = re.findall(r"run dir\s+(\S+)", err + "\n" + out)
    if found:
        run_dir = Path(found[-1].rstrip(",;"))
    else:  # the newest run dir of the spec
        run_dir = max((work / "runs" / name).iterdir(), key=lambda p: p.stat().st_mtime)
    recs = read_records(run_dir)
    shutil.rmtree(run_dir / "model", ignore_errors=True)  # the final model (~0.5 GB for 124M): not needed
    if prime:
        return {"wall_s": wall, "run_dir": str(run_dir)}
    res = hpcgpu_timed(recs, warmup, steps)
    first = next((r for r in recs if r.get("kind") == "train" and r["step"] == 1), None)
    if first is None:
        raise RunFailed(f"hpcgpu run {run_dir}: no \"train\" record at step 1")
    res.update(ttfs_s=float(first["time"]) - t_launch, ttfs_inproc_s=None, wall_s=wall, run_dir=str(run_dir))
    startup = next((r for r in recs if r.get("kind") == "startup"), None)  # rank 0's phases (not in old commits)
    if startup is not None:
        res["startup"] = startup_phases(startup)
        note(f"{program} at {gpus} GPU(s), start-up of rank 0: "
             + ", ".join(f"{name} {v:.1f} s" for name, v in res["startup"].items()))
    return res


def run_program(args: argparse.Namespace, work: Path, data: Path, program: str, gpus: int, tag: str,
                **steps: int) -> dict[str, Any]:
    if program.startswith("hpcgpu"):  # hpcgpu or a variant of it
        return run_hpcgpu(args, work, data, gpus, tag, program=program, **steps)
    return run_loop(args, work, program, gpus, tag, **steps)


class PrimedPairs:
    """The (program, GPU count) pairs whose compiled graphs are in the shared cache (a JSON list); a
    --hpcgpu-variants program is a program of its own (its settings may compile other graphs), and so is
    a program on another --model (prefix: model_tag; none for GPT-2 124M, as before)."""

    def __init__(self, path: Path, prefix: str = ""):
        self.path, self.prefix = path, prefix
        self.pairs = set(json.loads(path.read_text())) if path.exists() else set()

    def has(self, program: str, gpus: int) -> bool:
        return f"{self.prefix}{program}@{gpus}" in self.pairs

    def add(self, program: str, gpus: int) -> None:
        self.pairs.add(f"{self.prefix}{program}@{gpus}")
        self.path.write_text(json.dumps(sorted(self.pairs)))


def first_step_text(r: dict[str, Any]) -> str:
    if r.get("ttfs_s") is None and "ttfs_cold_s" in r:
        return f"{r['ttfs_cold_s']:.1f} s (cold compile cache: left out)"
    return f"{r['ttfs_s']:.1f} s"


# ---------------------------------------------------------------- statistics

def fmt_spread(values: list[Any], digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    vals = [v * scale for v in values if isinstance(v, (int, float))]
    if not vals:
        return "-"
    med, lo, hi = spread(vals)
    return f"{med:,.{digits}f}{unit} [{lo:,.{digits}f}-{hi:,.{digits}f}]"


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str, how: str) -> list[float]:
    """Per-round values of a (op) b, for the rounds both have."""
    by_round = {y["round"]: y for y in b}
    out = []
    for x in a:
        y = by_round.get(x["round"])
        if y is None or not isinstance(x.get(key), (int, float)) or not isinstance(y.get(key), (int, float)):
            continue
        out.append(x[key] / y[key] if how == "ratio" else x[key] - y[key])
    return out


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str = "tokens_per_s",
            how: str = "ratio") -> dict[str, Any] | None:
    """The ratio (or difference) of the medians, the range of the per-round ratios (differences), and
    whether the gap (to 1, or to 0) is smaller than half that range."""
    va = [x[key] for x in a if isinstance(x.get(key), (int, float))]
    vb = [y[key] for y in b if isinstance(y.get(key), (int, float))]
    if not va or not vb:
        return None
    ma, mb = statistics.median(va), statistics.median(vb)
    value = ma / mb if how == "ratio" else ma - mb
    rounds = paired(a, b, key, how)
    lo, hi = min(rounds, default=value), max(rounds, default=value)
    gap = abs(value - (1.0 if how == "ratio" else 0.0))
    return {"value": value, "min": lo, "max": hi, "rounds": rounds, "within_spread": gap < (hi - lo) / 2}


def scaling_runs(results: dict[str, dict[str, list[dict[str, Any]]]], program: str, n: int) -> list[dict[str, Any]]:
    """Per round: tok/s(n) / (n x tok/s(1)), as pseudo-runs (round, efficiency)."""
    one = {r["round"]: r for r in results.get("1", {}).get(program, [])}
    out = []
    for r in results.get(str(n), {}).get(program, []):
        if r["round"] in one:
            out.append({"round": r["round"], "efficiency": r["tokens_per_s"] / (n * one[r["round"]]["tokens_per_s"])})
    return out


def scaling_of_medians(results: dict[str, dict[str, list[dict[str, Any]]]], program: str, n: int) -> float | None:
    a = [r["tokens_per_s"] for r in results.get(str(n), {}).get(program, [])]
    b = [r["tokens_per_s"] for r in results.get("1", {}).get(program, [])]
    return statistics.median(a) / (n * statistics.median(b)) if a and b else None


# ---------------------------------------------------------------- report

def variant_names(programs: list[str]) -> list[str]:
    return [p for p in programs if p.startswith("hpcgpu+")]


def verdict(args: argparse.Namespace, ok: bool) -> str:
    return "n/a (smoke)" if args.smoke else "PASS" if ok else "FAIL"


def build_summary(args: argparse.Namespace, results: dict[str, dict[str, list[dict[str, Any]]]],
                  programs: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"per_gpus": {}, "scaling": {}, "targets": []}
    counts = sorted(int(g) for g, res in results.items() if any(res.values()))
    unit = "rank(s)" if args.cpu else "GPU(s)"
    for g in counts:
        res = results[str(g)]
        rows = {}
        for p in programs:
            runs = res.get(p) or []
            if runs:
                rows[p] = {k: spread([r[k] for r in runs if isinstance(r.get(k), (int, float))])
                           if any(isinstance(r.get(k), (int, float)) for r in runs) else None
                           for k in ("tokens_per_s", "mfu", "ms_per_step", "timed_s", "ttfs_s", "ttfs_inproc_s")}
                rows[p]["runs"] = len(runs)
        ratios = {"hpcgpu/minimal": compare(res.get("hpcgpu", []), res.get("minimal", [])),
                  "hpcgpu/careful": compare(res.get("hpcgpu", []), res.get("careful", [])),
                  "careful/minimal": compare(res.get("careful", []), res.get("minimal", []))}
        for v in variant_names(programs):  # against plain hpcgpu: whether the setting helps
            ratios[f"{v}/hpcgpu"] = compare(res.get(v, []), res.get("hpcgpu", []))
            ratios[f"{v}/minimal"] = compare(res.get(v, []), res.get("minimal", []))
        ttfs = {"hpcgpu-careful": compare(res.get("hpcgpu", []), res.get("careful", []), "ttfs_s", "diff"),
                "hpcgpu-minimal": compare(res.get("hpcgpu", []), res.get("minimal", []), "ttfs_s", "diff")}
        summary["per_gpus"][str(g)] = {"programs": rows, "ratios": ratios, "ttfs_diff_s": ttfs}
        for key, target in (("hpcgpu/careful", TARGET_VS_CAREFUL), ("hpcgpu/minimal", TARGET_VS_MINIMAL)):
            r = ratios[key]
            if r is not None:
                summary["targets"].append({"what": f"{g} {unit}: {key} tok/s >= {target:.2f}", "value": r["value"],
                                           "pass": r["value"] >= target, "within_spread": r["within_spread"],
                                           "range": [r["min"], r["max"]]})
        goal = MFU_GOALS.get(args.model)
        for p in ([q for q in programs if q.startswith("hpcgpu")] if g == 1 and not args.cpu and goal else []):
            m = (rows.get(p) or {}).get("mfu")
            if m is not None:
                summary["targets"].append({"what": f"1 GPU: {p} MFU >= {goal:.2f} ({args.model})", "value": m[0],
                                           "pass": m[0] >= goal, "within_spread": m[1] < goal <= m[2],
                                           "range": [m[1], m[2]]})
        d = ttfs["hpcgpu-careful"]
        if d is not None:
            summary["targets"].append({"what": f"{g} {unit}: time to first step hpcgpu <= careful + "
                                               f"{TARGET_TTFS_SLACK_S:g} s", "value": d["value"],
                                       "pass": d["value"] <= TARGET_TTFS_SLACK_S, "within_spread": d["within_spread"],
                                       "range": [d["min"], d["max"]]})
    for n in counts:
        if n == 1 or 1 not in counts:
            continue
        per = {}
        for p in programs:
            runs = scaling_runs(results, p, n)
            med = scaling_of_medians(results, p, n)
            if med is not None:
                per[p] = {"efficiency": med, "rounds": [r["efficiency"] for r in runs],
                          "min": min((r["efficiency"] for r in runs), default=med),
                          "max": max((r["efficiency"] for r in runs), default=med), "_runs": runs}
        cmp = None
        if "hpcgpu" in per and "minimal" in per:
            cmp = compare(per["hpcgpu"]["_runs"], per["minimal"]["_runs"], "efficiency")
            if cmp is not None:
                cmp["value"] = per["hpcgpu"]["efficiency"] / per["minimal"]["efficiency"]  # of the medians
                what = f"{n}-{'rank' if args.cpu else 'GPU'} scaling: hpcgpu >= minimal"
                summary["targets"].append({"what": what, "value": cmp["value"],
                                           "pass": per["hpcgpu"]["efficiency"] >= per["minimal"]["efficiency"],
                                           "within_spread": cmp["within_spread"], "range": [cmp["min"], cmp["max"]],
                                           "hpcgpu": per["hpcgpu"]["efficiency"],
                                           "minimal": per["minimal"]["efficiency"]})
        for p in per.values():
            p.pop("_runs")
        summary["scaling"][str(n)] = {"programs": per, "hpcgpu/minimal": cmp}
    return summary


def short_lines(args: argparse.Namespace, results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    if args.min_seconds <= 0:
        return []
    lines = []
    for g, res in sorted(results.items(), key=lambda kv: int(kv[0])):
        for p, runs in res.items():
            short = [r for r in runs if r["timed_s"] < args.min_seconds]
            if short:
                worst = min(short, key=lambda r: r["timed_s"])
                need = math.ceil(worst["timed_steps"] * args.min_seconds / worst["timed_s"] / args.log_every)
                lines.append(f"WARNING: {g} GPU {p}: {len(short)} of {len(runs)} measurements under "
                             f"{args.min_seconds:g} s timed (shortest {worst['timed_s']:.1f} s); --steps "
                             f"{need * args.log_every} would reach it")
    return lines


def print_report(args: argparse.Namespace, rep: dict[str, Any]) -> None:
    s, results, programs = rep["summary"], rep["results"], rep["programs"]
    w = max([8, *map(len, programs)])  # the program column: 8 unless a variant's name is longer
    params = next((r.get("params") for res in results.values() for runs in res.values() for r in runs
                   if r.get("params")), None)
    llama = (f", {args.n_kv_head} KV heads, MLP {args.intermediate}" if args.model == "llama-1b" else "")
    print(f"# train: hpcgpu vs hand-written loops; {args.model}: {MODEL_KIND[args.model]} ({args.n_layer} layers, "
          f"{args.n_embd} hidden, {args.n_head} heads{llama}, vocab {args.vocab}"
          + (f", {params / 1e6:.1f}M params" if params else "") + f"), seq {args.seq_len}, micro "
          f"{args.micro_batch} x accum {args.accum} per GPU, {args.precision}, compile "
          f"{'on' if args.compile else 'off'}, {'fused ' if not args.cpu else ''}AdamW; {args.warmup} untimed + "
          f"{args.steps} timed steps; {rep['gpu']}; median [min-max] over rounds")
    for g in sorted(s["per_gpus"], key=int):
        block = s["per_gpus"][g]
        res = results[g]
        print(f"\n== {g} {'CPU rank' if args.cpu else 'GPU'}{'s' if int(g) > 1 else ''}: "
              f"{rep['rounds'].get(g, 0)} round(s) ==")
        print(f"{'program':<{w}} {'tok/s':>28} {'MFU %':>18} {'ms/step':>22} {'timed s':>18} "
              f"{'1st step s (launch)':>22} {'(in process)':>18}")
        for p in programs:
            runs = res.get(p) or []
            if not runs:
                continue
            print(f"{p:<{w}} {fmt_spread([r['tokens_per_s'] for r in runs], 0):>28} "
                  f"{fmt_spread([r['mfu'] for r in runs], 1, 100):>18} "
                  f"{fmt_spread([r['ms_per_step'] for r in runs], 2):>22} "
                  f"{fmt_spread([r['timed_s'] for r in runs], 1):>18} "
                  f"{fmt_spread([r['ttfs_s'] for r in runs], 1):>22} "
                  f"{fmt_spread([r.get('ttfs_inproc_s') for r in runs], 1):>18}")
        print("ratios of median tok/s [range of the per-round ratios]:")
        targets = {"hpcgpu/minimal": TARGET_VS_MINIMAL, "hpcgpu/careful": TARGET_VS_CAREFUL}
        kw = max([16, *map(len, block["ratios"])])
        for key, r in block["ratios"].items():
            target = targets.get(key)
            if r is None:
                continue
            line = f"  {key:<{kw}} {r['value']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"
            if r["within_spread"]:
                line += "  gap smaller than the spread"
            if target is not None:
                line += f"  target >= {target:.2f}: {verdict(args, r['value'] >= target)}"
            print(line)
        d = block["ttfs_diff_s"]["hpcgpu-careful"]
        m = block["ttfs_diff_s"]["hpcgpu-minimal"]
        if d is not None:
            line = (f"time to first step, hpcgpu - careful: {d['value']:+.1f} s [{d['min']:+.1f}, {d['max']:+.1f}]"
                    + ("  gap smaller than the spread" if d["within_spread"] else "")
                    + f"  target <= +{TARGET_TTFS_SLACK_S:g} s: {verdict(args, d['value'] <= TARGET_TTFS_SLACK_S)}")
            print(line)
        if m is not None:
            print(f"time to first step, hpcgpu - minimal: {m['value']:+.1f} s [{m['min']:+.1f}, {m['max']:+.1f}]"
                  + ("  gap smaller than the spread" if m["within_spread"] else ""))
    for n, block in sorted(s["scaling"].items(), key=lambda kv: int(kv[0])):
        print(f"\n== {n}-{'rank' if args.cpu else 'GPU'} scaling: tok/s({n}) / ({n} x tok/s(1)), of the medians "
              "[range of the per-round values] ==")
        for p, e in block["programs"].items():
            print(f"  {p:<{w}} {e['efficiency']:.3f} [{e['min']:.3f}-{e['max']:.3f}]")
        c = block["hpcgpu/minimal"]
        if c is not None:
            ok = block["programs"]["hpcgpu"]["efficiency"] >= block["programs"]["minimal"]["efficiency"]
            print(f"  hpcgpu/minimal scaling {c['value']:.3f} [{c['min']:.3f}-{c['max']:.3f}]"
                  + ("  gap smaller than the spread" if c["within_spread"] else "")
                  + f"  target hpcgpu >= minimal: {verdict(args, ok)}")
    print("\ntargets:")
    few = [g for g, n in rep["rounds"].items() if n < 3]
    for t in s["targets"]:
        extra = "  (gap smaller than the spread)" if t["within_spread"] else ""
        lo, hi = t["range"]
        shown = (f"{t['value']:+.1f} s [{lo:+.1f}, {hi:+.1f}]" if t["what"].endswith(" s")
                 else f"{t['value']:.3f} [{lo:.3f}-{hi:.3f}]")
        print(f"  {verdict(args, t['pass']):<12} {t['what']}: {shown}{extra}")
    if few and not args.smoke:
        print(f"  note: fewer than 3 rounds at {', '.join(sorted(few, key=int))} GPU(s): verdicts are provisional")
    for line in rep["notes"] + short_lines(args, results):
        print(line)


# ---------------------------------------------------------------- main

def run_setup(args: argparse.Namespace, gpu: str) -> dict[str, Any]:
    # the host too: --append pools the rounds of one host only (a fresh device machine is another host)
    setup = {"gpu": gpu, "host": host_id(args), **{k: getattr(args, k) for k in SETUP_KEYS}}
    if args.variants:  # only then: files written before the option pool as before
        setup["hpcgpu_variants"] = args.variants
    if args.checkouts:
        setup["hpcgpu_checkouts"] = args.checkouts
    return setup


def earlier(args: argparse.Namespace, setup: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """An --append file's results, notes and programs (PROGRAMS in a file from before it said)."""
    if args.append is None or not args.append.exists():
        return {}, [], []
    old = json.loads(args.append.read_text())
    if old.get("setup") is not None and "model" not in old["setup"]:  # written before --model: GPT-2 124M's
        old["setup"] = {"model": DEFAULT_MODEL, **old["setup"]}
    if old.get("setup") != setup:
        was = old.get("setup") or {}
        diff = sorted(k for k in set(setup) | set(was) if setup.get(k) != was.get(k))
        raise SystemExit(f"--append {args.append}: an earlier run of another setup (differs in: {', '.join(diff)}); "
                         "give another file")
    return old.get("results", {}), list(old.get("notes", [])), list(old.get("programs", PROGRAMS))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model (2 layers, 64 hidden, vocab 512; GPT-2: 2 heads; llama-1b: 4 heads, 2 KV heads, "
                         "MLP 128), seq 64, 2 + 6 steps, CPU ranks (gloo), no compile, fp32, --gpus 1,2, 1 round, "
                         "no 20 s rule: checks the script, measures nothing")
    ap.add_argument("--gpus", default="1,2", help="GPU counts, comma-separated (default 1,2)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds in this call (default 3; 1 smoke)")
    ap.add_argument("--steps", type=int, default=600,
                    help="timed steps per run, after --warmup (default 600: ~27 s on an H100 at ~45 ms/step)")
    ap.add_argument("--warmup", type=int, default=50, help="untimed steps first, compile included (default 50)")
    ap.add_argument("--log-every", type=int, default=10,
                    help="hpcgpu's train.log_every and the careful loop's loss read-back interval (default 10); "
                         "--warmup and --steps must be multiples")
    ap.add_argument("--model", choices=list(TRAIN_MODELS), default=DEFAULT_MODEL,
                    help="gpt2-124m (default): GPT-2 124M; llama-1b: Llama-3.2-1B's shape (16 layers, 2048 hidden, "
                         "32 heads, 8 KV heads, MLP 8192, vocab 128256, tied embeddings); from a config, random "
                         "weights; it sets the defaults of --vocab, --seq-len and --micro-batch; part of the setup")
    ap.add_argument("--n-layer", type=int, default=None, help="gpt2-124m only (default 12)")
    ap.add_argument("--n-embd", type=int, default=None, help="gpt2-124m only (default 768)")
    ap.add_argument("--n-head", type=int, default=None, help="gpt2-124m only (default 12)")
    ap.add_argument("--vocab", type=int, default=None, help="default 50304 (gpt2-124m), 128256 (llama-1b)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 1024 (gpt2-124m), 2048 (llama-1b)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per GPU per forward pass (default 16 (gpt2-124m), 4 (llama-1b))")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation (default 1)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile (default on)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default bf16 (fp32 with --smoke)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-tokens", type=int, default=None,
                    help="tokens of training data: the careful loop's host array and hpcgpu's text file "
                         "(bytes) (default 4M, or 4096 sequences where --seq-len is above 1024)")
    ap.add_argument("--programs", default=",".join(PROGRAMS), help="subset, comma-separated (default all three)")
    ap.add_argument("--prime", action=argparse.BooleanOptionalAction, default=None,
                    help="a short untimed run of each program at each count first, to fill the shared compile "
                         "cache (default off: a cold run's first-step time is left out instead)")
    ap.add_argument("--min-seconds", type=float, default=20.0, help="flag runs timed shorter (default 20; 0 smoke)")
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds a run may take before it is ended")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which no new run starts when the longest run so far would not fit "
                         "(for a per-command time cap); what was measured is reported")
    ap.add_argument("--child-env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in the environment of all three programs; repeatable; part of the setup")
    ap.add_argument("--hpcgpu-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra `--set` for hpcgpu (e.g. monitor.enabled=false); repeatable; part of the setup")
    ap.add_argument("--hpcgpu-variants", default=None, metavar="NAME:KEY=VALUE,...;...",
                    help="extra hpcgpu programs, hpcgpu+NAME: the same spec with these dotted keys set (a value is "
                         "JSON where it parses, else a string), in every round beside the others; reported against "
                         "hpcgpu and minimal (no targets); part of the setup. E.g. "
                         "\"gabv:distributed.ddp.gradient_as_bucket_view=true;b50:distributed.ddp.bucket_cap_mb=50\"; "
                         "NAME@DIR runs the hpcgpu package in DIR (another commit's: `git archive REV hpcgpu | tar -x "
                         "-C DIR`), with or without keys")
    ap.add_argument("--work", type=Path, default=None,
                    help="work dir (data, specs, logs, run dirs, compile cache; kept); default: a temporary dir")
    ap.add_argument("--append", type=Path, default=None, metavar="FILE",
                    help="pool with the rounds an earlier call of the same setup wrote to FILE (rounds counted "
                         "per GPU count, the order goes on rotating), then rewrite FILE")
    ap.add_argument("--json", type=Path, default=None, help="write the report here (default $OUT/train_vs_loops.json)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    args.cpu = args.smoke
    if args.model != DEFAULT_MODEL and any(v is not None for v in (args.n_layer, args.n_embd, args.n_head)):
        ap.error(f"--n-layer, --n-embd and --n-head shape GPT-2 (--model {DEFAULT_MODEL}); {args.model} has "
                 "its own shape")
    if args.smoke:  # the model's tiny shape, whatever was given
        vars(args).update(SMOKE[args.model])
        args.accum, args.steps, args.warmup, args.log_every = 1, 6, 2, 2
        args.compile, args.data_tokens, args.min_seconds = False, 1 << 16, 0.0
    fill_model_defaults(args)  # what was not given: the model's
    if args.data_tokens is None:  # 4M tokens (4096 sequences at 1024), and 4096 sequences at longer ones
        args.data_tokens = max(1 << 22, 4096 * args.seq_len)
    args.precision = args.precision or ("fp32" if args.smoke else "bf16")
    args.repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.warmup % args.log_every or args.steps % args.log_every or args.warmup < args.log_every:
        ap.error("--warmup and --steps must be (non-zero) multiples of --log-every: hpcgpu's records then fall "
                 "on the timed window's edges")
    programs = [p for p in args.programs.split(",") if p]
    if not programs or any(p not in PROGRAMS for p in programs):
        ap.error(f"--programs: of {', '.join(PROGRAMS)}")
    try:
        args.variants, args.checkouts = parse_variants(args.hpcgpu_variants or "")
    except ValueError as exc:
        ap.error(f"--hpcgpu-variants: {exc}")
    programs += list(args.variants)  # rotated with the others in every round
    counts = sorted({int(g) for g in args.gpus.split(",") if g})
    gpu = gpu_name(args)
    if not args.cpu:
        names = nvidia_smi_names()
        if names is not None and counts[-1] > len(names):
            note(f"only {len(names)} GPU(s) here: skipping {[c for c in counts if c > len(names)]}")
            counts = [c for c in counts if c <= len(names)]
        if not counts:
            raise SystemExit("no GPU count to run")
    blocks = args.data_tokens // args.seq_len
    if blocks < args.micro_batch * args.accum * counts[-1]:
        ap.error(f"--data-tokens {args.data_tokens}: fewer than one global batch of sequences at {counts[-1]} GPUs")

    t_start = time.time()
    workspace = contextlib.ExitStack()  # closed in the finally below, after the last report
    work = workspace.enter_context(work_dir(args.work, "train-vs-loops-"))
    setup = run_setup(args, gpu)
    results, notes, shown = earlier(args, setup)
    shown = list(dict.fromkeys(shown + programs))  # reported: this call's programs and those of earlier calls
    results = {g: {p: list(v) for p, v in res.items()} for g, res in results.items()}
    failed = False
    target = args.json or (Path(os.environ["OUT"], "train_vs_loops.json") if os.environ.get("OUT") else None)

    def report() -> dict[str, Any]:
        rounds = {g: max((r["round"] for runs in res.values() for r in runs), default=0) for g, res in results.items()}
        rep = {"gpu": gpu, "setup": setup, "programs": shown, "results": results, "rounds": rounds, "notes": notes,
               "summary": build_summary(args, results, shown),
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "total_s": time.time() - t_start}
        for path in {p for p in (target, args.append) if p is not None}:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(rep, indent=1))
        return rep

    try:
        data = work / f"data-{args.data_tokens}-s{args.seed}.txt"
        if not data.exists():
            random_text(data, args.data_tokens, args.seed)
        cache = work / "inductor-cache"
        prime = bool(args.prime) and args.compile
        cache.mkdir(exist_ok=True)
        primed = PrimedPairs(cache / "primed.json", model_tag(args))
        longest = 0.0

        def out_of_time() -> bool:
            if args.deadline is None:
                return False
            # the longest run so far (none yet: the first run always starts)
            return time.time() - t_start + longest > args.deadline

        if prime:
            for p, g in [(p, c) for c in counts for p in programs if not primed.has(p, c)]:
                t0 = time.time()
                try:
                    run_program(args, work, data, p, g, "prime", warmup=1, steps=1)
                    primed.add(p, g)
                    note(f"primed the compile cache with {p} at {g}: {time.time() - t0:.0f} s")
                except RunFailed as exc:
                    note(f"priming run of {p} failed (the measured run will say more):\n{exc}")
        for k in range(args.repeats):
            for g in counts:
                res = results.setdefault(str(g), {})
                done = max((r["round"] for runs in res.values() for r in runs), default=0)
                have = {p for p, runs in res.items() for r in runs if r["round"] == done}
                missing = [p for p in programs if p not in have]
                if k == 0 and done and missing:  # an earlier call's last round was cut short: complete it
                    rnd, order = done, [p for p in rotated(programs, done - 1) if p in missing]
                    note(f"completing round {rnd} at {g} GPU(s): {', '.join(order)}")
                else:
                    rnd = done + 1
                    order = rotated(programs, rnd - 1)
                for p in order:
                    if out_of_time():
                        notes.append(f"--deadline {args.deadline:g} s: stopped before round {rnd} {p} at {g} GPU(s)")
                        note(notes[-1])
                        raise DeadlineReached
                    t0 = time.time()
                    try:
                        r = run_program(args, work, data, p, g, f"r{rnd}")
                    except RunFailed as exc:
                        failed = True
                        notes.append(f"round {rnd}, {g} GPU(s): {str(exc).splitlines()[0]}")
                        note(str(exc))
                        continue
                    finally:
                        longest = max(longest, time.time() - t0)
                    r.update(round=rnd, program=p, gpus=g)
                    if args.compile and not primed.has(p, g):  # it compiled from scratch: not comparable
                        r.update(ttfs_cold_s=r["ttfs_s"], ttfs_s=None, ttfs_inproc_s=None)
                        primed.add(p, g)
                    res.setdefault(p, []).append(r)
                    mfu = f", MFU {r['mfu'] * 100:.1f}%" if isinstance(r.get("mfu"), (int, float)) else ""
                    iv = r.get("interval_ms")
                    spread = (f" ({args.log_every}-step intervals {iv['min']:.1f}-{iv['max']:.1f}, median "
                              f"{iv['median']:.1f}, first {iv['first']:.1f}, last {iv['last']:.1f})" if iv else "")
                    note(f"round {rnd} {g} GPU(s) {p}: {r['tokens_per_s']:,.0f} tok/s{mfu}, {r['ms_per_step']:.2f} "
                         f"ms/step{spread} over {r['timed_s']:.1f} s; first step {first_step_text(r)} after launch; "
                         f"process {r['wall_s']:.0f} s")
                    report()  # after every run: a call ended by a time cap keeps what it measured
    except DeadlineReached:
        pass
    finally:
        rep = report()
        workspace.close()
    print_report(args, rep)
    print(f"(whole benchmark: {rep['total_s']:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
