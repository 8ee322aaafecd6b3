"""hpcgpu's `task: infer` against a plain Hugging Face `generate` loop and transformers' own fast paths,
side by side in one run, with each measurement's share of the card's memory-bandwidth bound.

    # the headline (issue #32): llama-400m, 768 rows of 8..510-token prompts, batch 64, greedy, 128 new
    # tokens; one GPU (PYTHONPATH=<this checkout> where hpcgpu is not installed; NCCL_NVLS_ENABLE=0 is set
    # for the children); --scale gives the fast variants more rows so that each loop lasts >= 20 s
    python benchmarks/infer_throughput.py [--model llama-400m] [--rows 768] [--batch-size 64] \
        [--variants "plain,hf static,hf continuous,hpcgpu,hpcgpu auto"] [--scale "hpcgpu=6,hpcgpu auto=20"] \
        [--repeats 3 | --rounds-total "3,hf continuous=1"] [--deadline 540] [--bandwidth-tbs 4.8]
    # a skewed workload: prompts 8..128 tokens, 512 new, a third of the rows ending early on a stop string
    python benchmarks/infer_throughput.py --workload skewed [--variants "hpcgpu,hpcgpu norefill"]
    # issue #14's GPT-2-shaped model, to compare with the earlier figures of benchmarks/RESULTS.md
    python benchmarks/infer_throughput.py --model gpt2-350m --variants plain,hpcgpu
    # rounds pooled over several calls on one warm machine (a cap of 10 min per command):
    python benchmarks/infer_throughput.py --rounds-total 3 --deadline 540 --work /tmp/ib --append /tmp/ib/h.json  # again
    # data-parallel scaling of hpcgpu infer, one replica per GPU (1,2,4 on a 4-GPU host):
    python benchmarks/infer_throughput.py --scaling --gpus 1,2 [--scaling-rows N] [--engine slots|batches]
    # everything tiny on the CPU, to check the script end to end (its numbers measure nothing):
    python benchmarks/infer_throughput.py --smoke [--workload skewed] [--scaling]

What it measures. Once, into a work dir (a temporary one unless --work): a model dir with random
weights (GPT-2 or Llama shaped, --model, seeded; embeddings tied; bf16 but for tiny) and a byte-level
BPE tokenizer trained in memory on configs/data/pydocs.txt (scripts/make_tiny_model.py's; no hub),
both written with save_pretrained; and an input jsonl of --rows {"id", "prompt"} rows, windows of that
text of uniformly random length between --min-prompt and --max-prompt tokens (seeded), so that padding
matters. A variant given a scale k (--scale) reads k x --rows rows instead: the same first --rows rows
and more drawn alike (the same seeded stream goes on: the same length mix, no repeated prompt), so its
tokens/s stays comparable while its loop lasts long enough. Then, interleaved (the order rotates each
round), each variant in a fresh process on those rows, model, batch size, greedy, max_new_tokens:

    plain           benchmarks/plain_generate.py: batches in input order, left padding, model.generate
    plain sorted    the same with --sort: rows sorted by (prompt tokens, input position): the batches
                    hpcgpu's previous engine runs
    hf static       plain_generate.py --cache static: the plain loop's very batches through
                    generate(cache_implementation="static", max_cache_len = the longest prompt +
                    max_new_tokens): one cache shape, so transformers compiles the decode step once
                    (CUDA graphs); an untimed warmup generate on the first batch pays the compile
    hf continuous   benchmarks/hf_generate.py: transformers' continuous batching (generate_batch's own
                    steps, paged SDPA, its sizes from free memory; its warmup timed apart); skipped with
                    the reason (the background thread's exception) where it fails or this transformers
                    has none
    hpcgpu          `hpcgpu submit SPEC --executor local --new --gpus 1`, task: infer, infer.batch_size
                    fixed to the plain loop's (--batch-size), the spec's other infer settings at their
                    defaults (infer.engine: slots: a static KV cache of that many slots, a CUDA-graph
                    decode step, finished rows' slots refilled)
    hpcgpu auto     the same with --set infer.batch_size=auto: slots from the free memory, at most 512
                    and at most half the rows (two fills): give it rows (--scale) for 512 slots;
                    infer.attention at its default (auto: the varlen kernel on a GPU)
    hpcgpu auto varlen  the same with --set infer.attention=varlen (what auto takes today: kept to compare
                    another decode attention against it)
    hpcgpu auto again   hpcgpu auto once more, right after it in each round: with the compile cache the
                    first run left (every other hpcgpu variant starts with the runs folder's compile
                    cache emptied, hpcgpu.contract.compile_cache: torch.compile's
                    kernels, as a first run on a fresh machine); its start-up is the cached one
    hpcgpu batches  --set infer.engine=batches: the previous engine (length-sorted batches, generate)
    hpcgpu norefill --set infer.refill=false: new rows enter only when every slot is free (static batching)
    (not by default: "hpcgpu static" (--set infer.kv_cache=static), "plain sorted", "plain nocudnn" and
    "plain sorted nocudnn" (SDPA's cuDNN backend off), "hpcgpu old" (another commit's package,
    --old-checkout DIR holding `git archive REV hpcgpu | tar -x -C DIR`))
A variant whose --set the spec refuses (a key this checkout does not know yet), or whose run fails, is
reported as skipped with the reason; the others go on.

End to end (issue #46): each measurement's wall time from its process's spawn (the parent's
time.time() just before it) to its outputs written: plain_generate.py and hf_generate.py print
outputs_at (time.time() once the output file is closed, before the interpreter's exit); for hpcgpu the
mtime of the run dir's outputs.jsonl (the merged outputs, the job's last write of them; `hpcgpu
submit` returns a little later, after the job exits and the host reads its state: wall_s, in the
JSON). Printed beside the loop: end to end s, start-up s (end to end - loop: imports, model load,
compile/capture, the job's launch), tokens/s both ways and the ratios against plain both ways; the
issue's end-to-end target is for one 384-row job: give every variant scale 1 (--scale "") for that.

The time of a measurement is its generation loop alone, model loading and compile/capture excluded:
plain_generate.py's elapsed_s (between two torch.cuda.synchronize(); the dynamic-cache loop has no
capture, its cold first batch counts), hf_generate.py's elapsed_s (after the manager's warmup),
hpcgpu's "end" record in the run dir's metrics.jsonl (elapsed_s: the loop, its per-batch collectives,
writing and merging the outputs). The compile/capture time is shown apart: hpcgpu's "engine" record
(capture_s), hf static's warmup generate (compile + capture + a first short generate on batch 1), hf
continuous's manager start (cache allocation + its CUDA graph warmup). Prints, per variant, the median
and spread (min-max) of rows/s and generated tokens/s and the ratios of the medians of gen tokens/s
against the targets of issues #32 and #46 (their spread: the range of the per-round ratios): at batch
64, hpcgpu >= 4x plain and >= 1.0x the best transformers variant (hf static / hf continuous); hpcgpu
auto >= 20x plain in the loop, >= 10x plain end to end, and >= 25% of its bandwidth bound; on the
skewed workload, hpcgpu / hpcgpu norefill >= 1.5. Also,
for the greedy outputs, the share of rows with the same text and the mean common prefix, between
programs and (the noise floor) between two rounds of one program: with random weights the top logits
are close, and bf16 rounding flips tokens; reported, not asserted. Measurements shorter than
--min-seconds (20 s) are flagged; with --adapt (the default) the next round of that variant gets the
scale that would reach it (--scale-together: variants that always share one scale, so the same rows).

Rounds. --repeats N runs N interleaved rounds of every variant; --rounds-total N[,VARIANT=M] runs
rounds until each variant has N (M) measurements, counting those pooled from --append FILE (the k-th
measurement of each variant is round k, so a round cut short by --deadline is completed, in the same
round, by the next call); --deadline S starts no measurement that its estimate (that variant's last
start-up and loop, scaled; a guess before the first) would end past S seconds, and prints the report
of what it has. FILE is rewritten after every measurement: a call that is killed keeps what it measured.

The memory-bandwidth bound. A decode step must read every weight once (params x bytes per parameter;
tied embeddings count once) and, for every row still generating, its KV cache so far: (prompt tokens
+ tokens generated so far) x 2 (K, V) x layers x KV heads x head dim x 2 bytes (bf16). From each
measurement's outputs (every row's prompt_tokens and completion_tokens; a row generating c tokens takes
c steps, the first being its prefill's) and the variant's schedule, the bound is the generated tokens
over sum over its decode steps of (bytes of that step) / bandwidth, and the share of the bound is the
measured gen tokens/s over that. The KV part is the same for any schedule (sum over rows of
c x prompt + c(c+1)/2 token-reads); the schedule sets the number of steps, each reading the weights:
    batches         (plain, plain sorted, hf static, hpcgpu batches: --batch-size rows in input order,
                    or sorted by prompt length for the sorted and the batches engine): each batch takes
                    as many steps as its longest completion; only the rows still running are read
    S slots refilled (hpcgpu, hpcgpu auto: S = the "engine" record's slots; hf continuous: S = the
                    manager's max_requests_per_batch): rows in input order each take the first free
                    slot (list scheduling); steps = when the last slot empties
    S slots, no refill (hpcgpu norefill): groups of S rows in input order, each as long as its longest
Prefill compute, sampling, the host and the launch overheads are left out: it is a bound, not a model
of any of the programs. Bandwidth: --bandwidth-tbs, default from the GPU's name (H200 4.8 TB/s, H100
SXM 3.35, ...; n/a on the CPU or an unknown card).

--workload skewed: prompts 8..128 tokens, max_new_tokens 512, 512 rows, a third of the rows
(--stop-share) ending early on a stop string. With random weights a stop string has to be found: a
calibration pass (plain_generate.py, greedy, on the first --calib-rows rows, on the same device)
generates the completions, and the script picks a short string (2-6 characters) that appears before
token 512 in --stop-share of them (the closest share; among strings found in the same rows the one
found earliest, which leaves refill the most to win; where no single string comes within a row of
the share, a greedy union of up to 4), cached in the work dir (--stop STR instead: given ones). They
go to hpcgpu as infer.stop, to the plain and hf static loops as transformers' StopStringCriteria on
the completion, and to hf continuous (which takes no stop strings) as a cut of the finished texts.
The share measured in each run is printed (bf16 noise moves some rows). Refill can give at most the ratio of the decode steps
without refill to those with it (printed: "refill ceiling"): with a share s of the rows stopping at a
mean fraction f of max_new_tokens and the rest running to the end, about 1 / (1 - s (1 - f)): 1.5 at
s = 1/3 only when the stops come at once; --stop-share 0.4 raises it to ~1.6.

--scaling: hpcgpu infer (spec defaults, or --engine / --kv-cache) at each of --gpus (one replica per
GPU) on the same input of --scaling-rows rows (default: --rows x the widest count, rounded to whole
batches per replica), interleaved; efficiency(N) = rows/s(N) / (N x rows/s(1)), target >= 0.95. The
model is --model's (llama-400m by default; gpt2-350m for the earlier figures).

Writes the results as JSON to $OUT/infer_throughput.json (or --json PATH; --append FILE too, rewritten
after every measurement so that a call cut short keeps what it measured). Needs torch and transformers
(and their `tokenizers`), no yaml; hpcgpu runs as `python -m hpcgpu` from this checkout, its jobs in a
registry of the work dir. The parent process never touches CUDA (hpcgpu's busy-GPU check would see
it).
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import gpu_name, nvidia_smi_names, rotated, spread, work_dir
from hf_generate import stop_position  # the fewest leading tokens that hold a stop string, one definition

REPO = Path(__file__).resolve().parent.parent
PLAIN = REPO / "benchmarks" / "plain_generate.py"
HF_CB = REPO / "benchmarks" / "hf_generate.py"
CORPUS = REPO / "configs" / "data" / "pydocs.txt"
ORIG_ENV = dict(os.environ)  # the children's environment: before this process sets anything for itself
T_START = time.perf_counter()

# issue #32's targets, auto's raised by issue #46 (20x loop only, 10x end to end), and issue #14's (still
# printed for the GPT-2 comparison)
TARGET_PLAIN, TARGET_HF, TARGET_AUTO, TARGET_BOUND, TARGET_REFILL = 4.0, 1.0, 20.0, 0.25, 1.5
TARGET_AUTO_E2E = 10.0
TARGET_ISSUE14, TARGET_EFFICIENCY = 1.3, 0.95

# HBM bandwidth, TB/s, by a piece of the name nvidia-smi gives (the first match wins: specific first)
BANDWIDTH_TBS = [("GH200", 4.0), ("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35),
                 ("H800", 3.35), ("B200", 8.0), ("A100 80GB PCIe", 1.935), ("A100-SXM4-80GB", 2.039),
                 ("A100 80GB", 2.039), ("A100", 1.555), ("L40S", 0.864)]

# model shapes (random weights); the vocabulary is the BPE tokenizer's (8192; 512 for tiny)
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 512},
    "gpt2-124m": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024},
    "gpt2-350m": {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024},
    "llama-160m": {"model_type": "llama", "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                   "num_key_value_heads": 12, "intermediate_size": 2048, "max_position_embeddings": 2048},
    # issue #32's headline: 291.6M parameters with the 8192-token vocabulary (GQA: 8 KV heads of 64)
    "llama-400m": {"model_type": "llama", "num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "intermediate_size": 2816, "max_position_embeddings": 2048},
}

# --workload: the defaults of --rows, --min-prompt, --max-prompt, --max-new-tokens and --variants
WORKLOADS: dict[str, dict[str, Any]] = {
    # issue #32's headline (and #14's): 768 prompts of 8..510 tokens (median ~261), 128 new tokens
    "uniform": {"rows": 768, "min_prompt": 8, "max_prompt": 512, "max_new_tokens": 128,
                "variants": ["plain", "hf static", "hf continuous", "hpcgpu", "hpcgpu auto"]},
    # short prompts, long completions, a third of them ending early on a stop string: what refill is for
    "skewed": {"rows": 512, "min_prompt": 8, "max_prompt": 128, "max_new_tokens": 512,
               "variants": ["hpcgpu", "hpcgpu norefill"], "together": ["hpcgpu", "hpcgpu norefill"]},
}


@dataclass(frozen=True)
class Variant:
    program: str  # plain (plain_generate.py), hf (hf_generate.py) or hpcgpu
    sort: bool = False  # plain: batches sorted by prompt length
    no_cudnn: bool = False  # plain: SDPA without its cuDNN backend
    cache: str = "dynamic"  # plain: generate's KV cache
    sets: tuple[str, ...] = ()  # hpcgpu: --set KEY=VALUE
    old: bool = False  # hpcgpu: the package in --old-checkout
    after: str | None = None  # hpcgpu: runs right after that variant in each round, with the compile cache
    # it left (the others start with the runs folder's compile cache emptied: a first run on the machine)


VARIANTS: dict[str, Variant] = {
    "plain": Variant("plain"),
    "plain sorted": Variant("plain", sort=True),
    "hf static": Variant("plain", cache="static"),
    "hf continuous": Variant("hf"),
    "hpcgpu": Variant("hpcgpu"),
    "hpcgpu auto": Variant("hpcgpu", sets=("infer.batch_size=auto",)),
    "hpcgpu auto varlen": Variant("hpcgpu", sets=("infer.batch_size=auto", "infer.attention=varlen")),
    "hpcgpu auto again": Variant("hpcgpu", sets=("infer.batch_size=auto",), after="hpcgpu auto"),
    "hpcgpu batches": Variant("hpcgpu", sets=("infer.engine=batches",)),
    "hpcgpu norefill": Variant("hpcgpu", sets=("infer.refill=false",)),
    # not in a default set
    "hpcgpu static": Variant("hpcgpu", sets=("infer.kv_cache=static",)),
    "plain nocudnn": Variant("plain", no_cudnn=True),
    "plain sorted nocudnn": Variant("plain", sort=True, no_cudnn=True),
    "hpcgpu old": Variant("hpcgpu", old=True),
}
HF_VARIANTS = ("hf static", "hf continuous")
# a first guess of a process's time outside its loop (start, load, compile, capture), for --deadline
START_GUESS_S = {"plain": 15.0, "hf static": 75.0, "hf": 45.0, "hpcgpu": 45.0}


def note(msg: str) -> None:
    print(f"[infer_throughput] {msg}", file=sys.stderr, flush=True)


class VariantSkipped(Exception):
    pass


# ---------------------------------------------------------------- model, tokenizer, rows

def make_model(out: Path, preset: str, vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """A model dir of random weights and a trained-here BPE tokenizer (scripts/make_tiny_model.py's)."""
    if (out / "bench_model.json").exists():
        return json.loads((out / "bench_model.json").read_text())
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_model import train_tokenizer

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(CORPUS, vocab_size)
    shape = dict(MODELS[preset])
    model_type = shape.pop("model_type")
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  # tied, as GPT-2's: a random model's greedy text then settles into repeats
                                  # (on an H100 far more rows agreed between runs than with an untied head)
                                  tie_word_embeddings=True, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    if preset != "tiny":
        model = model.to(torch.bfloat16)  # half the bytes to write and read; each program picks its dtype
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    limit = getattr(config, "n_positions", None) or config.max_position_embeddings
    info = {"preset": preset, "model_type": model_type, "params": n_params, "vocab": len(tokenizer),
            "positions": limit, **kv_shape(preset)}
    (out / "bench_model.json").write_text(json.dumps(info))
    note(f"model dir {out}: {preset}, {n_params / 1e6:.1f}M params, vocab {len(tokenizer)}, "
         f"made in {time.perf_counter() - t0:.1f}s")
    return info


def kv_shape(preset: str) -> dict[str, int]:
    """Layers, KV heads and head dim of a preset: what one token's KV cache is made of."""
    m = MODELS[preset]
    if m["model_type"] == "gpt2":
        return {"layers": m["n_layer"], "kv_heads": m["n_head"], "head_dim": m["n_embd"] // m["n_head"]}
    return {"layers": m["num_hidden_layers"], "kv_heads": m["num_key_value_heads"],
            "head_dim": m["hidden_size"] // m["num_attention_heads"]}


_CORPUS_IDS: dict[str, list[int]] = {}


def make_rows(model_dir: Path, path: Path, n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """n {"id", "prompt"} rows: windows of the corpus, lo..hi tokens long (uniform, seeded); returns
    each prompt's token length as the tokenizer reads the text back. The rows of n are the first rows
    of any larger n (one seeded stream). Kept beside the file (PATH.lengths.json) and reused."""
    side = path.with_suffix(".lengths.json")
    if path.exists() and side.exists():
        return json.loads(side.read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    key = str(model_dir)
    if key not in _CORPUS_IDS:
        _CORPUS_IDS[key] = tok(CORPUS.read_text(encoding="utf-8"))["input_ids"]
    ids = _CORPUS_IDS[key]
    if hi + 8 >= len(ids):
        raise SystemExit(f"--max-prompt {hi}: the corpus has only {len(ids)} tokens")
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        texts.append(tok.decode(ids[start: start + length]))
    lengths = [len(x) for x in tok(texts)["input_ids"]]
    for k, (text, length) in enumerate(zip(texts, lengths)):
        while length > hi:  # a window can re-tokenize a little longer: trim it back under the bound
            text = text[: int(len(text) * hi / length) - 1]
            length = len(tok(text)["input_ids"])
        texts[k], lengths[k] = text, length
    with path.open("w", encoding="utf-8") as fh:
        for k, text in enumerate(texts):
            fh.write(json.dumps({"id": f"r{k:05d}", "prompt": text}) + "\n")
    side.write_text(json.dumps(lengths))
    return lengths


def rows_file(args: argparse.Namespace, work: Path, model_dir: Path, n: int) -> tuple[Path, list[int]]:
    path = work / f"rows-{model_dir.name}-p{args.min_prompt}-{args.max_prompt}-s{args.seed}-n{n}.jsonl"
    return path, make_rows(model_dir, path, n, args.min_prompt, args.max_prompt, args.seed)


# ---------------------------------------------------------------- the programs

def child_env(args: argparse.Namespace, work: Path) -> dict[str, str]:
    env = dict(ORIG_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["HPCGPU_REGISTRY"] = str(work / "jobs.db")  # the benchmark's jobs stay out of the user's registry
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.cpu:
        env.setdefault("DS_ACCELERATOR", "cpu")  # transformers may import deepspeed, which would warn
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks and a CPU plain loop
    for item in args.child_env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def run_child(args: argparse.Namespace, work: Path, cmd: list[str], log: Path, cwd: Path = REPO,
              env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float, float]:
    """Runs a measured program, its stdout and stderr kept in LOG; returns it, its wall time and the
    wall clock (time.time()) just before it was spawned: where its end-to-end time starts."""
    spawned = time.time()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env or child_env(args, work))
    wall = time.perf_counter() - t0
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ {' '.join(cmd)}\n# exit {proc.returncode}, {wall:.1f} s\n--- stdout\n{proc.stdout}\n"
                   f"--- stderr\n{proc.stderr}")
    return proc, wall, spawned


def child_e2e(res: dict[str, Any], spawned: float, wall: float) -> float:
    """plain/hf: from the spawn of the process to its outputs written (the "outputs_at" it prints: the
    wall clock after the output file closed); a program that does not say: its whole process."""
    return res["outputs_at"] - spawned if res.get("outputs_at") else wall


def failed(what: str, proc: subprocess.CompletedProcess, log: Path) -> VariantSkipped:
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "?")
    return VariantSkipped(f"{what} failed (exit {proc.returncode}): {last[:300]} (log: {log})")


def json_line(stdout: str) -> dict[str, Any]:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])


def run_plain(args: argparse.Namespace, work: Path, model_dir: Path, data: Path, v: Variant, log: Path,
              stops: list[str]) -> dict[str, Any]:
    out = work / f"out-{log.stem}.jsonl"
    cmd = [sys.executable, str(PLAIN), "--model", str(model_dir), "--input", str(data), "--output", str(out),
           "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens),
           "--device", "cpu" if args.cpu else "cuda", "--cache", v.cache] + (["--sort"] if v.sort else []) \
        + (["--no-cudnn-attention"] if v.no_cudnn else []) + [x for s in stops for x in ("--stop", s)]
    proc, wall, spawned = run_child(args, work, cmd, log)
    if proc.returncode != 0:
        raise failed("the plain loop" if v.cache == "dynamic" else "the static-cache loop", proc, log)
    res = json_line(proc.stdout)
    res.update(wall_s=wall, e2e_s=child_e2e(res, spawned, wall), capture_s=res.get("warmup_s"),
               outputs=read_outputs(out))
    res["schedule"] = {"kind": "batches", "slots": args.batch_size, "order": "sorted" if v.sort else "input"}
    return res


def run_hf(args: argparse.Namespace, work: Path, model_dir: Path, data: Path, log: Path,
           stops: list[str]) -> dict[str, Any]:
    out = work / f"out-{log.stem}.jsonl"
    cmd = [sys.executable, str(HF_CB), "--model", str(model_dir), "--input", str(data), "--output", str(out),
           "--max-new-tokens", str(args.max_new_tokens), "--device", "cpu" if args.cpu else "cuda"] \
        + [x for s in stops for x in ("--stop", s)]
    proc, wall, spawned = run_child(args, work, cmd, log)
    if proc.returncode in (3, 4):  # 3: none in this transformers; 4: it failed, its last line says why
        raise VariantSkipped(f"{(proc.stderr.strip().splitlines() or ['no continuous batching'])[-1][:400]} "
                             f"(log: {log})")
    if proc.returncode != 0:
        raise failed("transformers' continuous batching", proc, log)
    res = json_line(proc.stdout)
    res.update(wall_s=wall, e2e_s=child_e2e(res, spawned, wall), capture_s=res.get("warmup_s"),
               outputs=read_outputs(out))
    res["schedule"] = {"kind": "slots", "slots": res.get("slots"), "order": "input"}
    return res


def hpcgpu_spec(args: argparse.Namespace, work: Path, model_dir: Path, data: Path, stops: list[str]) -> Path:
    infer: dict[str, Any] = {"input": str(data), "mode": "generate", "max_new_tokens": args.max_new_tokens,
                             "temperature": 0.0, "batch_size": args.batch_size}
    if stops:
        infer["stop"] = list(stops)
    spec = {
        "name": "infer-bench", "task": "infer", "runs_dir": str(work / "runs"),
        "resources": {"gpus": 1, "cpus_per_gpu": 1 if args.cpu else 4},
        "model": {"name_or_path": str(model_dir)},
        "infer": infer,
    }
    path = work / f"{data.stem}.spec.yaml"
    path.write_text(json.dumps(spec, indent=1) + "\n")  # JSON is YAML: no yaml module needed here
    return path


def hpcgpu_cmd(spec: Path, gpus: int, sets: tuple[str, ...]) -> list[str]:
    cmd = [sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new", "--gpus", str(gpus)]
    for item in sets:
        cmd += ["--set", item]
    return cmd


def sets_rejected(args: argparse.Namespace, work: Path, spec: Path, sets: tuple[str, ...]) -> str | None:
    """None when the spec takes these --set overrides; else the validator's one line."""
    if not sets:
        return None
    cmd = [sys.executable, "-m", "hpcgpu", "validate", str(spec)]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env(args, work))
    if proc.returncode == 0:
        return None
    keys = [s.partition("=")[0].rpartition(".")[2] for s in sets]
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    line = next((ln for ln in lines if any(k in ln for k in keys)), lines[-1] if lines else f"exit {proc.returncode}")
    return line.removeprefix("hpcgpu: error: ")


def run_hpcgpu(args: argparse.Namespace, work: Path, spec: Path, gpus: int, sets: tuple[str, ...], log: Path,
               checkout: str | None = None) -> dict[str, Any]:
    cmd = hpcgpu_cmd(spec, gpus, sets)
    env, cwd = child_env(args, work), REPO
    if checkout is not None:  # that checkout's hpcgpu: first on the path, and the cwd `-m` looks in first
        env["PYTHONPATH"] = os.pathsep.join([checkout, env["PYTHONPATH"]])
        cwd = Path(checkout)
    proc, wall, spawned = run_child(args, work, cmd, log, cwd=cwd, env=env)
    if proc.returncode != 0:
        raise failed(f"`hpcgpu submit {' '.join(cmd[4:])}`", proc, log)
    found = re.findall(r"run dir (\S+)", proc.stderr)
    if found:
        run_dir = Path(found[-1].rstrip(",;"))
    else:  # the newest run dir of the spec
        run_dir = max((work / "runs" / "infer-bench").iterdir(), key=lambda p: p.stat().st_mtime)
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    end = [r for r in recs if r.get("kind") == "end"]
    if not end:
        raise VariantSkipped(f"hpcgpu run {run_dir}: no \"end\" record in metrics.jsonl")
    end = end[-1]
    engine_recs = [r for r in recs if r.get("kind") == "engine"]
    engine = {k: v for k, v in engine_recs[-1].items() if k not in ("kind", "time", "t", "step")} \
        if engine_recs else {"engine": "batches", "why": "no \"engine\" record (a package before the slots engine)"}
    refill = "infer.refill=false" not in sets
    fixed = None if "infer.batch_size=auto" in sets else args.batch_size
    slots = engine.get("slots") or fixed
    if engine.get("engine") == "slots":
        schedule = {"kind": "slots" if refill else "groups", "slots": slots, "order": "input"}
    else:  # the batches engine: length-sorted batches of batch_size (auto: unknown without the record)
        schedule = {"kind": "batches", "slots": slots, "order": "sorted"}
    outputs = run_dir / "outputs.jsonl"
    return {"rows": end["rows"], "tokens": end["tokens"], "elapsed_s": end["elapsed_s"],
            "rows_per_s": end["rows"] / end["elapsed_s"], "tokens_per_s": end["tokens"] / end["elapsed_s"],
            # end to end: the submit's spawn to the last write of outputs.jsonl (the job's merged outputs;
            # the submit itself returns a little later, after the job's exit: wall_s)
            "wall_s": wall, "e2e_s": outputs.stat().st_mtime - spawned,
            "run_dir": str(run_dir), "outputs": read_outputs(outputs),
            "engine": engine, "capture_s": engine.get("capture_s"), "schedule": schedule,
            **{k: v for k, v in end.items() if k.startswith("replica_")}}


def read_outputs(path: Path) -> dict[int, dict[str, Any]]:
    """index -> {"text", "prompt_tokens", "completion_tokens"} of an outputs jsonl."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            out[int(r["index"])] = {"text": r["text"], "p": r.get("prompt_tokens"), "c": r.get("completion_tokens")}
    return out


# ---------------------------------------------------------------- the bandwidth bound

def bandwidth_tbs(args: argparse.Namespace) -> tuple[float | None, str]:
    if args.bandwidth_tbs:
        return args.bandwidth_tbs, "--bandwidth-tbs"
    if args.cpu:
        return None, "CPU"
    names = nvidia_smi_names() or []
    for key, tbs in BANDWIDTH_TBS:
        if names and key in names[0]:
            return tbs, f"{names[0]} ({key})"
    return None, f"unknown card {names[0] if names else '?'}: give --bandwidth-tbs"


def decode_steps(comps: list[int], slots: int, kind: str) -> int:
    """Decode steps of a schedule: `batches`/`groups` of `slots` rows in the order given, each as long as
    its longest completion; `slots` refilled: each row takes the first free slot (list scheduling)."""
    if kind == "slots":
        free = [0] * max(1, min(slots, len(comps)))
        for c in comps:
            heapq.heappush(free, heapq.heappop(free) + c)
        return max(free)
    return sum(max(comps[i: i + slots], default=0) for i in range(0, len(comps), slots))


def bound(info: dict[str, Any], rows: list[tuple[int, int]], schedule: dict[str, Any], tbs: float | None,
          dtype_bytes: int) -> dict[str, Any] | None:
    """The memory-bandwidth bound of one measurement: rows = (prompt tokens, completion tokens) by input
    index; see the module doc."""
    slots = schedule.get("slots")
    if tbs is None or not slots or not rows:
        return None
    order = list(range(len(rows)))
    if schedule.get("order") == "sorted":
        order.sort(key=lambda i: (rows[i][0], i))
    comps = [rows[i][1] for i in order]
    steps = decode_steps(comps, int(slots), schedule["kind"])
    kv_token = 2 * info["layers"] * info["kv_heads"] * info["head_dim"] * dtype_bytes
    kv_reads = sum(c * p + c * (c + 1) // 2 for p, c in rows)  # token-contexts read, whatever the schedule
    weights = info["params"] * dtype_bytes
    seconds = (steps * weights + kv_reads * kv_token) / (tbs * 1e12)
    tokens = sum(c for _, c in rows)
    return {"steps": steps, "slots": int(slots), "kind": schedule["kind"], "order": schedule.get("order"),
            "weights_gb_per_step": weights / 1e9, "kv_gb_per_step": kv_reads * kv_token / max(1, steps) / 1e9,
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None}


def schedule_label(b: dict[str, Any]) -> str:
    order = "sorted" if b.get("order") == "sorted" else "input order"
    return {"batches": f"batches of {b['slots']}, {order}", "slots": f"{b['slots']} slots refilled",
            "groups": f"{b['slots']} slots, no refill"}[b["kind"]]


# ---------------------------------------------------------------- the stop string of the skewed workload

def calibrate_stop(args: argparse.Namespace, work: Path, model_dir: Path, data: Path) -> dict[str, Any]:
    """A short string whose first appearance falls within max_new_tokens in about --stop-share of the
    rows: greedy completions of the first --calib-rows rows (plain_generate.py, on the same device)."""
    digest = hashlib.sha256(data.read_bytes()).hexdigest()[:12]
    cache = work / f"stop-{model_dir.name}-{digest}-m{args.max_new_tokens}-c{args.calib_rows}-s{args.stop_share:.3f}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    rows = data.read_text(encoding="utf-8").splitlines()[: args.calib_rows]
    sample = work / f"calib-{digest}.jsonl"
    sample.write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = work / f"calib-{digest}-out.jsonl"
    cmd = [sys.executable, str(PLAIN), "--model", str(model_dir), "--input", str(sample), "--output", str(out),
           "--batch-size", str(min(len(rows), max(args.batch_size, 64))), "--max-new-tokens",
           str(args.max_new_tokens), "--device", "cpu" if args.cpu else "cuda", "--save-tokens"]
    proc, wall, _ = run_child(args, work, cmd, work / "logs" / "calibration.log")
    if proc.returncode != 0:
        raise SystemExit(f"the calibration pass failed ({work / 'logs' / 'calibration.log'}):\n{proc.stderr[-2000:]}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    toks = [json.loads(ln)["tokens"] for ln in out.read_text(encoding="utf-8").splitlines() if ln.strip()]
    choice = choose_stop(toks, lambda ids: tok.decode(ids, skip_special_tokens=True), args.stop_share,
                         args.max_new_tokens)
    choice.update(calibration_s=wall, sample=len(toks))
    cache.write_text(json.dumps(choice))
    return choice


def choose_stop(toks: list[list[int]], decode, share: float, max_new: int, most: int = 4) -> dict[str, Any]:
    """Stop strings (2-6 characters of the completions; no replacement character, newline or only
    blanks) found in the share of the rows closest to `share`: one string where one comes within a row
    of it, else a greedy union of up to `most`. Among the strings found in the same rows, the one whose
    appearances come earliest (the most a row can save)."""
    texts = [decode(t) for t in toks]
    n = max(1, len(texts))
    rows_of: dict[str, set[int]] = {}
    for r, text in enumerate(texts):
        for k in range(2, 7):
            for i in range(0, len(text) - k + 1):
                sub = text[i: i + k]
                if sub.strip() and "\ufffd" not in sub and "\n" not in sub:
                    rows_of.setdefault(sub, set()).add(r)
    if not rows_of:
        return {"stops": [], "why": "no completion text to pick a stop string from"}
    groups: dict[frozenset[int], list[str]] = {}
    for sub, rs in rows_of.items():
        groups.setdefault(frozenset(rs), []).append(sub)

    def earliest(rs: frozenset[int]) -> tuple[float, str]:
        """The string of a group of rows found earliest in them (mean character offset of its end)."""
        def where(x: str) -> float:  # mean over the rows of the share of the text before its end
            return sum((texts[r].find(x) + len(x)) / len(texts[r]) for r in rs) / len(rs)

        best = min(groups[rs], key=lambda x: (where(x), -len(x), x))
        return where(best), best

    chosen: list[str] = []
    covered: set[int] = set()
    for _ in range(most):
        gap_now = abs(len(covered) / n - share)
        if gap_now <= 0.5 / n:
            break
        gaps = {rs: abs(len(covered | rs) / n - share) for rs in groups if not rs <= covered}
        if not gaps:
            break
        g = min(gaps.values())
        if g >= gap_now - 1e-9:
            break
        near = sorted((rs for rs, x in gaps.items() if x <= g + 1e-9), key=len, reverse=True)[:50]
        _, pick = min(earliest(rs) for rs in near)
        chosen.append(pick)
        covered |= rows_of[pick]
        if g <= 1.0 / n:  # within a row of the share: one string more would not do better
            break
    firsts = [stop_position(t, chosen, decode) for t in toks]
    hit = [f for f in firsts if f is not None]
    s_share = len(hit) / n
    mean_frac = sum(hit) / len(hit) / max_new if hit else 1.0
    short = sum(1 for t, f in zip(toks, firsts) if f is not None or len(t) < max_new) / n
    return {"stops": chosen, "share": s_share, "mean_stop_fraction": mean_frac, "eos_or_short_share": short,
            "ceiling_estimate": 1.0 / (1.0 - s_share * (1.0 - mean_frac)) if s_share < 1 else None}


# ---------------------------------------------------------------- statistics

def fmt_spread(values: list[float], digits: int = 1) -> str:
    med, lo, hi = spread(values)
    return f"{med:,.{digits}f} [{lo:,.{digits}f}-{hi:,.{digits}f}]"


def ratio(results: dict[str, list[dict[str, Any]]], num: str, den: str, scale: float = 1.0,
          key: str = "tokens_per_s") -> dict[str, Any] | None:
    """Ratio of the medians of `key` (the denominator times `scale`), and the range of the per-round
    ratios (the two measurements of the same round)."""
    # a measurement that generated nothing (a broken run) is no denominator; one pooled from before a
    # key existed (the end-to-end figures) counts for neither side
    a, b = [x for x in results.get(num) or [] if key in x], [y for y in results.get(den) or [] if y.get(key)]
    if not a or not b:
        return None
    by_round = {y["round"]: y for y in b}
    paired = [x[key] / (scale * by_round[x["round"]][key]) for x in a if x["round"] in by_round]
    med = statistics.median(x[key] for x in a) / (scale * statistics.median(y[key] for y in b))
    return {"ratio": med, "min": min(paired, default=med), "max": max(paired, default=med), "rounds": paired}


def agreement(a: dict[int, str], b: dict[int, str]) -> dict[str, float]:
    """Share of rows with the same text, and the mean share of each text (the longer of the two)
    before the first difference: a flipped token late in a row costs little, a wrong prompt all."""
    keys = sorted(set(a) & set(b))
    prefix = []
    for k in keys:
        x, y = a[k], b[k]
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(1.0 if x == y else n / max(len(x), len(y)))
    return {"equal": sum(a[k] == b[k] for k in keys) / max(1, len(keys)),
            "prefix": sum(prefix) / max(1, len(prefix)), "rows": len(keys)}


def scale_for(args: argparse.Namespace, k: int, elapsed: float) -> int:
    """The scale that would make a loop of `elapsed` s at scale k last --min-seconds (with 10% to spare)."""
    if args.min_seconds <= 0 or elapsed >= args.min_seconds:
        return k
    return min(args.max_scale, max(k + 1, math.ceil(k * args.min_seconds * 1.1 / max(elapsed, 1e-3))))


def short_measurements(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> list[str]:
    if args.min_seconds <= 0:
        return []
    lines = []
    for name, runs in results.items():
        short = [r for r in runs if r["elapsed_s"] < args.min_seconds]
        if short:
            worst = min(short, key=lambda r: r["elapsed_s"])
            k = worst.get("scale", 1)
            lines.append(f"WARNING: {name}: {len(short)} of {len(runs)} measurements under {args.min_seconds:g} s "
                         f"(shortest {worst['elapsed_s']:.1f} s at scale {k}); --scale \"{name}="
                         f"{scale_for(args, k, worst['elapsed_s'])}\" would reach it")
    return lines


# ---------------------------------------------------------------- the two modes

def verdict_word(args: argparse.Namespace, ok: bool) -> str:
    return "n/a (smoke)" if args.smoke else "PASS" if ok else "FAIL"


def earlier_rounds(args: argparse.Namespace, setup: dict[str, Any]) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """--append: the measurements an earlier run of the same setup left in that file, and its rounds."""
    if args.append is None or not args.append.exists():
        return {}, 0
    old = json.loads(args.append.read_text())
    if old.get("setup") != setup:
        was = old.get("setup") or {}
        diff = sorted(k for k in set(setup) | set(was) if setup.get(k) != was.get(k))
        raise SystemExit(f"--append {args.append}: an earlier run of another setup (differs in: {', '.join(diff)}); "
                         "give another file")
    return old["results"], int(old["rounds"])


def run_setup(args: argparse.Namespace, mode: str, data: Path, rows: int, gpu: str,
              stops: list[str] | None = None) -> dict[str, Any]:
    """What must be the same for measurements to be pooled (--append): the input file's bytes too."""
    keys = ("model", "vocab_size", "batch_size", "max_new_tokens", "min_prompt", "max_prompt", "seed", "child_env",
            "kv_cache", "workload", "engine")
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    return {"mode": mode, "rows": rows, "input_sha256": digest, "gpu": gpu, "stops": stops or [],
            **{k: getattr(args, k) for k in keys}}


def parse_scale(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, k = item.rpartition("=")
        if not eq or name.strip() not in VARIANTS or not k.strip().isdigit() or int(k) < 1:
            raise SystemExit(f"--scale: {item!r} is not VARIANT=K (K >= 1, a variant of: {', '.join(VARIANTS)})")
        out[name.strip()] = int(k)
    return out


def parse_rounds(text: str | None, names: list[str]) -> dict[str, int] | None:
    """--rounds-total "3,hf continuous=1": measurements each variant should have, pooled ones counted."""
    if text is None:
        return None
    out: dict[str, int] = {}
    default = None
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, k = item.rpartition("=")
        if not k.strip().isdigit():
            raise SystemExit(f"--rounds-total: {item!r} is neither N nor VARIANT=N")
        if eq:
            out[name.strip()] = int(k)
        else:
            default = int(k)
    return {n: out.get(n, default if default is not None else 3) for n in names}


def save_pool(args: argparse.Namespace, setup: dict[str, Any], results: dict[str, list[dict[str, Any]]],
              rounds: int, extra: dict[str, Any] | None = None) -> None:
    """--append FILE holds the measurements so far, rewritten after each: a call cut short keeps them."""
    if args.append is None:
        return
    body = {"mode": setup["mode"], "setup": setup, "rounds": rounds, "results": results, **(extra or {})}
    args.append.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.append.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(args.append)


def throughput(args: argparse.Namespace, work: Path, model_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    base, lengths = rows_file(args, work, model_dir, args.rows)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r} (known: {', '.join(VARIANTS)})")
    notes: list[str] = []
    stops, calib = list(args.stop), None
    if args.workload == "skewed" and not stops:
        calib = calibrate_stop(args, work, model_dir, base)
        stops = calib.get("stops") or []
        if not stops:
            raise SystemExit(f"the calibration found no stop string: {calib.get('why')}")
        note(f"stop strings {stops!r}: in {calib['share'] * 100:.0f}% of {calib['sample']} calibration rows, first at "
             f"{calib['mean_stop_fraction'] * 100:.0f}% of max_new_tokens on average ({calib['calibration_s']:.0f} s)")
    base_spec = hpcgpu_spec(args, work, model_dir, base, stops)
    for name in list(names):
        v = VARIANTS[name]
        if v.program == "hpcgpu" and not v.old:
            why = sets_rejected(args, work, base_spec, v.sets)
            if why is not None:
                notes.append(f"{name} skipped: the spec refuses {' '.join(v.sets)} ({why})")
                note(notes[-1])
                names.remove(name)
    gpu = gpu_name(args)
    setup = run_setup(args, "throughput", base, args.rows, gpu, stops)
    earlier, done = earlier_rounds(args, setup)
    results: dict[str, list[dict[str, Any]]] = {n: list(r) for n, r in earlier.items()}
    for n in names:
        results.setdefault(n, [])
    texts: dict[str, list[dict[int, str]]] = {}  # the outputs of this call's first two measurements
    extra: dict[str, dict[str, Any]] = {}
    tbs, tbs_from = bandwidth_tbs(args)
    dtype_bytes = 4 if args.cpu else 2
    scale = {n: args.scale_map.get(n, 1) for n in names}
    for n in names:  # the pooled rounds say what the scale must be
        if results[n]:
            last = results[n][-1]
            scale[n] = max(scale[n], scale_for(args, last.get("scale", 1), last["elapsed_s"]) if args.adapt
                           else last.get("scale", 1))
    together = [n for n in names if n in args.together]
    if together:
        scale.update({n: max(scale[n] for n in together) for n in together})
    want = parse_rounds(args.rounds_total, names)
    skipped: set[str] = set()
    rnd, stopped = done, False
    est: dict[str, tuple[float, float, int]] = {}  # name -> (start-up s, loop s, scale) of its last run
    for n in names:
        if results[n]:
            r = results[n][-1]
            est[n] = (max(0.0, r.get("wall_s", 0.0) - r["elapsed_s"]), r["elapsed_s"], r.get("scale", 1))
    while not stopped:
        if want is not None:  # the variants with the fewest measurements take their next: round = count + 1
            todo = [n for n in names if n not in skipped and len(results[n]) < want[n]]
            if not todo:
                break
            rnd = min(len(results[n]) for n in todo)
            todo = [n for n in todo if len(results[n]) == rnd]
        else:
            if rnd >= done + args.repeats:
                break
            todo = [n for n in names if n not in skipped]
        for name in in_order(rotated(todo, rnd)):
            v = VARIANTS[name]
            k = scale[name]
            if args.deadline:
                guess = START_GUESS_S.get(name, START_GUESS_S[v.program])
                start, loop, k0 = est.get(name, (guess, args.min_seconds or 20.0, k))
                need = start + loop * k / max(1, k0) + 5
                left = args.deadline - (time.perf_counter() - T_START)
                if need > left:
                    notes.append(f"--deadline: stopped before {name} in round {rnd + 1} (needs ~{need:.0f} s, "
                                 f"{left:.0f} s left); the next call with --append goes on from there")
                    note(notes[-1])
                    stopped = True
                    break
            data, lens = (base, lengths) if k == 1 else rows_file(args, work, model_dir, args.rows * k)
            log = work / "logs" / f"{name.replace(' ', '-')}-r{rnd + 1}.log"
            try:
                if v.program == "plain":
                    res = run_plain(args, work, model_dir, data, v, log, stops)
                elif v.program == "hf":
                    res = run_hf(args, work, model_dir, data, log, stops)
                else:
                    spec = hpcgpu_spec(args, work, model_dir, data, stops)
                    if v.after is None:
                        empty_compile_cache(work)
                    res = run_hpcgpu(args, work, spec, 1, v.sets, log, checkout=args.old_checkout if v.old else None)
            except VariantSkipped as exc:
                notes.append(f"{name} skipped from round {rnd + 1} on: {exc}")
                note(notes[-1])
                skipped.add(name)
                continue
            outs = res.pop("outputs")
            per_row = [(o["p"] if o["p"] is not None else lens[i], o["c"] if o["c"] is not None else 0)
                       for i, o in sorted(outs.items())]
            b = bound(info, per_row, res["schedule"], tbs, dtype_bytes)
            if b is not None and not b["tokens_per_s"]:
                b = None
            if b is not None:
                b["share"] = res["tokens_per_s"] / b["tokens_per_s"]
            res.update(bound=b, scale=k, round=rnd + 1, e2e_tokens_per_s=res["tokens"] / res["e2e_s"],
                       startup_s=res["e2e_s"] - res["elapsed_s"],
                       early_share=sum(1 for _, c in per_row if c < args.max_new_tokens) / max(1, len(per_row)))
            if len(texts.setdefault(name, [])) < 2:
                texts[name].append({i: o["text"] for i, o in outs.items()})
            extra.setdefault(name, {kk: res[kk] for kk in ("padded_prompt_tokens", "prompt_tokens", "device", "dtype")
                                    if kk in res})
            results[name].append(res)
            est[name] = (max(0.0, res["wall_s"] - res["elapsed_s"]), res["elapsed_s"], k)
            if args.adapt:
                scale[name] = scale_for(args, k, res["elapsed_s"])
                if name in args.together:  # these read the very same rows: the largest scale any of them needs
                    top = max(scale[n] for n in names if n in args.together)
                    scale.update({n: top for n in names if n in args.together})
            save_pool(args, setup, results, max([done] + [r["round"] for runs in results.values() for r in runs]),
                      {"calibration": calib})
            eng = res.get("engine") or {}
            note(f"round {rnd + 1} {name:<16}: {res['rows']} rows, {res['tokens']:,} tokens in {res['elapsed_s']:.2f} s "
                 f"({res['tokens_per_s']:,.0f} tok/s"
                 + (f", {b['share'] * 100:.1f}% of the bound" if b else "")
                 + (f"; capture {res['capture_s']:.1f} s" if res.get("capture_s") is not None else "")
                 + (f"; engine {eng.get('engine')} {eng.get('slots')} slots" if eng else "")
                 + f"; end to end {res['e2e_s']:.1f} s, {res['e2e_tokens_per_s']:,.0f} tok/s)")
        rnd += 1
    results = {n: r for n, r in results.items() if r}
    rounds = max([done] + [r["round"] for runs in results.values() for r in runs])
    report = throughput_report(args, info, results, texts, extra, notes, setup, rounds, lengths, calib,
                               stops, (tbs, tbs_from))
    print_throughput(args, report)
    save_pool(args, setup, results, rounds, {"calibration": calib})
    return report


def in_order(names: list[str]) -> list[str]:
    """A round's order with each variant that runs `after` another moved right behind it."""
    out = [n for n in names if VARIANTS[n].after not in names]
    for n in names:
        if VARIANTS[n].after in names:
            out.insert(out.index(VARIANTS[n].after) + 1, n)
    return out


def empty_compile_cache(work: Path) -> None:
    """Removes the compile cache hpcgpu's runs of this benchmark share (torch.compile's
    kernels, under the spec's runs_dir): the next run starts as the first on a fresh machine."""
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    try:
        from hpcgpu.contract import compile_cache
    except ImportError:  # a checkout without one: nothing to empty
        return
    shutil.rmtree(compile_cache(work / "runs"), ignore_errors=True)


def best_hf(results: dict[str, list[dict[str, Any]]]) -> str | None:
    have = [n for n in HF_VARIANTS if results.get(n)]
    return max(have, key=lambda n: statistics.median(r["tokens_per_s"] for r in results[n])) if have else None


def throughput_report(args, info, results, texts, extra, notes, setup, rounds, lengths, calib, stops,
                      tbs: tuple[float | None, str]) -> dict[str, Any]:
    pairs = {
        "hpcgpu/plain": ("hpcgpu", "plain"), "hpcgpu auto/plain": ("hpcgpu auto", "plain"),
        "hpcgpu/hf static": ("hpcgpu", "hf static"), "hpcgpu/hf continuous": ("hpcgpu", "hf continuous"),
        "hpcgpu auto/hpcgpu": ("hpcgpu auto", "hpcgpu"), "hpcgpu/hpcgpu norefill": ("hpcgpu", "hpcgpu norefill"),
        "hpcgpu/hpcgpu batches": ("hpcgpu", "hpcgpu batches"), "hf static/plain": ("hf static", "plain"),
        "hf continuous/plain": ("hf continuous", "plain"), "hpcgpu batches/plain": ("hpcgpu batches", "plain"),
        "plain sorted/plain": ("plain sorted", "plain"), "hpcgpu/plain sorted": ("hpcgpu", "plain sorted"),
        "hpcgpu static/hpcgpu": ("hpcgpu static", "hpcgpu"), "hpcgpu old/hpcgpu": ("hpcgpu old", "hpcgpu"),
        "plain sorted nocudnn/plain nocudnn": ("plain sorted nocudnn", "plain nocudnn"),
        "plain nocudnn/plain": ("plain nocudnn", "plain"),
    }
    ratios = {k: r for k, (a, b) in pairs.items() if (r := ratio(results, a, b)) is not None}
    for name in results:  # every variant against the plain loop, loop only and end to end
        for key, prefix in (("tokens_per_s", ""), ("e2e_tokens_per_s", "e2e ")):
            if name != "plain" and (r := ratio(results, name, "plain", key=key)) is not None:
                ratios[f"{prefix}{name}/plain"] = r
    for key, prefix in (("tokens_per_s", ""), ("e2e_tokens_per_s", "e2e ")):  # auto's decode attention against varlen's
        if (r := ratio(results, "hpcgpu auto", "hpcgpu auto varlen", key=key)) is not None:
            ratios[f"{prefix}hpcgpu auto/hpcgpu auto varlen"] = r
    hf = best_hf(results)
    if hf is not None and results.get("hpcgpu"):
        ratios["hpcgpu/best hf"] = {**ratio(results, "hpcgpu", hf), "vs": hf}
    agree = {}
    for a, b in (("hpcgpu", "plain"), ("hpcgpu", "hf static"), ("hf static", "plain"), ("hf continuous", "plain"),
                 ("hpcgpu auto", "hpcgpu"), ("hpcgpu auto", "hpcgpu auto varlen"), ("hpcgpu auto again", "hpcgpu auto"),
                 ("hpcgpu batches", "hpcgpu"), ("hpcgpu norefill", "hpcgpu"),
                 ("hpcgpu", "plain sorted"), ("hpcgpu static", "hpcgpu"), ("hpcgpu old", "hpcgpu")):
        if texts.get(a) and texts.get(b):
            agree[f"{a} vs {b}"] = agreement(texts[a][0], texts[b][0])
    for name, outs in texts.items():  # the noise floor: the same program twice
        if len(outs) == 2:
            agree[f"{name} round 1 vs 2"] = agreement(outs[0], outs[1])
    device = next((e.get("device") for e in extra.values() if e.get("device")), "?")
    dtype = next((e.get("dtype") for e in extra.values() if e.get("dtype")),
                 "float32" if args.cpu else "bfloat16")  # what model.dtype auto loads
    return {"mode": "throughput", "workload": args.workload, "gpu": setup["gpu"], "device": device, "dtype": dtype,
            "model": info, "rows": args.rows, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
            "prompt_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
            "stops": stops, "calibration": calib, "bandwidth_tbs": tbs[0], "bandwidth_from": tbs[1],
            "rounds": rounds, "results": results, "ratios": ratios, "agreement": agree, "notes": notes,
            "child_env": args.child_env, "setup": setup,
            "padding": {n: e["padded_prompt_tokens"] / e["prompt_tokens"] - 1 for n, e in extra.items()
                        if e.get("prompt_tokens") and e.get("padded_prompt_tokens")}}


def print_throughput(args: argparse.Namespace, rep: dict[str, Any]) -> None:
    m, p = rep["model"], rep["prompt_tokens"]
    print(f"# infer throughput, {rep['workload']} workload: {m['preset']} ({m['params'] / 1e6:.1f}M params, vocab "
          f"{m['vocab']}, random weights), {rep['rows']} rows (x the variant's scale), prompts {p['min']}..{p['max']} "
          f"tokens (median {p['median']:g}), batch {rep['batch_size']}, max_new_tokens {rep['max_new_tokens']}, "
          f"greedy" + (f", stop strings {rep['stops']!r}" if rep["stops"] else "")
          + f", {rep['dtype']} on {rep['gpu']}; {rep['rounds']} round(s) interleaved; median [min-max]")
    res = rep["results"]
    print(f"{'variant':<18} {'rows':>6} {'rows/s':>24} {'gen tok/s':>28} {'loop s':>20} {'capture s':>10}")
    for name, runs in res.items():
        caps = [r["capture_s"] for r in runs if r.get("capture_s") is not None]
        rows = "/".join(str(n) for n in sorted({r["rows"] for r in runs}))
        cap = f"{statistics.median(caps):.1f}" if caps else "-"
        print(f"{name:<18} {rows:>6} {fmt_spread([r['rows_per_s'] for r in runs], 2):>24} "
              f"{fmt_spread([r['tokens_per_s'] for r in runs], 0):>28} "
              f"{fmt_spread([r['elapsed_s'] for r in runs], 2):>20} {cap:>10}")
    print_end_to_end(rep)
    tbs = rep["bandwidth_tbs"]
    if tbs is None:
        print(f"bandwidth bound: n/a ({rep['bandwidth_from']})")
    else:
        print(f"memory-bandwidth bound at {tbs:g} TB/s ({rep['bandwidth_from']}): weights + the live KV cache read "
              f"once a decode step; the variant's schedule as modelled (see the doc)")
        print(f"{'variant':<16} {'schedule':<30} {'steps':>8} {'GB/step':>14} {'bound tok/s':>12} "
              f"{'share of the bound':>26}")
        for name, runs in res.items():
            bs = [r for r in runs if r.get("bound")]
            if not bs:
                print(f"{name:<16} n/a (no slot count known)")
                continue
            b0 = bs[-1]["bound"]
            print(f"{name:<16} {schedule_label(b0):<30} {b0['steps']:>8,} "
                  f"{b0['weights_gb_per_step']:>5.2f}+{b0['kv_gb_per_step']:>5.2f} KV "
                  f"{statistics.median(r['bound']['tokens_per_s'] for r in bs):>12,.0f} "
                  f"{fmt_spread([r['bound']['share'] * 100 for r in bs], 1) + ' %':>26}")
    engines = {n: runs[-1]["engine"] for n, runs in res.items() if runs and runs[-1].get("engine")}
    for name, e in engines.items():
        if e.get("engine") == "slots":
            print(f"{name}: engine slots, {e.get('slots')} slots x width {e.get('width')}, CUDA graphs "
                  f"{'on' if e.get('graphs') else 'off'}"
                  + (f", attention {e['attention']}" if e.get("attention") else "")
                  + (f", capture {e['capture_s']:.1f} s" if e.get("capture_s") is not None else "")
                  + (f" ({e['why']})" if e.get("why") else ""))
        else:
            print(f"{name}: engine {e.get('engine')}" + (f" ({e['why']})" if e.get("why") else ""))
    for name in HF_VARIANTS:
        runs = res.get(name) or []
        if runs and runs[-1].get("config"):
            print(f"{name}: transformers {runs[-1].get('transformers')}, {runs[-1].get('how')}: "
                  + ", ".join(f"{k} {v}" for k, v in runs[-1]["config"].items()))
    if rep["workload"] == "skewed" or rep["stops"]:
        print("rows ended before max_new_tokens (stop string or end of sequence): "
              + ", ".join(f"{n} {statistics.median(r['early_share'] for r in runs) * 100:.0f}%"
                          for n, runs in res.items()))
        c = rep.get("calibration")
        if c:
            print(f"stop strings {c['stops']!r} from a calibration pass of {c['sample']} rows ({c['calibration_s']:.0f} s): "
                  f"in {c['share'] * 100:.0f}% of them, first at {c['mean_stop_fraction'] * 100:.0f}% of max_new_tokens "
                  f"on average; rows ended early there (stop or end of sequence) {c['eos_or_short_share'] * 100:.0f}%")
        ref = res.get("hpcgpu") or res.get("hpcgpu norefill") or []
        if ref:
            ceiling = refill_ceiling(ref)
            if ceiling is not None:
                print(f"refill ceiling on these rows: decode steps without refill / with it at "
                      f"{ceiling[1]} slots = {ceiling[0]:.3f} (a step costing the same with any number of live rows)")
    r = rep["ratios"]
    print("targets (issues #32, #46), ratios of the median gen tokens/s [range of the per-round ratios]:")
    lines = []
    bs64 = f"batch {rep['batch_size']}"

    def line(label: str, key: str, target: float | None, extra: str = "") -> None:
        x = r.get(key)
        if x is None:
            lines.append(f"  {label:<52} -  (not measured)")
            return
        verdict = f"  target >= {target:g}: {verdict_word(args, x['ratio'] >= target)}" if target is not None else ""
        lines.append(f"  {label:<52} {x['ratio']:.3f} [{x['min']:.3f}-{x['max']:.3f}]{verdict}{extra}")

    if rep["workload"] == "uniform":
        line(f"hpcgpu / plain ({bs64})", "hpcgpu/plain", TARGET_PLAIN,
             f"  (#14: >= {TARGET_ISSUE14}: {verdict_word(args, r['hpcgpu/plain']['ratio'] >= TARGET_ISSUE14)})"
             if "hpcgpu/plain" in r else "")
        hf = r.get("hpcgpu/best hf", {}).get("vs", "hf static / hf continuous")
        line(f"hpcgpu / the best transformers ({hf})", "hpcgpu/best hf", TARGET_HF)
        line("hpcgpu auto / plain, loop only (#46)", "hpcgpu auto/plain", TARGET_AUTO)
        rows_of = {n: {x["rows"] for x in res.get(n, [])} for n in ("hpcgpu auto", "plain")}
        same = len(rows_of["hpcgpu auto"] | rows_of["plain"]) == 1
        line("hpcgpu auto / plain, end to end (#46)", "e2e hpcgpu auto/plain", TARGET_AUTO_E2E,
             "" if same or not all(rows_of.values()) else "  (not one job: the row counts differ, see above)")
        line("auto / auto varlen, loop", "hpcgpu auto/hpcgpu auto varlen", None)
        line("auto / auto varlen, e2e", "e2e hpcgpu auto/hpcgpu auto varlen", None)
        auto = [x for x in res.get("hpcgpu auto", []) if x.get("bound")]
        if auto:
            shares = [x["bound"]["share"] for x in auto]
            med = statistics.median(shares)
            lines.append(f"  {'hpcgpu auto, share of its bandwidth bound':<52} {med * 100:.1f}% "
                         f"[{min(shares) * 100:.1f}-{max(shares) * 100:.1f}]  target >= {TARGET_BOUND * 100:g}%: "
                         f"{verdict_word(args, med >= TARGET_BOUND)}")
        else:
            lines.append(f"  {'hpcgpu auto, share of its bandwidth bound':<52} -  (n/a)")
        if "hpcgpu/hpcgpu norefill" in r:
            line("refill: hpcgpu / hpcgpu norefill (uniform rows: little to win)", "hpcgpu/hpcgpu norefill", None)
    else:
        line("refill: hpcgpu / hpcgpu norefill", "hpcgpu/hpcgpu norefill", TARGET_REFILL)
        if "hpcgpu/plain" in r:
            line(f"hpcgpu / plain ({bs64})", "hpcgpu/plain", None)
    for x in lines:
        print(x)
    other = [("hpcgpu/hf static", "hpcgpu / hf static"), ("hpcgpu/hf continuous", "hpcgpu / hf continuous"),
             ("hf static/plain", "hf static / plain"), ("hf continuous/plain", "hf continuous / plain"),
             ("hpcgpu auto/hpcgpu", "slots from memory: hpcgpu auto / hpcgpu"),
             ("hpcgpu/hpcgpu batches", "engine: hpcgpu (slots) / hpcgpu batches"),
             ("hpcgpu batches/plain", "the previous engine: hpcgpu batches / plain"),
             ("plain sorted/plain", "sorting: plain sorted / plain"),
             ("hpcgpu/plain sorted", "hpcgpu / plain sorted"),
             ("hpcgpu static/hpcgpu", "hpcgpu static / hpcgpu"), ("hpcgpu old/hpcgpu", "hpcgpu old / hpcgpu"),
             ("plain sorted nocudnn/plain nocudnn", "sorting, cuDNN attention off: plain sorted / plain"),
             ("plain nocudnn/plain", "cuDNN attention off, input order")]
    shown = [(k, lab) for k, lab in other if k in r]
    if shown:
        print("other ratios:")
        for k, lab in shown:
            x = r[k]
            print(f"  {lab:<52} {x['ratio']:.3f} [{x['min']:.3f}-{x['max']:.3f}]")
    if rep["padding"]:
        print("prompt padding (padded prompt tokens / prompt tokens - 1): "
              + ", ".join(f"{n} {v * 100:+.1f}%" for n, v in rep["padding"].items()))
    if rep["agreement"]:
        print("greedy outputs, rows with equal text / mean common prefix (share of the text), on the common rows:")
        for k, v in rep["agreement"].items():
            print(f"  {k:<40} {v['equal'] * 100:5.1f}% / {v['prefix'] * 100:5.1f}%  ({v['rows']} rows)")
    if rep["child_env"]:
        print(f"environment of every program: {' '.join(rep['child_env'])}")
    for ln in rep["notes"] + short_measurements(args, res):
        print(ln)


def fmt_ratio(x: dict[str, Any] | None) -> str:
    return f"{x['ratio']:.2f}" if x else "-"


def print_end_to_end(rep: dict[str, Any]) -> None:
    """Each variant's wall time from its process's spawn to its outputs written (hpcgpu: `hpcgpu submit`
    to the job's outputs.jsonl), beside the loop alone, and both against the plain loop."""
    res, r = rep["results"], rep["ratios"]
    have = {n: [x for x in runs if x.get("e2e_s")] for n, runs in res.items()}
    if not any(have.values()):
        return
    print("end to end: process start -> outputs written (hpcgpu: the submit's spawn -> the last write of "
          "outputs.jsonl); start-up = end to end - loop (imports, load, compile/capture, the job's launch)")
    print(f"{'variant':<18} {'rows':>6} {'end to end s':>22} {'start-up s':>20} {'e2e tok/s':>24} "
          f"{'loop tok/s':>24} {'e2e / plain':>11} {'loop / plain':>12}")
    for name, runs in have.items():
        if not runs:
            continue
        rows = "/".join(str(n) for n in sorted({x["rows"] for x in runs}))
        e2e, loop = r.get(f"e2e {name}/plain"), r.get(f"{name}/plain")
        print(f"{name:<18} {rows:>6} {fmt_spread([x['e2e_s'] for x in runs], 1):>22} "
              f"{fmt_spread([x['e2e_s'] - x['elapsed_s'] for x in runs], 1):>20} "
              f"{fmt_spread([x['e2e_tokens_per_s'] for x in runs], 0):>24} "
              f"{fmt_spread([x['tokens_per_s'] for x in runs], 0):>24} "
              f"{fmt_ratio(e2e):>11} {fmt_ratio(loop):>12}")
    first, again = have.get("hpcgpu auto") or [], have.get("hpcgpu auto again") or []
    if first and again:
        a = statistics.median(x["e2e_s"] - x["elapsed_s"] for x in first)
        b = statistics.median(x["e2e_s"] - x["elapsed_s"] for x in again)
        print(f"cached start-up: hpcgpu auto {a:.1f} s with an empty compile cache, hpcgpu auto again {b:.1f} s "
              f"right after it with the cache it left (torch.compile's kernels): {a - b:.1f} s saved")
    scales = {n: sorted({x.get("scale", 1) for x in runs}) for n, runs in have.items() if runs}
    if len({tuple(v) for v in scales.values()}) > 1:
        print("  (the variants read different row counts (--scale): an end-to-end ratio is one of tokens/s, not "
              "of one job's wall time; give every variant scale 1 for the wall time of one job)")


def refill_ceiling(runs: list[dict[str, Any]]) -> tuple[float, int] | None:
    """Decode steps of S slots without refill over those with it, on the completions of hpcgpu's last
    run (their share ended early and where): the most refill can give when a step's cost does not
    depend on how many slots are live."""
    slots = (runs[-1].get("schedule") or {}).get("slots")
    run_dir = runs[-1].get("run_dir")
    if not slots or not run_dir or not Path(run_dir, "outputs.jsonl").exists():
        return None
    outs = read_outputs(Path(run_dir, "outputs.jsonl"))
    comps = [o["c"] or 0 for _, o in sorted(outs.items())]
    with_refill, without = decode_steps(comps, slots, "slots"), decode_steps(comps, slots, "groups")
    return (without / with_refill if with_refill else float("nan")), slots


def scaling(args: argparse.Namespace, work: Path, model_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    widths = sorted({int(g) for g in args.gpus.split(",")})
    have = gpu_count(args)
    if have is not None and widths[-1] > have:
        note(f"only {have} GPU(s) here: skipping {[w for w in widths if w > have]}")
        widths = [w for w in widths if w <= have]
    if not widths or widths[0] != 1:
        raise SystemExit("--scaling needs 1 in --gpus (the efficiency is against 1 GPU)")
    unit = args.batch_size * widths[-1]
    rows = args.scaling_rows or args.rows * widths[-1]
    rows = -(-rows // unit) * unit  # whole batches, the same number for every replica at the widest
    data = work / f"scaling-rows-{model_dir.name}-p{args.min_prompt}-{args.max_prompt}-n{rows}.jsonl"
    lengths = make_rows(model_dir, data, rows, args.min_prompt, args.max_prompt, args.seed + 1)
    spec = hpcgpu_spec(args, work, model_dir, data, list(args.stop))
    sets = tuple(([f"infer.kv_cache={args.kv_cache}"] if args.kv_cache else [])
                 + ([f"infer.engine={args.engine}"] if args.engine else []))
    why = sets_rejected(args, work, spec, sets)
    if why is not None:
        raise SystemExit(f"--kv-cache / --engine: the spec refuses {' '.join(sets)} ({why})")
    setup = run_setup(args, "scaling", data, rows, gpu_name(args), list(args.stop))
    earlier, done = earlier_rounds(args, setup)
    results: dict[str, list[dict[str, Any]]] = {f"{w} GPU": list(earlier.get(f"{w} GPU", [])) for w in widths}
    for rnd in range(done, done + args.repeats):
        for name in rotated(list(results), rnd):
            w = int(name.split()[0])
            log = work / "logs" / f"scaling-{w}gpu-r{rnd + 1}.log"
            try:
                res = run_hpcgpu(args, work, spec, w, sets, log)
            except VariantSkipped as exc:
                raise SystemExit(f"scaling, {name}: {exc}")
            res.pop("outputs")
            res["round"] = rnd + 1
            results[name].append(res)
            save_pool(args, setup, results, rnd + 1)
            eng = res.get("engine") or {}
            note(f"round {rnd + 1}/{done + args.repeats} {name}: {res['rows']} rows in {res['elapsed_s']:.2f} s "
                 f"({res['rows_per_s']:.2f} rows/s, {res['tokens_per_s']:,.0f} tok/s; engine {eng.get('engine')}"
                 + (f", capture {res['capture_s']:.1f} s" if res.get("capture_s") is not None else "")
                 + f"; process {res['wall_s']:.1f} s)")
    eff = {}
    for w in widths[1:]:
        r = ratio(results, f"{w} GPU", "1 GPU", scale=w, key="rows_per_s")
        if r is not None:
            eff[w] = {"efficiency": r["ratio"], "min": r["min"], "max": r["max"], "rounds": r["rounds"]}
    engine = next((runs[-1].get("engine") for runs in results.values() if runs and runs[-1].get("engine")), {})
    rep = {"mode": "scaling", "gpu": gpu_name(args), "model": info, "rows": rows, "batch_size": args.batch_size,
           "max_new_tokens": args.max_new_tokens, "kv_cache": args.kv_cache or "spec default",
           "engine": engine, "prompt_tokens": {"min": min(lengths), "median": statistics.median(lengths),
                                               "max": max(lengths)},
           "repeats": args.repeats, "rounds": done + args.repeats, "results": results, "efficiency": eff,
           "setup": setup}
    m, p = info, rep["prompt_tokens"]
    print(f"# hpcgpu infer data-parallel scaling: {m['preset']} ({m['params'] / 1e6:.1f}M params), {rows} rows, "
          f"prompts {p['min']}..{p['max']} tokens, batch {args.batch_size} per replica, max_new_tokens "
          f"{args.max_new_tokens}, greedy, engine {engine.get('engine', '?')} ({args.engine or 'spec default'})"
          + (f", kv_cache {args.kv_cache}" if args.kv_cache else "")
          + f", {'CPU ranks' if args.cpu else rep['gpu']}; {rep['rounds']} round(s) interleaved; median [min-max]"
          + (f"; environment {' '.join(args.child_env)}" if args.child_env else ""))
    print(f"{'replicas':<9} {'rows/s':>26} {'gen tok/s':>30} {'loop s':>16} {'efficiency':>26}")
    for w in widths:
        runs = results[f"{w} GPU"]
        e = eff.get(w)
        verdict = (f"{e['efficiency']:.3f} [{e['min']:.3f}-{e['max']:.3f}] "
                   f"{verdict_word(args, e['efficiency'] >= TARGET_EFFICIENCY)}") if e else "-"
        print(f"{w:<9} {fmt_spread([r['rows_per_s'] for r in runs], 2):>26} "
              f"{fmt_spread([r['tokens_per_s'] for r in runs], 0):>30} "
              f"{fmt_spread([r['elapsed_s'] for r in runs], 2):>16} {verdict:>26}")
    print(f"efficiency = rows/s(N) / (N x rows/s(1)), target >= {TARGET_EFFICIENCY}; "
          "range: the per-round ratios")
    caps = {f"{w} GPU": [r["capture_s"] for r in results[f"{w} GPU"] if r.get("capture_s") is not None]
            for w in widths}
    if any(caps.values()):
        print("capture (outside the loop): " + ", ".join(f"{k} {statistics.median(v):.1f} s" for k, v in caps.items()
                                                        if v))
    for line in where_time_went(widths, results, args.batch_size):
        print(line)
    widest = {f"{widths[-1]} GPU": results[f"{widths[-1]} GPU"]}
    for line in short_measurements(args, widest):
        print(line.split("; --scale")[0])
    return rep


def where_time_went(widths: list[int], results: dict[str, list[dict[str, Any]]], batch_size: int) -> list[str]:
    """Per replica count, the mean over replicas of each part of the loop (median over rounds): what
    a gap in efficiency is made of (slower batches, the cold first batch, writing, waiting)."""
    parts = ("loop_s", "batches_s", "first_batch_s", "write_s", "wait_s")
    lines = []
    for w in widths:
        runs = [r for r in results[f"{w} GPU"] if all(f"replica_{p}" in r for p in parts)]
        if not runs:
            continue
        med = {p: statistics.median(statistics.mean(r[f"replica_{p}"]) for r in runs) for p in parts}
        per_batch = med["batches_s"] / max(1.0, runs[0]["rows"] / w / batch_size)
        lines.append(f"{w} replica(s), mean of replicas: loop {med['loop_s']:.2f} s = batches {med['batches_s']:.2f} s "
                     f"(the first {med['first_batch_s']:.2f} s; {per_batch:.3f} s a batch) + writing "
                     f"{med['write_s']:.2f} s + waiting {med['wait_s']:.2f} s")
    return lines


# ---------------------------------------------------------------- host facts (the parent never touches CUDA:
# a process of ours on a GPU would make hpcgpu's busy check warn about it)

def gpu_count(args: argparse.Namespace) -> int | None:
    if args.cpu:
        return None  # CPU ranks: any count
    names = nvidia_smi_names()
    return len(names) if names is not None else None


# ---------------------------------------------------------------- main

def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="everything tiny on the CPU (tiny model, 24 rows, batch 4, max_new_tokens 4 (skewed: 16), "
                         "1 round, no 20 s rule; --scaling: 1,2 CPU ranks): checks the script, measures nothing")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-400m",
                    help="model shape (default llama-400m, issue #32's; gpt2-350m: issue #14's)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="uniform",
                    help="uniform (default): prompts 8..512 tokens, 128 new, 768 rows; skewed: prompts 8..128, "
                         "512 new, 512 rows, --stop-share of the rows ending early on a stop string")
    ap.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary to train (default 8192)")
    ap.add_argument("--rows", type=int, default=None, help="input rows (default: the workload's, 768 / 512)")
    ap.add_argument("--batch-size", type=int, default=64,
                    help="rows per generate call of the plain loops, and hpcgpu's infer.batch_size (default 64)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the workload's (128 / 512)")
    ap.add_argument("--min-prompt", type=int, default=None, help="shortest prompt, tokens (default 8)")
    ap.add_argument("--max-prompt", type=int, default=None, help="longest prompt, tokens (default 512 / 128)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 3; 1 with --smoke)")
    ap.add_argument("--rounds-total", default=None, metavar="N[,VARIANT=N...]",
                    help="instead of --repeats: run rounds until each variant has N measurements, those pooled "
                         "from --append included (\"3,hf continuous=1\": that one once); a call cut by --deadline "
                         "is completed by the next")
    ap.add_argument("--deadline", type=float, default=0.0, metavar="S",
                    help="start no measurement that would end later than S seconds after this script started "
                         "(its estimate: that variant's previous run here or in the pool, else a guess); "
                         "prints what it has")
    ap.add_argument("--old-checkout", default=None, metavar="DIR",
                    help="the package the 'hpcgpu old' variant runs (DIR/hpcgpu: another commit's)")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated, of: {', '.join(VARIANTS)} (default: uniform: "
                         f"{', '.join(WORKLOADS['uniform']['variants'])}; skewed: "
                         f"{', '.join(WORKLOADS['skewed']['variants'])})")
    ap.add_argument("--scale", default="", metavar="VARIANT=K,...",
                    help="give VARIANT K x --rows rows (the same first rows, more drawn alike), so that a fast "
                         "variant's loop lasts --min-seconds while its tokens/s stays comparable")
    ap.add_argument("--adapt", action=argparse.BooleanOptionalAction, default=True,
                    help="after a loop shorter than --min-seconds, raise that variant's scale for its next rounds "
                         "(default on)")
    ap.add_argument("--max-scale", type=int, default=64, help="--adapt's ceiling (default 64)")
    ap.add_argument("--scale-together", default=None, metavar="VARIANT,...",
                    help="these variants always read the same rows: the largest scale any of them has or needs "
                         "(default: skewed: hpcgpu,hpcgpu norefill, the refill comparison; uniform: none)")
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help="memory bandwidth for the bound, TB/s (default from the GPU's name: H200 4.8, H100 3.35)")
    ap.add_argument("--stop", action="append", default=[], metavar="STR",
                    help="stop string for every program (repeatable); skewed: instead of the calibrated ones")
    ap.add_argument("--stop-share", type=float, default=1 / 3,
                    help="skewed: share of the calibration rows the stop string should end early (default 1/3)")
    ap.add_argument("--calib-rows", type=int, default=64, help="skewed: rows of the calibration pass (default 64)")
    ap.add_argument("--scaling", action="store_true", help="hpcgpu's data-parallel scaling over --gpus instead")
    ap.add_argument("--gpus", default="1,2", help="--scaling: replica counts, 1 first (default 1,2; 1,2,4 on 4 GPUs)")
    ap.add_argument("--scaling-rows", type=int, default=0,
                    help="--scaling: input rows (default --rows x the widest count, so the widest run is as long "
                         "as one GPU's run over --rows)")
    ap.add_argument("--kv-cache", choices=["dynamic", "static"], default=None,
                    help="--scaling: set infer.kv_cache (default: the spec's default)")
    ap.add_argument("--engine", choices=["slots", "batches"], default=None,
                    help="--scaling: set infer.engine (default: the spec's default)")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="flag measurements shorter than this, and --adapt to it (default 20; 0 with --smoke)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    ap.add_argument("--work", type=Path, default=None,
                    help="work dir (model dir, rows, run dirs, logs/; kept; a model made there is reused); default: "
                         "a temporary dir, removed at the end")
    ap.add_argument("--child-env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in the environment of every measured program (the loops and hpcgpu's ranks): a "
                         "torch or library switch to try on all sides alike; repeatable; part of the setup")
    ap.add_argument("--append", type=Path, default=None, metavar="FILE",
                    help="pool with the rounds an earlier run of the same setup wrote to FILE (the order goes on "
                         "rotating), rewriting FILE after every measurement: --repeats 1 three times on the same "
                         "machine is three interleaved rounds in calls of a third the length")
    ap.add_argument("--json", type=Path, default=None,
                    help="write the results here (default $OUT/infer_throughput.json)")
    args = ap.parse_args(argv)
    args.cpu = args.smoke
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this process only makes the model on the CPU
    wl = WORKLOADS[args.workload]
    if args.smoke:
        args.model, args.vocab_size, args.batch_size = "tiny", 512, 4
        args.min_seconds = 0.0 if args.min_seconds is None else args.min_seconds
        args.rows = args.rows or 24
        args.min_prompt = args.min_prompt or 4
        args.max_prompt = args.max_prompt or (48 if args.workload == "uniform" else 24)
        args.max_new_tokens = args.max_new_tokens or (4 if args.workload == "uniform" else 16)
        args.calib_rows = min(args.calib_rows, args.rows)
    if args.min_seconds is None:
        args.min_seconds = 20.0
    for key in ("rows", "min_prompt", "max_prompt", "max_new_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, wl[key])
    if args.variants is None:
        args.variants = ",".join(wl["variants"])
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    args.scale_map = parse_scale(args.scale)
    args.together = [x.strip() for x in (args.scale_together if args.scale_together is not None
                                         else ",".join(wl.get("together", []))).split(",") if x.strip()]
    if "hpcgpu old" in args.variants.split(","):
        if not (args.old_checkout and Path(args.old_checkout, "hpcgpu", "__init__.py").is_file()):
            ap.error("the 'hpcgpu old' variant needs --old-checkout DIR holding DIR/hpcgpu/__init__.py")
        args.old_checkout = str(Path(args.old_checkout).resolve())
    if (args.kv_cache or args.engine) and not args.scaling:
        ap.error("--kv-cache / --engine are for --scaling (the throughput mode has a variant for each)")
    if "" in args.stop:
        ap.error("--stop: an empty string would end every completion at once")
    if not 0 < args.stop_share < 1:
        ap.error("--stop-share must lie between 0 and 1")
    info_limit = MODELS[args.model].get("n_positions") or MODELS[args.model].get("max_position_embeddings")
    if args.max_prompt + args.max_new_tokens > info_limit:
        ap.error(f"--max-prompt + --max-new-tokens > the model's {info_limit} positions")
    if not 1 <= args.min_prompt <= args.max_prompt:
        ap.error("need 1 <= --min-prompt <= --max-prompt")

    with work_dir(args.work, "infer-bench-") as work:
        model_dir = work / f"model-{args.model}-v{args.vocab_size}-s{args.seed}"
        info = make_model(model_dir, args.model, args.vocab_size, args.seed)
        if "layers" not in info:  # a model dir an earlier version of this script made
            info.update(kv_shape(args.model))
        report = (scaling if args.scaling else throughput)(args, work, model_dir, info)
    report["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report["total_s"] = time.perf_counter() - T_START
    print(f"(whole benchmark: {report['total_s']:.0f} s)", flush=True)
    target = args.json or (Path(os.environ["OUT"], "infer_throughput.json") if os.environ.get("OUT") else None)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
