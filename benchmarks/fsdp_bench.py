"""FSDP2 against DeepSpeed ZeRO-3 and DDP through hpcgpu's train task, Llama-3.2-1B's shape at 2 GPUs (issue #36).

    # on a GPU machine with deepspeed (carried as a wheel: PYTHONPATH=<this checkout>:/tmp/site):
    PYTHONPATH=$PWD python benchmarks/fsdp_bench.py [--rounds 3] [--seconds 20] [--deadline 330]
    # what gpu_session.sh runs (step `fsdp`): the call's budget left as the deadline, JSON under $OUT
    CALL_BUDGET=500 FSDP_ROUNDS=3 bash benchmarks/gpu_session.sh steps fsdp
    # everything tiny on the CPU (gloo, 2 ranks, fp32), to check the script end to end; measures nothing:
    python benchmarks/fsdp_bench.py --smoke

The issue's target: FSDP2 >= 1.15 x ZeRO-3's tokens/s at no more memory per GPU (and DDP beside them).

The model: Llama-3.2-1B's shape (bench_common.py TRAIN_MODELS["llama-1b"]: HF LlamaForCausalLM from a
config, random weights, sdpa, 16 layers, 2048 hidden, 32 heads, 8 KV heads, MLP 8192, vocab 128256,
tied embeddings, rope_theta 500000; 1.24B parameters), hpcgpu's default model.dtype (fp32 weights).
The data: --data-tokens random ASCII bytes, hpcgpu's byte tokenizer (a token a byte).

Every run is `python -m hpcgpu submit SPEC --executor local --new --gpus N` of one spec with only
`distributed` changed (--strategies; default fsdp,zero3,ddp):
    fsdp            distributed.strategy fsdp, fsdp.reshard_after_forward true, cpu_offload false,
                    reduce_dtype fp32 (the schema's defaults, written out)
    fsdp-bf16       the same with reduce_dtype bf16 (the gradient reduce-scatter in bf16)
    fsdp-noreshard  the same with reshard_after_forward false (ZeRO-2's memory, one all-gather less)
    zero3, zero2    distributed.strategy deepspeed, deepspeed.zero_stage 3 (2)
    ddp             distributed.strategy ddp
and the same train settings for all: precision bf16, seq --seq-len (2048), micro batch --micro-batch (4)
x accumulation --accum (1) x N GPUs = the global batch, gradient checkpointing off, AdamW (hpcgpu's),
lr 3e-4 with 10 warmup steps, grad clip 1.0, no eval, no checkpoints, the GPU monitor sampling every
second (gpu.jsonl). --compile off (default): torch.compile off for every strategy, so the rows differ
only in the strategy (DeepSpeed runs eager in hpcgpu whatever the spec says); --compile auto: as the
run plan decides for each (DDP compiled whole, fsdp block by block, DeepSpeed eager), with a compile
cache in the work dir shared by the runs (the first run of each compiles cold: not timed, but it costs
wall time). --set KEY=VALUE (repeatable): a dotted spec key set in every run's spec.

Measured, each from the run's own files: tok/s = tokens of the steps after --warmup / their time, from
the "train" records of metrics.jsonl (every 5 steps, each interval timed on the GPU's clock by the
step log; train_vs_loops.py hpcgpu_timed); the range of the 5-step intervals' ms/step is kept (a wide
one: an erratic step). Peak memory: rank 0's torch.cuda.max_memory_allocated (the records'
peak_mem_gib; the train task writes rank 0's only) and, for every GPU, the largest memory.used NVML
saw in gpu.jsonl (sampled each second; the caching allocator's reserve, the CUDA context and NCCL's
buffers included). Each run's final model (~5 GB) is deleted once read.

Rounds are interleaved: round r runs the strategies in an order rotated by r (fsdp zero3 ddp, zero3
ddp fsdp, ddp fsdp zero3). Each run does --warmup untimed steps, then enough steps for --seconds of
steady state at the step time known for its strategy (--est-ms before one is measured). --deadline S
(seconds from the start): the seconds of the runs left are cut (not below --min-seconds) so that the
rounds asked for fit, from each strategy's overhead so far (start-up, warm-up, the final save, exit:
--est-overhead before one is measured); a run that would still end past S is not started. Runs under
the issue's 20 s of steady state and fewer than 3 rounds are said in the report.

Printed: per strategy the plan it ran with, median [min-max] tok/s, ms/step, seconds timed, peak GiB
(rank 0 allocated; NVML per GPU); the ratios fsdp/zero3 and fsdp/ddp of the medians with the range
of the per-round ratios; PASS/FAIL for the target (tokens: fsdp/zero3 >= 1.15 of the medians; memory:
fsdp's peak <= zero3's, by allocation on rank 0 and by NVML's largest GPU). JSON of the raw numbers:
--json (default $OUT/fsdp_bench.json where $OUT is set). This driver never touches CUDA (hpcgpu's
busy-GPU check would see it) and does not import torch.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import ratio_of_runs, TRAIN_MODELS, gpu_name, rotated, spread, train_model_config, work_dir
from train_vs_loops import (SMOKE, RunFailed, hpcgpu_timed, launch, on_sigterm, random_text, read_records, set_dotted,
                             tail)

REPO = Path(__file__).resolve().parent.parent
INTERVAL = 5  # train.log_every: steps per timed interval
ISSUE_SECONDS = 20.0  # the issue's steady state per measurement
TARGET_VS_ZERO3 = 1.15
FSDP_DEFAULTS = {"reshard_after_forward": True, "cpu_offload": False, "reduce_dtype": "fp32"}
STRATEGIES: dict[str, dict[str, Any]] = {
    "fsdp": {"strategy": "fsdp", "fsdp": dict(FSDP_DEFAULTS)},
    "fsdp-bf16": {"strategy": "fsdp", "fsdp": {**FSDP_DEFAULTS, "reduce_dtype": "bf16"}},
    "fsdp-noreshard": {"strategy": "fsdp", "fsdp": {**FSDP_DEFAULTS, "reshard_after_forward": False}},
    "zero3": {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}},
    "zero2": {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2}},
    "ddp": {"strategy": "ddp"},
}
# ms/step at micro 4 x seq 2048 x 2 H200s, uncompiled, before a run of the strategy is measured: from DDP's
# and ZeRO-3's 90k and 32k tok/s on the 1.1B Llama (benchmarks/RESULTS.md, issue 7), scaled to this shape
EST_MS = "fsdp=260,fsdp-bf16=250,fsdp-noreshard=240,zero3=600,zero2=220,ddp=200"
# a run's seconds beside its timed steps (start-up, warm-up, the final gather and save, exit) before one is
# measured: a guess (DeepSpeed's start-up is the slowest: 77 s of wall on a 2-core CPU for a tiny model, where
# fsdp's and DDP's took 14-19 s); "*": any other strategy
EST_OVERHEAD = "zero3=75,zero2=65,*=50"
ORIG_ENV = dict(os.environ)


def note(msg: str) -> None:
    print(f"[fsdp_bench] {msg}", file=sys.stderr, flush=True)


def parse_pairs(text: str, cast: Any = float) -> dict[str, Any]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{item!r}: NAME=VALUE expected")
        out[key.strip()] = cast(value)
    return out


# ---------------------------------------------------------------- one run

def child_env(args: argparse.Namespace, work: Path) -> dict[str, str]:
    env = dict(ORIG_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["HPCGPU_REGISTRY"] = str(work / "jobs.db")  # the benchmark's jobs stay out of the user's registry
    # NVLink multicast stays off, also in a child that builds its own environment (KINDS.md)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")  # --compile auto: warm after the first run
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def spec_for(args: argparse.Namespace, work: Path, strategy: str, max_steps: int) -> Path:
    train: dict[str, Any] = {
        "global_batch_size": args.micro_batch * args.accum * args.gpus, "micro_batch_size": args.micro_batch,
        "max_steps": max_steps, "log_every": INTERVAL, "warmup_steps": 10, "lr": args.lr, "min_lr_ratio": 0.1,
        "weight_decay": 0.1, "grad_clip": 1.0, "precision": args.precision, "eval_every": 0, "seed": args.seed,
        "compile": {"off": False, "on": True, "auto": "auto"}[args.compile], "gradient_checkpointing": False}
    spec: dict[str, Any] = {
        "name": f"fsdpb-{strategy}", "task": "train", "runs_dir": str(work / "runs"),
        "resources": {"gpus": args.gpus, "cpus_per_gpu": 1 if args.smoke else 4},
        "distributed": json.loads(json.dumps(STRATEGIES[strategy])),
        "model": {"config": train_model_config("llama-1b", args)},
        "data": {"train": str(args.data), "seq_len": args.seq_len},
        "train": train,
        "monitor": {"interval_s": 1.0},
    }
    for key, value in args.sets.items():
        set_dotted(spec, key, value)
    path = work / f"fsdpb-{strategy}.spec.json"
    path.write_text(json.dumps(spec, indent=1) + "\n")  # JSON is YAML
    return path


def nvml_peaks(run_dir: Path) -> dict[str, float]:
    """Per GPU: the largest memory.used (GiB) of the run's gpu.jsonl samples."""
    peaks: dict[str, float] = {}
    for path in sorted(run_dir.glob("gpu*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            used = r.get("mem_used")
            if isinstance(used, (int, float)):
                key = f"gpu{r.get('gpu')}" + (f"@node{r['node']}" if r.get("node") else "")
                peaks[key] = max(peaks.get(key, 0.0), used / 2**30)
    return peaks


def run_strategy(args: argparse.Namespace, work: Path, strategy: str, rnd: int, steps: int) -> dict[str, Any]:
    spec = spec_for(args, work, strategy, args.warmup + steps)
    name = f"fsdpb-{strategy}"
    cmd = [sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new",
           "--gpus", str(args.gpus)]
    rc, t_launch, out, err = launch(cmd, child_env(args, work), work / "logs" / f"r{rnd}-{strategy}", args.timeout)
    wall = time.time() - t_launch
    if rc != 0:
        raise RunFailed(f"{strategy} failed (exit {rc}; `hpcgpu submit {spec.name} ...`):\n{tail(out, 1500)}\n"
                        f"{tail(err)}")
    found = re.findall(r"run dir\s+(\S+)", err + "\n" + out)
    run_dir = Path(found[-1].rstrip(",;")) if found else \
        max((work / "runs" / name).iterdir(), key=lambda p: p.stat().st_mtime)
    recs = read_records(run_dir)
    res = hpcgpu_timed(recs, args.warmup, steps)
    train = [r for r in recs if r.get("kind") == "train"]
    peaks = [r["peak_mem_gib"] for r in train if isinstance(r.get("peak_mem_gib"), (int, float))]
    try:
        plan = json.loads((run_dir / "plan.json").read_text())
        t = plan.get("train") or {}
        plan_of = {k: t.get(k) for k in ("strategy", "zero_stage", "compile", "micro_batch", "accum",
                                         "gradient_checkpointing", "offload_optimizer", "offload_params")}
        plan_of["precision"] = plan.get("precision")
    except (OSError, json.JSONDecodeError):
        plan_of = {}
    first = next((r for r in train if r["step"] == 1), None)
    res.update(strategy=strategy, round=rnd, steps=steps, warmup=args.warmup, wall_s=wall,
               overhead_s=wall - res["timed_s"], peak_alloc_gib_rank0=max(peaks) if peaks else None,
               nvml_peak_gib=nvml_peaks(run_dir), plan=plan_of, run_dir=str(run_dir),
               ttfs_s=float(first["time"]) - t_launch if first and "time" in first else None,
               log_lines=[ln for ln in (out + "\n" + err).splitlines() if "run plan:" in ln or "fsdp:" in ln][:3])
    shutil.rmtree(run_dir / "model", ignore_errors=True)  # ~5 GB a run: nothing reads it
    return res


def plan_text(plan: dict[str, Any]) -> str:
    if not plan:
        return "?"
    s = plan.get("strategy") or "?"
    if s == "deepspeed":
        s += f" ZeRO-{plan.get('zero_stage')}"
    if plan.get("offload_params") or plan.get("offload_optimizer"):
        s += " offload"
    return s + (" compiled" if plan.get("compile") else "")


# ---------------------------------------------------------------- the schedule

class Schedule:
    """Which run next and how long: the interleaved queue, each strategy's step time and overhead so
    far, and the deadline."""

    def __init__(self, args: argparse.Namespace, strategies: list[str], t_start: float):
        self.args, self.t_start = args, t_start
        self.queue = [(rnd, s) for rnd in range(args.rounds) for s in rotated(strategies, rnd)]
        self.ms: dict[str, float] = {}
        self.overhead: dict[str, float] = {}
        self.est_ms = parse_pairs(args.est_ms)
        self.est_overhead = parse_pairs(args.est_overhead)

    def ms_of(self, s: str) -> float:
        return self.ms.get(s) or self.est_ms.get(s) or 400.0

    def overhead_of(self, s: str) -> float:
        return self.overhead.get(s) or self.est_overhead.get(s) or self.est_overhead.get("*") or 50.0

    def left(self) -> float | None:
        if self.args.deadline is None:
            return None
        return self.args.deadline - (time.time() - self.t_start)

    def seconds_for(self, i: int) -> float:
        """Steady-state seconds for run i: the most (up to --seconds) at which the runs from i to the end
        of the furthest round that can still end before the deadline at --min-seconds all fit; where not
        even this run's round can, --min-seconds (more of its strategies measured, shorter)."""
        left = self.left()
        if left is None:
            return self.args.seconds
        q = self.queue
        ends = [j for j in range(i, len(q)) if j + 1 == len(q) or q[j + 1][0] != q[j][0]]  # last runs of rounds
        for end in reversed(ends):
            rest = self.queue[i:end + 1]
            # each run's overhead, and up to an interval more than asked (steps are whole intervals)
            fixed = sum(self.overhead_of(s) + INTERVAL * self.ms_of(s) / 1000 for _, s in rest)
            per_run = (left - fixed) / len(rest) / 1.05
            if per_run >= self.args.min_seconds:
                return min(self.args.seconds, per_run)
        return self.args.min_seconds

    def steps_for(self, s: str, seconds: float) -> int:
        want = seconds * 1.05 * 1000 / self.ms_of(s)
        return max(2 * INTERVAL, int(math.ceil(want / INTERVAL)) * INTERVAL)

    def fits(self, s: str, steps: int) -> tuple[bool, float]:
        need = self.overhead_of(s) + steps * self.ms_of(s) / 1000
        left = self.left()
        return (left is None or need <= left), need

    def learn(self, r: dict[str, Any]) -> None:
        s = r["strategy"]
        self.ms[s] = r["ms_per_step"]
        self.overhead[s] = max(self.overhead.get(s, 0.0), r["overhead_s"])


# ---------------------------------------------------------------- report

def peak_of(runs: list[dict[str, Any]], key: str) -> float | None:
    if key == "alloc":
        vals = [r["peak_alloc_gib_rank0"] for r in runs if r.get("peak_alloc_gib_rank0") is not None]
    else:  # NVML: the largest GPU of each run
        vals = [max(r["nvml_peak_gib"].values()) for r in runs if r.get("nvml_peak_gib")]
    return max(vals) if vals else None


def summarize(args: argparse.Namespace, rep: dict[str, Any], strategies: list[str]) -> None:
    res = rep["runs"]
    rows = {}
    for s in strategies:
        runs = res.get(s, [])
        if not runs:
            continue
        m, lo, hi = spread([r["tokens_per_s"] for r in runs])
        rows[s] = {"tokens_per_s": {"median": m, "min": lo, "max": hi}, "runs": len(runs),
                   "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
                   "timed_s": [r["timed_s"] for r in runs], "peak_alloc_gib_rank0": peak_of(runs, "alloc"),
                   "nvml_peak_gib_max_gpu": peak_of(runs, "nvml"), "plan": plan_text(runs[-1].get("plan", {}))}
    rep["summary"] = rows
    rep["ratios"] = {k: v for k, v in (("fsdp/zero3", ratio_of_runs(res, "fsdp", "zero3")),
                                       ("fsdp/ddp", ratio_of_runs(res, "fsdp", "ddp"))) if v}
    verdicts = {}
    r = rep["ratios"].get("fsdp/zero3")
    if r:
        verdicts["tokens"] = {"value": r["of_medians"], "target": TARGET_VS_ZERO3,
                              "pass": r["of_medians"] >= TARGET_VS_ZERO3}
    for key, label in (("alloc", "memory_alloc_rank0"), ("nvml", "memory_nvml_max_gpu")):
        f, z = peak_of(res.get("fsdp", []), key), peak_of(res.get("zero3", []), key)
        if f is not None and z is not None:
            verdicts[label] = {"fsdp_gib": f, "zero3_gib": z, "pass": f <= z}
    rep["verdicts"] = verdicts
    notes = []
    counts = {s: len(res.get(s, [])) for s in strategies}
    if min(counts.values(), default=0) < 3:
        notes.append(f"fewer than 3 rounds (runs per strategy: {counts}): the issue asks 3 interleaved rounds")
    short = [f"{r['strategy']} round {r['round']} {r['timed_s']:.1f} s" for runs in res.values() for r in runs
             if r["timed_s"] < ISSUE_SECONDS]
    if short:
        why = f"--seconds {args.seconds:g}" if args.seconds < ISSUE_SECONDS else "the deadline cut them"
        notes.append(f"under the issue's {ISSUE_SECONDS:.0f} s of steady state ({why}): " + ", ".join(short))
    rep["notes"] = notes


def verdict_word(args: argparse.Namespace, ok: bool) -> str:
    return "n/a (smoke)" if args.smoke else ("PASS" if ok else "FAIL")


def report(args: argparse.Namespace, rep: dict[str, Any], strategies: list[str]) -> None:
    tokens_step = args.micro_batch * args.accum * args.gpus * args.seq_len
    unit = "CPU ranks" if args.smoke else "GPUs"
    print("\n== FSDP2 vs DeepSpeed ZeRO-3 vs DDP through hpcgpu, Llama-3.2-1B shape"
          f"{' (smoke: tiny)' if args.smoke else ''}"
          f"; {rep['gpu']}; {args.gpus} {unit}, seq {args.seq_len}, micro {args.micro_batch} x accum {args.accum} x "
          f"{args.gpus} = {tokens_step:,} tokens/step, {args.precision}, compile {args.compile}"
          f"{' (plan decides)' if args.compile == 'auto' else ' for all'}; torch {rep.get('torch', '?')}, "
          f"transformers {rep.get('transformers', '?')}, deepspeed {rep.get('deepspeed', '?')}")
    print(f"{'strategy':<15} {'ran as':<20} {'tok/s median [min-max]':>28} {'ms/step':>8} {'timed s':>12} "
          f"{'peak GiB alloc r0':>17} {'NVML GiB per GPU (max)':>24} runs")
    for s in strategies:
        row = rep["summary"].get(s)
        if row is None:
            print(f"{s:<15} no run measured")
            continue
        t = row["tokens_per_s"]
        ts = row["timed_s"]
        runs = rep["runs"][s]
        nv = {}
        for r in runs:
            for g, v in r.get("nvml_peak_gib", {}).items():
                nv[g] = max(nv.get(g, 0.0), v)
        nv_text = "/".join(f"{v:.1f}" for _, v in sorted(nv.items())) or "-"
        alloc = row["peak_alloc_gib_rank0"]
        tok = f"{t['median']:,.0f} [{t['min']:,.0f}-{t['max']:,.0f}]"
        print(f"{s:<15} {row['plan']:<20} {tok:>28} "
              f"{row['ms_per_step']:>8.1f} {f'{min(ts):.1f}-{max(ts):.1f}':>12} "
              f"{(f'{alloc:.1f}' if alloc is not None else '-'):>17} {nv_text:>24} {row['runs']}")
    for key in ("fsdp/zero3", "fsdp/ddp"):
        r = rep["ratios"].get(key)
        if r:
            pr = r["per_round"]
            target = (f"  target >= {TARGET_VS_ZERO3:.2f}: {verdict_word(args, r['of_medians'] >= TARGET_VS_ZERO3)}"
                      if key == "fsdp/zero3" else "")
            print(f"{key}: {r['of_medians']:.3f} of the medians"
                  + (f" [per round {min(pr):.3f}-{max(pr):.3f}]" if pr else "") + target)
    for label, what in (("memory_alloc_rank0", "peak allocated, rank 0 (torch)"),
                        ("memory_nvml_max_gpu", "NVML memory.used, largest GPU")):
        v = rep["verdicts"].get(label)
        if v:
            print(f"memory, {what}: fsdp {v['fsdp_gib']:.1f} GiB vs zero3 {v['zero3_gib']:.1f} GiB  "
                  f"target fsdp <= zero3: {verdict_word(args, v['pass'])}")
    for n in rep["notes"]:
        print(f"note: {n}")
    for s in rep["skipped"]:
        print(f"not run: {s}")


def versions_proc(args: argparse.Namespace, work: Path) -> subprocess.Popen:
    code = ("import json, importlib.metadata as m\nout = {}\nfor p in ('torch', 'transformers', 'deepspeed'):\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: out[p] = None\nprint(json.dumps(out))")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=child_env(args, work))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--strategies", default="fsdp,zero3,ddp", help=f"of {', '.join(STRATEGIES)}")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--seconds", type=float, default=ISSUE_SECONDS, help="steady-state seconds a run (default 20)")
    ap.add_argument("--min-seconds", type=float, default=10.0,
                    help="the deadline cuts a run's seconds down to this, no further (default 10)")
    ap.add_argument("--warmup", type=int, default=10, help=f"untimed steps first (a multiple of {INTERVAL})")
    ap.add_argument("--seq-len", type=int, default=None, help="default 2048")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per forward (default 4)")
    ap.add_argument("--accum", type=int, default=1, help="micro batches per step (default 1)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default bf16 (fp32 with --smoke)")
    ap.add_argument("--compile", choices=["off", "auto", "on"], default="off",
                    help="off (default): for every strategy; auto: as the run plan decides for each")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-tokens", type=int, default=4_000_000)
    ap.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted spec key set in every run (value JSON where it parses)")
    ap.add_argument("--est-ms", default=EST_MS, help="ms/step per strategy before one is measured")
    ap.add_argument("--est-overhead", default=EST_OVERHEAD,
                    help="per strategy ('*': the others), a run's seconds beside its timed steps (start-up, warm-up, "
                         "save) before one is measured")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start: no run ends past it")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds a run may take")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama on CPU ranks, 1 round of ~1 s runs")
    args = ap.parse_args(argv)
    shape = SMOKE["llama-1b"] if args.smoke else TRAIN_MODELS["llama-1b"]
    for key in ("n_layer", "n_embd", "n_head", "n_kv_head", "intermediate", "vocab"):
        setattr(args, key, shape[key])
    args.seq_len = args.seq_len or shape["seq_len"]
    args.micro_batch = args.micro_batch or shape["micro_batch"]
    args.precision = args.precision or ("fp32" if args.smoke else "bf16")
    if args.smoke:
        args.rounds, args.seconds, args.min_seconds = min(args.rounds, 1), min(args.seconds, 1.0), 0.5
        args.data_tokens, args.warmup, args.est_overhead = 200_000, INTERVAL, "zero3=80,*=20"
        args.est_ms = ",".join(f"{s}=40" for s in STRATEGIES)
    if args.warmup % INTERVAL:
        ap.error(f"--warmup must be a multiple of {INTERVAL}")
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    args.sets = {}
    for item in args.set_items:
        key, eq, value = item.partition("=")
        if not eq:
            ap.error(f"--set {item!r}: KEY=VALUE")
        try:
            args.sets[key] = json.loads(value)
        except json.JSONDecodeError:
            args.sets[key] = value

    signal.signal(signal.SIGTERM, on_sigterm)
    t_start = time.time()
    with work_dir(args.work, "fsdp-bench-") as work:
        args.data = work / f"random-{args.data_tokens}.txt"
        if not args.data.exists():
            random_text(args.data, args.data_tokens, args.seed)
        versions = versions_proc(args, work)  # read at the end: its imports overlap the first run's start-up
        rep: dict[str, Any] = {
            "gpu": gpu_name(argparse.Namespace(cpu=args.smoke)), "strategies": strategies,
            "setup": {k: getattr(args, k) for k in ("gpus", "seq_len", "micro_batch", "accum", "precision", "compile",
                                                    "lr", "seed", "seconds", "min_seconds", "warmup", "rounds",
                                                    "data_tokens", "deadline", "sets")},
            "model": {k: getattr(args, k)
                      for k in ("n_layer", "n_embd", "n_head", "n_kv_head", "intermediate", "vocab")},
            "specs": {s: STRATEGIES[s] for s in strategies}, "runs": {}, "skipped": [], "failures": []}
        out_json = args.json or (Path(os.environ["OUT"]) / "fsdp_bench.json" if os.environ.get("OUT") else None)

        def save() -> None:
            if out_json is not None:
                out_json.parent.mkdir(parents=True, exist_ok=True)
                out_json.write_text(json.dumps(rep, indent=1, default=str) + "\n")

        if any(STRATEGIES[s]["strategy"] == "deepspeed" for s in strategies) and \
                importlib.util.find_spec("deepspeed") is None:  # found, not imported (that would start CUDA)
            gone = [s for s in strategies if STRATEGIES[s]["strategy"] == "deepspeed"]
            rep["skipped"].append(f"{', '.join(gone)}: deepspeed is not importable here (carry its wheel: "
                                  "scripts/gpu_wheels.sh, PYTHONPATH=/tmp/site)")
            note(rep["skipped"][-1])
            strategies = [s for s in strategies if s not in gone]
        sched = Schedule(args, strategies, t_start)
        for i, (rnd, s) in enumerate(sched.queue):
            seconds = sched.seconds_for(i)
            steps = sched.steps_for(s, seconds)
            ok, need = sched.fits(s, steps)
            if not ok:
                rep["skipped"].append(f"round {rnd} {s}: needs ~{need:.0f} s, {sched.left():.0f} s left of the "
                                      "deadline")
                note(rep["skipped"][-1])
                continue
            note(f"round {rnd} {s}: {args.warmup} + {steps} steps (~{seconds:.0f} s of steady state at "
                 f"{sched.ms_of(s):.0f} ms/step)")
            try:
                r = run_strategy(args, work, s, rnd, steps)
            except RunFailed as exc:
                rep["failures"].append(f"round {rnd} {s}: {str(exc)[-3000:]}")
                note(f"round {rnd} {s}: {exc}")
                sched.overhead[s] = max(sched.overhead.get(s, 0.0), sched.overhead_of(s))
                save()
                continue
            sched.learn(r)
            rep["runs"].setdefault(s, []).append(r)
            nv = ", ".join(f"{g} {v:.1f}" for g, v in sorted(r["nvml_peak_gib"].items()))
            alloc = r["peak_alloc_gib_rank0"]
            note(f"round {rnd} {s} ({plan_text(r['plan'])}): {r['tokens_per_s']:,.0f} tok/s, {r['ms_per_step']:.1f} "
                 f"ms/step (intervals {r['interval_ms']['min']:.1f}-{r['interval_ms']['max']:.1f}), "
                 f"{r['timed_s']:.1f} s "
                 f"timed, peak {(f'{alloc:.1f}' if alloc is not None else '-')} GiB allocated on rank 0"
                 f"{f' (NVML {nv})' if nv else ''}, wall {r['wall_s']:.0f} s")
            summarize(args, rep, strategies)
            save()
        try:
            out, _ = versions.communicate(timeout=60)
            rep.update(json.loads(out.strip().splitlines()[-1]))
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
            versions.kill()
        summarize(args, rep, strategies)
        rep["elapsed_s"] = time.time() - t_start
        save()
        report(args, rep, strategies)
        for f in rep["failures"]:
            print(f"\nFAILED: {f[-2500:]}")
        return 1 if rep["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
