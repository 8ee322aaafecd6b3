"""hpcgpu's `task: infer` against a plain Hugging Face `generate` loop, side by side in one run.

    # one GPU (PYTHONPATH=<this checkout> where hpcgpu is not installed; NCCL_NVLS_ENABLE=0 is set for
    # the children): one round of the four variants takes ~4 min on an H100 with the defaults
    python benchmarks/infer_throughput.py [--model gpt2-350m] [--rows 512] [--batch-size 64] \
        [--max-new-tokens 128] [--repeats 3]
    # the same three rounds in three shorter calls on one warm machine (a cap of 10 min per command):
    python benchmarks/infer_throughput.py --repeats 1 --work /tmp/ib --append /tmp/ib/rounds.json   # x3
    # data-parallel scaling of hpcgpu infer, one replica per GPU (1,2,4 on a 4-GPU host):
    python benchmarks/infer_throughput.py --scaling --gpus 1,2 [--scaling-rows N] [--kv-cache static]
    # everything tiny on the CPU, to check the script end to end (its numbers measure nothing):
    python benchmarks/infer_throughput.py --smoke [--scaling]

What it measures. Once, into a work dir (a temporary one unless --work): a model dir with random
weights (GPT-2 or Llama shaped, --model, seeded; embeddings tied) and a byte-level BPE tokenizer
trained in memory on configs/data/pydocs.txt (scripts/make_tiny_model.py's; no hub), both written
with save_pretrained; and an input jsonl of --rows {"id", "prompt"} rows, windows of that text of
uniformly random length between --min-prompt and --max-prompt tokens (seeded), so that padding
matters. Then, interleaved for --repeats rounds (the order rotates each round), each variant in a
fresh process on the same rows, model, batch size, greedy, max_new_tokens:

    plain           benchmarks/plain_generate.py: batches in input order, left padding, model.generate
    plain sorted    the same with --sort: rows sorted by (prompt tokens, input position): the very
                    batches hpcgpu runs
    hpcgpu          `hpcgpu submit SPEC --executor local --new --gpus 1`, task: infer, infer.batch_size
                    fixed to the plain loop's, the spec's other infer settings at their defaults
    hpcgpu static   the same with --set infer.kv_cache=static (skipped, with a note, where the spec
                    refuses the key or the run fails)
    (not by default, --variants: "plain nocudnn", "plain sorted nocudnn": the plain loops with SDPA's
    cuDNN backend off, to isolate its cost: on an H100 torch picks it and builds a plan for every new
    sequence length, ~40 ms each, which sorted batches meet far more often than padded ones)

The time of a measurement is its generation loop alone, model loading excluded: plain_generate.py's
elapsed_s (between two torch.cuda.synchronize()), hpcgpu's "end" record in the run dir's
metrics.jsonl (elapsed_s: the loop, its per-batch collectives, writing and merging the outputs);
both include their process's first, cold batches. Prints, per variant, the median and spread
(min-max) of rows/s and generated tokens/s; the ratio hpcgpu/plain (the headline, target >= 1.3) and
what each step contributes: plain sorted/plain (sorting by length), hpcgpu/plain sorted (the engine
apart from sorting: the same batches), hpcgpu static/hpcgpu (the KV cache); ratios are of the
medians, their spread the range of the per-round ratios. Also, for the greedy outputs, the share of
rows with the same text and the mean common prefix, between programs and (the noise floor) between
two rounds of the same program: with random weights the top logits are close, and bf16 rounding
(other batch neighbours, or no bitwise determinism at all) flips tokens; reported, not asserted.
Measurements shorter than --min-seconds (20 s) are flagged with the --rows that would reach it.

--scaling: hpcgpu infer (spec defaults, or --kv-cache static) at each of --gpus (one replica per GPU)
on the same input of --scaling-rows rows (default: --rows x the widest count, rounded to whole
batches per replica), interleaved; efficiency(N) = rows/s(N) / (N x rows/s(1)), target >= 0.95.

Writes the results as JSON to $OUT/infer_throughput.json (or --json PATH; --append FILE too). Needs
torch and transformers (and their `tokenizers`), no yaml; hpcgpu runs as `python -m hpcgpu` from this
checkout, its jobs in a registry of the work dir. The parent process never touches CUDA (hpcgpu's
busy-GPU check would see it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import gpu_name, nvidia_smi_names, rotated, spread, work_dir

REPO = Path(__file__).resolve().parent.parent
PLAIN = REPO / "benchmarks" / "plain_generate.py"
CORPUS = REPO / "configs" / "data" / "pydocs.txt"
TARGET_RATIO, TARGET_EFFICIENCY = 1.3, 0.95
ORIG_ENV = dict(os.environ)  # the children's environment: before this process sets anything for itself

# model shapes (random weights); the vocabulary is the BPE tokenizer's (8192; 512 for tiny)
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 512},
    "gpt2-124m": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024},
    "gpt2-350m": {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024},
    "llama-160m": {"model_type": "llama", "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                   "num_key_value_heads": 12, "intermediate_size": 2048, "max_position_embeddings": 2048},
    "llama-400m": {"model_type": "llama", "num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "intermediate_size": 2816, "max_position_embeddings": 2048},
}
VARIANTS = {  # name -> (program, sorted / static, plain loop without cuDNN attention)
    "plain": ("plain", False, False),
    "plain sorted": ("plain", True, False),
    "hpcgpu": ("hpcgpu", False, False),
    "hpcgpu static": ("hpcgpu", True, False),
    # not in the default set: the plain loops with SDPA's cuDNN backend off (torch picks it on Hopper,
    # and it builds a plan, tens of ms, for every new sequence length: a cost that grows with sorting)
    "plain nocudnn": ("plain", False, True),
    "plain sorted nocudnn": ("plain", True, True),
    # another commit's hpcgpu (--old-checkout DIR: `git archive REV hpcgpu | tar -x -C DIR`), beside this one's
    "hpcgpu old": ("hpcgpu-old", False, False),
}
DEFAULT_VARIANTS = ["plain", "plain sorted", "hpcgpu", "hpcgpu static"]


def note(msg: str) -> None:
    print(f"[infer_throughput] {msg}", file=sys.stderr, flush=True)


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
            "positions": limit}
    (out / "bench_model.json").write_text(json.dumps(info))
    note(f"model dir {out}: {preset}, {n_params / 1e6:.1f}M params, vocab {len(tokenizer)}, "
         f"made in {time.perf_counter() - t0:.1f}s")
    return info


def make_rows(model_dir: Path, path: Path, n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """n {"id", "prompt"} rows: windows of the corpus, lo..hi tokens long (uniform, seeded); returns
    each prompt's token length as the tokenizer reads the text back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(CORPUS.read_text(encoding="utf-8"))["input_ids"]
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
    return lengths


# ---------------------------------------------------------------- the programs

class VariantSkipped(Exception):
    pass


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


def run_plain(args: argparse.Namespace, work: Path, model_dir: Path, data: Path, sort: bool,
              no_cudnn: bool = False) -> dict[str, Any]:
    out = work / f"plain{'-sorted' if sort else ''}{'-nocudnn' if no_cudnn else ''}.jsonl"
    cmd = [sys.executable, str(PLAIN), "--model", str(model_dir), "--input", str(data), "--output", str(out),
           "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens),
           "--device", "cpu" if args.cpu else "cuda"] + (["--sort"] if sort else []) \
        + (["--no-cudnn-attention"] if no_cudnn else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env(args, work))
    if proc.returncode != 0:
        raise SystemExit(f"plain loop failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    res["wall_s"] = time.perf_counter() - t0
    res["texts"] = read_texts(out)
    return res


def hpcgpu_spec(args: argparse.Namespace, work: Path, model_dir: Path, data: Path) -> Path:
    spec = {
        "name": "infer-bench", "task": "infer", "runs_dir": str(work / "runs"),
        "resources": {"gpus": 1, "cpus_per_gpu": 1 if args.cpu else 4},
        "model": {"name_or_path": str(model_dir)},
        "infer": {"input": str(data), "mode": "generate", "max_new_tokens": args.max_new_tokens,
                  "temperature": 0.0, "batch_size": args.batch_size},
    }
    path = work / f"{data.stem}.spec.yaml"
    path.write_text(json.dumps(spec, indent=1) + "\n")  # JSON is YAML: no yaml module needed here
    return path


def hpcgpu_cmd(spec: Path, gpus: int, static: bool) -> list[str]:
    return ([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new", "--gpus", str(gpus)]
            + (["--set", "infer.kv_cache=static"] if static else []))


def static_rejected(args: argparse.Namespace, work: Path, spec: Path) -> str | None:
    """None when the spec takes infer.kv_cache=static; else the validator's one line."""
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "validate", str(spec), "--set", "infer.kv_cache=static"],
                          capture_output=True, text=True, cwd=REPO, env=child_env(args, work))
    if proc.returncode == 0:
        return None
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    line = next((ln for ln in lines if "kv_cache" in ln), lines[-1] if lines else f"exit {proc.returncode}")
    return line.removeprefix("hpcgpu: error: ")


def run_hpcgpu(args: argparse.Namespace, work: Path, spec: Path, gpus: int, static: bool,
               checkout: str | None = None) -> dict[str, Any]:
    cmd = hpcgpu_cmd(spec, gpus, static)
    env, cwd = child_env(args, work), REPO
    if checkout is not None:  # that checkout's hpcgpu: first on the path, and the cwd `-m` looks in first
        env["PYTHONPATH"] = os.pathsep.join([checkout, env["PYTHONPATH"]])
        cwd = Path(checkout)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if static:
            raise VariantSkipped(f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}): "
                                 + (proc.stderr.strip().splitlines() or ["?"])[-1])
        raise SystemExit(f"hpcgpu run failed ({' '.join(cmd)}):\n{tail}")
    found = re.findall(r"run dir (\S+)", proc.stderr)
    if found:
        run_dir = Path(found[-1].rstrip(",;"))
    else:  # the newest run dir of the spec
        run_dir = max((work / "runs" / "infer-bench").iterdir(), key=lambda p: p.stat().st_mtime)
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    end = [r for r in recs if r.get("kind") == "end"]
    if not end:
        raise SystemExit(f"hpcgpu run {run_dir}: no \"end\" record in metrics.jsonl")
    end = end[-1]
    return {"rows": end["rows"], "tokens": end["tokens"], "elapsed_s": end["elapsed_s"],
            "rows_per_s": end["rows"] / end["elapsed_s"], "tokens_per_s": end["tokens"] / end["elapsed_s"],
            "wall_s": wall, "run_dir": str(run_dir), "texts": read_texts(run_dir / "outputs.jsonl"),
            **{k: v for k, v in end.items() if k.startswith("replica_")}}


def read_texts(path: Path) -> dict[int, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            out[int(r["index"])] = r["text"]
    return out


# ---------------------------------------------------------------- statistics

def fmt_spread(values: list[float], digits: int = 1) -> str:
    med, lo, hi = spread(values)
    return f"{med:,.{digits}f} [{lo:,.{digits}f}-{hi:,.{digits}f}]"


def ratio(results: dict[str, list[dict[str, Any]]], num: str, den: str, scale: float = 1.0) -> dict[str, Any] | None:
    """Ratio of the median rows/s (the denominator times `scale`), and the range of the per-round
    ratios (the two measurements of the same round)."""
    a, b = results.get(num) or [], results.get(den) or []
    if not a or not b:
        return None
    by_round = {y["round"]: y for y in b}
    paired = [x["rows_per_s"] / (scale * by_round[x["round"]]["rows_per_s"]) for x in a if x["round"] in by_round]
    med = statistics.median(x["rows_per_s"] for x in a) / (scale * statistics.median(y["rows_per_s"] for y in b))
    return {"ratio": med, "min": min(paired, default=med), "max": max(paired, default=med), "rounds": paired}


def agreement(a: dict[int, str], b: dict[int, str]) -> dict[str, float]:
    """Share of rows with the same text, and the mean share of each text (the longer of the two)
    before the first difference: a flipped token late in a row costs little, a wrong prompt all."""
    keys = sorted(set(a) & set(b))
    prefix = []
    for k in keys:
        x, y = a[k], b[k]
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(len(x), len(y), 1))
    return {"equal": sum(a[k] == b[k] for k in keys) / max(1, len(keys)),
            "prefix": sum(prefix) / max(1, len(prefix))}


def rows_for(args: argparse.Namespace, rows: int, elapsed: float) -> int:
    """The rows that would take --min-seconds at this pace, rounded up to whole batches."""
    need = rows * args.min_seconds / max(elapsed, 1e-9) * 1.15
    return int(-(-need // args.batch_size) * args.batch_size)


def short_measurements(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> list[str]:
    if args.min_seconds <= 0:
        return []
    lines = []
    for name, runs in results.items():
        short = [r for r in runs if r["elapsed_s"] < args.min_seconds]
        if short:
            worst = min(short, key=lambda r: r["elapsed_s"])
            need = rows_for(args, worst["rows"], worst["elapsed_s"])
            lines.append(f"WARNING: {name}: {len(short)} of {len(runs)} measurements under {args.min_seconds:g} s "
                         f"(shortest {worst['elapsed_s']:.1f} s); about {need} rows would reach it")
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


def run_setup(args: argparse.Namespace, mode: str, data: Path, rows: int, gpu: str) -> dict[str, Any]:
    """What must be the same for measurements to be pooled (--append): the input file's bytes too."""
    keys = ("model", "vocab_size", "batch_size", "max_new_tokens", "min_prompt", "max_prompt", "seed", "child_env",
            "kv_cache")
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    return {"mode": mode, "rows": rows, "input_sha256": digest, "gpu": gpu, **{k: getattr(args, k) for k in keys}}


def throughput(args: argparse.Namespace, work: Path, model_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    data = work / "rows.jsonl"
    lengths = make_rows(model_dir, data, args.rows, args.min_prompt, args.max_prompt, args.seed)
    spec = hpcgpu_spec(args, work, model_dir, data)
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r} (known: {', '.join(VARIANTS)})")
    notes: list[str] = []
    if "hpcgpu static" in names:
        why = static_rejected(args, work, spec)
        if why is not None:
            notes.append(f"hpcgpu static skipped: the spec refuses infer.kv_cache=static ({why})")
            note(notes[-1])
            names.remove("hpcgpu static")
    setup = run_setup(args, "throughput", data, args.rows, gpu_name(args))
    earlier, done = earlier_rounds(args, setup)
    results: dict[str, list[dict[str, Any]]] = {n: list(earlier.get(n, [])) for n in names}
    texts: dict[str, list[dict[int, str]]] = {}  # the outputs of this run's first two rounds
    extra: dict[str, dict[str, Any]] = {}
    skipped: set[str] = set()
    for rnd in range(done, done + args.repeats):
        for name in rotated(list(results), rnd):
            if name in skipped:
                continue
            kind, option, no_cudnn = VARIANTS[name]
            try:
                if kind == "plain":
                    res = run_plain(args, work, model_dir, data, sort=option, no_cudnn=no_cudnn)
                else:
                    old = args.old_checkout if kind == "hpcgpu-old" else None
                    res = run_hpcgpu(args, work, spec, 1, static=option, checkout=old)
            except VariantSkipped as exc:
                notes.append(f"{name} skipped from round {rnd + 1} on: {exc}")
                note(notes[-1])
                skipped.add(name)
                continue
            got = res.pop("texts")
            if len(texts.setdefault(name, [])) < 2:
                texts[name].append(got)
            extra.setdefault(name, {k: res[k] for k in ("padded_prompt_tokens", "prompt_tokens", "device", "dtype")
                                    if k in res})
            res["round"] = rnd + 1
            results[name].append(res)
            note(f"round {rnd + 1}/{done + args.repeats} {name:<20}: {res['rows']} rows, {res['tokens']:,} tokens in "
                 f"{res['elapsed_s']:.2f} s ({res['rows_per_s']:.2f} rows/s, {res['tokens_per_s']:,.0f} tok/s; "
                 f"process {res['wall_s']:.1f} s)")
    results = {n: r for n, r in results.items() if r}
    ratios = {
        "hpcgpu/plain": ratio(results, "hpcgpu", "plain"),
        "hpcgpu static/plain": ratio(results, "hpcgpu static", "plain"),
        "plain sorted/plain": ratio(results, "plain sorted", "plain"),
        "hpcgpu/plain sorted": ratio(results, "hpcgpu", "plain sorted"),
        "hpcgpu static/hpcgpu": ratio(results, "hpcgpu static", "hpcgpu"),
        "plain sorted nocudnn/plain nocudnn": ratio(results, "plain sorted nocudnn", "plain nocudnn"),
        "plain nocudnn/plain": ratio(results, "plain nocudnn", "plain"),
        "plain sorted nocudnn/plain sorted": ratio(results, "plain sorted nocudnn", "plain sorted"),
    }
    agree = {}
    for a, b in (("hpcgpu", "plain sorted"), ("hpcgpu", "plain"), ("hpcgpu static", "hpcgpu"),
                 ("hpcgpu static", "plain sorted")):
        if texts.get(a) and texts.get(b):
            agree[f"{a} vs {b}"] = agreement(texts[a][0], texts[b][0])
    for name, outs in texts.items():  # the noise floor: the same program twice
        if len(outs) == 2:
            agree[f"{name} round 1 vs 2"] = agreement(outs[0], outs[1])
    device = next((e.get("device") for e in extra.values() if e.get("device")), "?")
    dtype = next((e.get("dtype") for e in extra.values() if e.get("dtype")),
                 "float32" if args.cpu else "bfloat16")  # what model.dtype auto loads
    report = {"mode": "throughput", "gpu": gpu_name(args), "device": device, "dtype": dtype, "model": info,
              "rows": args.rows, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
              "prompt_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
              "repeats": args.repeats, "rounds": done + args.repeats, "results": results, "ratios": ratios,
              "agreement": agree, "notes": notes, "child_env": args.child_env, "setup": setup,
              "padding": {n: e["padded_prompt_tokens"] / e["prompt_tokens"] - 1 for n, e in extra.items()
                          if e.get("prompt_tokens")}}
    print_throughput(args, report)
    return report


def print_throughput(args: argparse.Namespace, rep: dict[str, Any]) -> None:
    m, p = rep["model"], rep["prompt_tokens"]
    print(f"# infer throughput: {m['preset']} ({m['params'] / 1e6:.1f}M params, vocab {m['vocab']}, random weights), "
          f"{rep['rows']} rows, prompts {p['min']}..{p['max']} tokens (median {p['median']:g}), batch "
          f"{rep['batch_size']}, max_new_tokens {rep['max_new_tokens']}, greedy, {rep['dtype']} on {rep['gpu']}; "
          f"{rep['rounds']} round(s) interleaved; median [min-max]")
    print(f"{'variant':<20} {'rows/s':>26} {'gen tok/s':>30} {'loop s':>16}")
    for name, runs in rep["results"].items():
        if runs:
            print(f"{name:<20} {fmt_spread([r['rows_per_s'] for r in runs], 2):>26} "
                  f"{fmt_spread([r['tokens_per_s'] for r in runs], 0):>30} "
                  f"{fmt_spread([r['elapsed_s'] for r in runs], 2):>16}")
    labels = {"hpcgpu/plain": "hpcgpu / plain (headline)", "hpcgpu static/plain": "hpcgpu static / plain",
              "plain sorted/plain": "sorting: plain sorted / plain",
              "hpcgpu/plain sorted": "engine, same batches: hpcgpu / plain sorted",
              "hpcgpu static/hpcgpu": "KV cache: hpcgpu static / hpcgpu",
              "plain sorted nocudnn/plain nocudnn": "sorting, cuDNN attention off: plain sorted / plain",
              "plain nocudnn/plain": "cuDNN attention off, input order",
              "plain sorted nocudnn/plain sorted": "cuDNN attention off, sorted"}
    print("ratios of median rows/s [range of the per-round ratios]:")
    for key, label in labels.items():
        r = rep["ratios"].get(key)
        if r is None:
            continue
        verdict = ""
        if key in ("hpcgpu/plain", "hpcgpu static/plain"):
            verdict = f"  target >= {TARGET_RATIO}: {verdict_word(args, r['ratio'] >= TARGET_RATIO)}"
        print(f"  {label:<52} {r['ratio']:.3f} [{r['min']:.3f}-{r['max']:.3f}]{verdict}")
    if rep["padding"]:
        print("prompt padding (padded prompt tokens / prompt tokens - 1): "
              + ", ".join(f"{n} {v * 100:+.1f}%" for n, v in rep["padding"].items()))
    if rep["agreement"]:
        print("greedy outputs, rows with equal text / mean common prefix (share of the text):")
        for k, v in rep["agreement"].items():
            print(f"  {k:<34} {v['equal'] * 100:5.1f}% / {v['prefix'] * 100:5.1f}%")
    if rep["child_env"]:
        print(f"environment of every program: {' '.join(rep['child_env'])}")
    for line in rep["notes"] + short_measurements(args, rep["results"]):
        print(line)


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
    data = work / "scaling-rows.jsonl"
    lengths = make_rows(model_dir, data, rows, args.min_prompt, args.max_prompt, args.seed + 1)
    spec = hpcgpu_spec(args, work, model_dir, data)
    static = args.kv_cache == "static"
    if static:
        why = static_rejected(args, work, spec)
        if why is not None:
            raise SystemExit(f"--kv-cache static: the spec refuses it ({why})")
    setup = run_setup(args, "scaling", data, rows, gpu_name(args))
    earlier, done = earlier_rounds(args, setup)
    results: dict[str, list[dict[str, Any]]] = {f"{w} GPU": list(earlier.get(f"{w} GPU", [])) for w in widths}
    for rnd in range(done, done + args.repeats):
        for name in rotated(list(results), rnd):
            w = int(name.split()[0])
            res = run_hpcgpu(args, work, spec, w, static=static)
            res.pop("texts")
            res["round"] = rnd + 1
            results[name].append(res)
            note(f"round {rnd + 1}/{done + args.repeats} {name}: {res['rows']} rows in {res['elapsed_s']:.2f} s "
                 f"({res['rows_per_s']:.2f} rows/s, {res['tokens_per_s']:,.0f} tok/s; process {res['wall_s']:.1f} s)")
    eff = {}
    for w in widths[1:]:
        r = ratio(results, f"{w} GPU", "1 GPU", scale=w)
        if r is not None:
            eff[w] = {"efficiency": r["ratio"], "min": r["min"], "max": r["max"], "rounds": r["rounds"]}
    rep = {"mode": "scaling", "gpu": gpu_name(args), "model": info, "rows": rows, "batch_size": args.batch_size,
           "max_new_tokens": args.max_new_tokens, "kv_cache": args.kv_cache or "spec default",
           "prompt_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
           "repeats": args.repeats, "rounds": done + args.repeats, "results": results, "efficiency": eff,
           "setup": setup}
    m, p = info, rep["prompt_tokens"]
    print(f"# hpcgpu infer data-parallel scaling: {m['preset']} ({m['params'] / 1e6:.1f}M params), {rows} rows, "
          f"prompts {p['min']}..{p['max']} tokens, batch {args.batch_size} per replica, max_new_tokens "
          f"{args.max_new_tokens}, greedy, kv_cache {rep['kv_cache']}, {'CPU ranks' if args.cpu else rep['gpu']}; "
          f"{rep['rounds']} round(s) interleaved; median [min-max]"
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
    for line in where_time_went(widths, results, args.batch_size):
        print(line)
    widest = {f"{widths[-1]} GPU": results[f"{widths[-1]} GPU"]}
    for line in short_measurements(args, widest):
        print(line)
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
                    help="everything tiny on the CPU (tiny model, 24 rows, batch 4, max_new_tokens 4, 1 round, "
                         "no 20 s rule; --scaling: 1,2 CPU ranks): checks the script, measures nothing")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2-350m", help="model shape (default gpt2-350m)")
    ap.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary to train (default 8192)")
    ap.add_argument("--rows", type=int, default=512, help="input rows (default 512)")
    ap.add_argument("--batch-size", type=int, default=64, help="rows per generate call, both programs (default 64)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    ap.add_argument("--min-prompt", type=int, default=8, help="shortest prompt, tokens (default 8)")
    ap.add_argument("--max-prompt", type=int, default=512, help="longest prompt, tokens (default 512)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 3; 1 with --smoke)")
    ap.add_argument("--old-checkout", default=None, metavar="DIR",
                    help="the package the 'hpcgpu old' variant runs (DIR/hpcgpu: another commit's)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, of: {', '.join(VARIANTS)} (default: {', '.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--scaling", action="store_true", help="hpcgpu's data-parallel scaling over --gpus instead")
    ap.add_argument("--gpus", default="1,2", help="--scaling: replica counts, 1 first (default 1,2; 1,2,4 on 4 GPUs)")
    ap.add_argument("--scaling-rows", type=int, default=0,
                    help="--scaling: input rows (default --rows x the widest count, so the widest run is as long "
                         "as one GPU's run over --rows)")
    ap.add_argument("--kv-cache", choices=["dynamic", "static"], default=None,
                    help="--scaling: set infer.kv_cache (default: the spec's default)")
    ap.add_argument("--min-seconds", type=float, default=20.0,
                    help="flag measurements shorter than this (default 20; 0 with --smoke)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    ap.add_argument("--work", type=Path, default=None,
                    help="work dir (model dir, rows, run dirs; kept; a model made there is reused); default: a "
                         "temporary dir, removed at the end")
    ap.add_argument("--child-env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in the environment of every measured program (both loops and hpcgpu's ranks): a "
                         "torch or library switch to try on both sides alike; repeatable; part of the setup")
    ap.add_argument("--append", type=Path, default=None, metavar="FILE",
                    help="pool with the rounds an earlier run of the same setup wrote to FILE (the order goes on "
                         "rotating), then rewrite FILE: --repeats 1 three times on the same machine is three "
                         "interleaved rounds in calls of a third the length")
    ap.add_argument("--json", type=Path, default=None,
                    help="write the results here (default $OUT/infer_throughput.json)")
    args = ap.parse_args(argv)
    args.cpu = args.smoke
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this process only makes the model on the CPU
    if args.smoke:
        args.model, args.vocab_size, args.rows, args.batch_size = "tiny", 512, 24, 4
        args.max_new_tokens, args.min_prompt, args.max_prompt, args.min_seconds = 4, 4, 48, 0.0
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if "hpcgpu old" in args.variants.split(","):
        if not (args.old_checkout and Path(args.old_checkout, "hpcgpu", "__init__.py").is_file()):
            ap.error("the 'hpcgpu old' variant needs --old-checkout DIR holding DIR/hpcgpu/__init__.py")
        args.old_checkout = str(Path(args.old_checkout).resolve())
    if args.kv_cache and not args.scaling:
        ap.error("--kv-cache is for --scaling (the throughput mode runs both caches)")
    info_limit = MODELS[args.model].get("n_positions") or MODELS[args.model].get("max_position_embeddings")
    if args.max_prompt + args.max_new_tokens > info_limit:
        ap.error(f"--max-prompt + --max-new-tokens > the model's {info_limit} positions")
    if not 1 <= args.min_prompt <= args.max_prompt:
        ap.error("need 1 <= --min-prompt <= --max-prompt")

    t0 = time.perf_counter()
    with work_dir(args.work, "infer-bench-") as work:
        model_dir = work / f"model-{args.model}-v{args.vocab_size}-s{args.seed}"
        info = make_model(model_dir, args.model, args.vocab_size, args.seed)
        report = (scaling if args.scaling else throughput)(args, work, model_dir, info)
    report["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report["total_s"] = time.perf_counter() - t0
    print(f"(whole benchmark: {report['total_s']:.0f} s)", flush=True)
    target = args.json or (Path(os.environ["OUT"], "infer_throughput.json") if os.environ.get("OUT") else None)
    for path in {p for p in (target, args.append) if p is not None}:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
