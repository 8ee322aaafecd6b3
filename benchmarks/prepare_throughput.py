"""Prepare throughput (issue #16): `hpcgpu data prepare` against Hugging Face `datasets` .map(), tokens/s.

    python benchmarks/prepare_throughput.py [--size 100M] [--workers 1,2] [--repeats 3] [--work DIR]
    python benchmarks/prepare_throughput.py --smoke      # a tiny file, 1 worker, 1 repeat: checks the script

The same input for both: the synthetic .jsonl of benchmarks/data_scaling.py ("text" field, ~3-6 KB
documents, seeded), made once in --work. The same tokenizer for both: a byte-level BPE
(--vocab-size, default 512) trained in memory on configs/data/pydocs.txt by
scripts/make_tiny_model.py's train_tokenizer(), saved to a folder in --work and loaded from there
with AutoTokenizer (a fast tokenizer) in each child. With N workers:

    hpcgpu    hpcgpu.data.prepare(src, tokenizer, out, workers=N): read the .jsonl, tokenize (eos after
              each document), write tokens.bin, docs.npy and the manifest (sha256 of the input included)
    datasets  load_dataset("json", data_files=src, split="train", cache_dir=FRESH) then
              .map(lambda b: tokenizer(b["text"]), batched=True, num_proc=N (None for 1),
              remove_columns=["text"], load_from_cache_file=False): the tokenize step of transformers'
              run_clm.py; it writes the json->arrow conversion and the mapped arrow file to its cache

Each run is a fresh child process (imports and the tokenizer load are not timed; the clock runs
from the start of the work to the files written). datasets gets a new, empty cache dir per run
(removed after it), so no run reuses another's work; hpcgpu's output folder is removed after each run
too. TOKENIZERS_PARALLELISM is left unset: in one process (N = 1) both sides' batch calls use the
tokenizer's Rust thread pool; hpcgpu's pool workers turn it off, datasets' leave it as it is.

Runs are interleaved hpcgpu, datasets, hpcgpu, datasets... (for each N, each repeat). Printed: per N
the median [min-max] seconds and tokens/s of each (each side's own token count: hpcgpu's includes
the eos ids, ~0.1% more), datasets' load and map parts, the peak RSS of each run's process tree, and
the ratio hpcgpu/datasets of throughput on the same input (= datasets seconds / hpcgpu seconds, per
interleaved pair; median [min-max]) with a verdict (target >= 1.0).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data_scaling import GIB, MIB, REPO, corpus, label, parse_bytes, parse_size, watched  # noqa: E402

TARGET = 1.0


def bpe_tokenizer(work: Path, vocab: int) -> Path:
    """The BPE of scripts/make_tiny_model.py, trained on configs/data/pydocs.txt, saved in `work`."""
    folder = work / f"bpe-{vocab}"
    if (folder / "tokenizer.json").exists():
        return folder
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tmp = work / f".bpe-{vocab}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    module.train_tokenizer(module.DATA, vocab).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


# ---------------------------------------------------------------- one run (child process)

def child(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    assert tok.is_fast
    out: dict[str, Any] = {}
    if args.child == "hpcgpu":
        from hpcgpu.data import prepare

        t0 = time.perf_counter()
        done = prepare(args.src, tok, args.out, workers=args.workers)
        out["seconds"] = time.perf_counter() - t0
        out["tokens"] = done.manifest["num_tokens"]
        out["documents"] = done.manifest["num_documents"]
    else:
        import datasets
        import pyarrow.compute as pc

        datasets.disable_progress_bars()

        def tokenize_fn(batch: dict[str, list[str]]) -> Any:
            return tok(batch["text"])

        t0 = time.perf_counter()
        ds = datasets.load_dataset("json", data_files=args.src, split="train", cache_dir=args.out)
        t1 = time.perf_counter()
        mapped = ds.map(tokenize_fn, batched=True, num_proc=args.workers if args.workers > 1 else None,
                        remove_columns=ds.column_names, load_from_cache_file=False)
        t2 = time.perf_counter()
        assert mapped.cache_files, "datasets kept the result in memory: it would skip the write hpcgpu pays"
        out.update(seconds=t2 - t0, load_s=t1 - t0, map_s=t2 - t1, documents=len(mapped),
                   tokens=int(pc.sum(pc.list_value_length(mapped.data.column("input_ids"))).as_py()))
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- the parent

def one_run(args: argparse.Namespace, side: str, workers: int, src: Path, tok: Path, work: Path) -> dict[str, Any]:
    out = work / f"run-{side}-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--workers", str(workers),
            "--src", str(src), "--tokenizer", str(tok), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    try:
        res = watched(argv, args.mem_cap, args.timeout, env)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    lines = [ln for ln in res["stdout"].splitlines() if ln.startswith("{")]
    if res["code"] != 0 or not lines:
        why = "over the memory cap" if res["over"] else "timed out" if res["timed_out"] else f"exit {res['code']}"
        tail = (res["stderr"] or res["stdout"]).strip().splitlines()[-8:]
        sys.exit(f"{side} with {workers} worker(s) failed ({why}):\n" + "\n".join(tail))
    rec = json.loads(lines[-1])
    rec["tree_peak"] = res["tree_peak"]
    return rec


def spread(values: list[float], digits: int = 2, scale: float = 1.0) -> str:
    vals = [v / scale for v in values]
    med = statistics.median(vals)
    if len(vals) == 1:
        return f"{med:,.{digits}f}"
    return f"{med:,.{digits}f} [{min(vals):,.{digits}f}-{max(vals):,.{digits}f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=parse_size("100M"), help="input size, decimal (default 100M)")
    ap.add_argument("--workers", default="1,2", help="worker counts, both sides (default 1,2)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved pairs per worker count (default 3)")
    ap.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary (default 512)")
    ap.add_argument("--work", type=Path, default=None,
                    help="keeps the input and tokenizer (default: $TMPDIR/hpcgpu-data-bench; --smoke: a "
                         "temporary dir, removed)")
    ap.add_argument("--mem-cap", type=parse_bytes, default=8 * GIB, help="stop a run over this RSS (default 8G)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    ap.add_argument("--smoke", action="store_true", help="a tiny input, 1 worker, 1 repeat")
    ap.add_argument("--child", choices=["hpcgpu", "datasets"], help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.workers = int(args.workers)
        return child(args)
    if args.smoke:
        args.size, args.workers, args.repeats, args.vocab_size = parse_size("300K"), "1", 1, 300
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    temp = tempfile.mkdtemp(prefix="prepare-tp-") if args.smoke and args.work is None else None
    work = Path(temp or args.work or Path(tempfile.gettempdir()) / "hpcgpu-data-bench").absolute()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        run(args, counts, work)
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


def run(args: argparse.Namespace, counts: list[int], work: Path) -> None:
    import datasets
    import tokenizers
    import transformers

    work.mkdir(parents=True, exist_ok=True)
    src = corpus(work, args.size)
    tok = bpe_tokenizer(work, args.vocab_size)
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, datasets "
          f"{datasets.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"# input {src.name}: {src.stat().st_size / 1e6:,.1f} MB; BPE vocabulary {args.vocab_size} ({tok}); "
          f"{args.repeats} interleaved pair(s) per worker count", flush=True)
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {n: {"hpcgpu": [], "datasets": []} for n in counts}
    for rep in range(args.repeats):
        for n in counts:
            for side in ("hpcgpu", "datasets"):
                rec = one_run(args, side, n, src, tok, work)
                runs[n][side].append(rec)
                extra = f" (load {rec['load_s']:.2f} s + map {rec['map_s']:.2f} s)" if side == "datasets" else ""
                print(f"#   repeat {rep + 1}, {n} worker(s), {side}: {rec['seconds']:.2f} s{extra}, "
                      f"{rec['tokens'] / rec['seconds']:,.0f} tokens/s, tree peak RSS {rec['tree_peak'] / MIB:,.0f} MiB",
                      flush=True)
    report(runs, counts)


def report(runs: dict[int, dict[str, list[dict[str, Any]]]], counts: list[int]) -> None:
    print()
    print("| workers | hpcgpu s | hpcgpu tokens/s | datasets s (load + map) | datasets tokens/s "
          "| hpcgpu peak RSS | datasets peak RSS | ratio hpcgpu/datasets |")
    print("|---|---|---|---|---|---|---|---|")
    verdicts = []
    for n in counts:
        h, d = runs[n]["hpcgpu"], runs[n]["datasets"]
        ratios = [b["seconds"] / a["seconds"] for a, b in zip(h, d)]
        ratio = statistics.median(ratios)
        verdicts.append((n, ratio))
        load = statistics.median(r["load_s"] for r in d)
        mapped = statistics.median(r["map_s"] for r in d)
        print(f"| {n} | {spread([r['seconds'] for r in h])} | {spread([r['tokens'] / r['seconds'] for r in h], 0)} "
              f"| {spread([r['seconds'] for r in d])} ({load:.2f} + {mapped:.2f}) "
              f"| {spread([r['tokens'] / r['seconds'] for r in d], 0)} "
              f"| {spread([r['tree_peak'] for r in h], 0, MIB)} MiB | {spread([r['tree_peak'] for r in d], 0, MIB)} MiB "
              f"| {spread(ratios, 3)} |")
    tokens = runs[counts[0]]["hpcgpu"][0]["tokens"], runs[counts[0]]["datasets"][0]["tokens"]
    print()
    print(f"tokens: hpcgpu {tokens[0]:,} (eos after each document), datasets {tokens[1]:,}")
    for n, ratio in verdicts:
        map_only = statistics.median(b["map_s"] / a["seconds"] for a, b in zip(runs[n]["hpcgpu"], runs[n]["datasets"]))
        print(f"verdict: {n} worker(s): hpcgpu/datasets throughput {ratio:.3f} (target >= {TARGET:.1f}: "
              f"{'met' if ratio >= TARGET else 'NOT met'}); against datasets' map alone {map_only:.3f}")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
