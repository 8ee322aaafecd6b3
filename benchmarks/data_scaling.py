"""Prepared data at scale (issue #16): what one rank pays at start-up for its data, raw file vs prepared.

    python benchmarks/data_scaling.py [--sizes 10M,100M,1G] [--work DIR] [--repeats 1] [--mem-cap 8G]
    python benchmarks/data_scaling.py --smoke        # tiny sizes, a temporary work dir: checks the script

For each size a synthetic .jsonl corpus ("text" field, documents of ~3-6 KB; words drawn from a fixed
pseudo-word vocabulary with a seeded RNG: the same bytes every time) is made once and kept in --work.
Then, in a fresh child process each (so peak RSS is one rank's), the data start-up of one rank:

    raw       the path before #16, which every rank ran: hpcgpu.runtime.data.tokenize(read_texts(path))
              in Python (int64 ids), pack() into seq_len blocks (a copy of the function #16 removed,
              below), the vocabulary check training did (blocks.max()), BatchSchedule, and the
              rank's first step of batches (blocks[idx] for each micro batch)
    prepared  `hpcgpu data prepare` once (timed apart: it is paid once, not per rank), then what a rank
              does now: load_blocks() on the prepared folder (memory-maps tokens.bin), BatchSchedule,
              and the same first step of batches (TokenBlocks.take, as training fetches them)

Both load the tokenizer as a job does, load_tokenizer() on a model folder holding
hpcgpu_tokenizer.json: the byte-level tokenizer (a token a byte, no eos). Time to first batch is from
this script's launch of the child (time.time() just before Popen) to the first step's batches in
hand (time.time() in the child): interpreter start and imports (torch, numpy, hpcgpu) included, as a
rank pays them; "data" is the part from just before the tokenizer is loaded to the batches, timed
inside the child (the "imports only" child shows the rest). Peak RSS is the child's ru_maxrss (its
whole life, imports included; a prepared rank's count includes the pages of tokens.bin it touched,
which the page cache shares between the ranks of a node).

The raw path's memory grows ~17 bytes per token plus the text: a child over --mem-cap (default 8 GiB,
resident set, polled every 20 ms by this script; RLIMIT_AS as a backstop in the child) is stopped and
reported as "over 8 GiB: stopped", not run to the end. An over-cap size is not repeated.

Prints a markdown table (size, raw time/RSS, prepared time/RSS, raw/prepared) with median [min-max]
where --repeats > 1, the prepare step per size, and a verdict: does a prepared rank stay flat (time
and peak RSS within 10% from the smallest size to the largest)?
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MIB = 1 << 20
FLAT = 0.10  # the verdict's tolerance: prepared within 10% from the smallest size to the largest
POLL_S = 0.02


# ---------------------------------------------------------------- synthetic corpus

def parse_size(text: str) -> int:
    """'10M' -> 10,000,000 bytes (decimal units: K, M, G)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 10M, 1G)")
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m.group(2).upper()])


def parse_bytes(text: str) -> int:
    """'8G' -> 8 GiB (binary units, for the memory cap)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8G)")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": MIB, "G": GIB}[m.group(2).upper()])


def label(size: int) -> str:
    for unit, n in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if size >= n and size % n == 0:
            return f"{size // n}{unit}"
    return str(size)


def vocabulary(rng: np.random.Generator, n: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """n pseudo-words of 1-4 syllables (a few with accents, some ending a sentence or clause), with
    Zipf-like frequencies: text a byte-level BPE splits into realistic pieces."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["é", "ä", "qu", "th", "sh", "ng"]
    words = []
    seen = set()
    while len(words) < n:
        k = int(rng.integers(1, 5))
        w = "".join(syllables[int(i)] for i in rng.integers(0, len(syllables), k))
        if w in seen:
            continue
        seen.add(w)
        r = rng.random()
        words.append(w + ("." if r < 0.06 else "," if r < 0.12 else ""))
    p = 1.0 / (np.arange(n) + 2.7)
    return np.asarray(words, dtype=object), p / p.sum()


def corpus(work: Path, size: int, seed: int = 0) -> Path:
    """The synthetic .jsonl of about `size` bytes in `work` (made once: the same bytes every time)."""
    path = work / f"corpus-{label(size)}-seed{seed}.jsonl"
    if path.exists():
        return path
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words, p = vocabulary(rng)
    tmp = path.with_name(f".{path.name}.partial")
    written = 0
    t0 = time.perf_counter()
    with open(tmp, "wb") as fh:
        while written < size:
            lengths = rng.integers(500, 1000, 16)  # words per document: ~3-6 KB each
            picks = words[rng.choice(len(words), int(lengths.sum()), p=p)]
            lines = []
            start = 0
            for n in lengths:
                doc = " ".join(picks[start: start + n].tolist())
                start += n
                lines.append(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            block = "".join(lines).encode("utf-8")
            fh.write(block)
            written += len(block)
    os.replace(tmp, path)
    print(f"# made {path} ({written / 1e6:,.1f} MB) in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def bytes_model(work: Path) -> Path:
    """A model folder whose tokenizer is the byte-level one, as load_tokenizer finds it in a job."""
    folder = work / "bytes-model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hpcgpu_tokenizer.json").write_text(json.dumps({"type": "bytes", "vocab_size": 256}) + "\n")
    return folder


# ---------------------------------------------------------------- one rank (child process)

def pack(ids: np.ndarray, seq_len: int, source: str) -> Any:
    """hpcgpu/runtime/data.py's pack() before #16 (commit ebae8a7), verbatim: int64 blocks, a copy."""
    import torch

    from hpcgpu.errors import HpcgpuError

    n = len(ids) // seq_len
    if n == 0:
        raise HpcgpuError(f"{source}: {len(ids)} tokens is less than one sequence of seq_len={seq_len}")
    return torch.from_numpy(ids[: n * seq_len].reshape(n, seq_len).copy())


def child(args: argparse.Namespace) -> None:
    """One rank's data start-up; prints one JSON line."""
    t_start = time.perf_counter()
    launched = args.launched or time.time()
    import torch  # noqa: F401  (the rank has it anyway; imported before the clock starts)

    from hpcgpu.runtime.data import BatchSchedule, load_blocks, load_tokenizer, read_texts, tokenize

    imports_s = time.perf_counter() - t_start
    me = psutil.Process()
    if args.mem_cap:  # the backstop: this script polls the RSS, this stops a runaway allocation anyway
        cap = me.memory_info().vms + args.mem_cap
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out: dict[str, Any] = {"imports_s": imports_s}
    world, rank = args.world, 0
    per_rank = args.global_batch // world
    t0 = time.perf_counter()
    try:
        if args.child == "imports":
            pass
        elif args.child == "raw":
            tok = load_tokenizer(args.model)
            blocks = pack(tokenize(read_texts(args.path), tok), args.seq_len, args.path)  # load_blocks before #16
            top = int(blocks.max())  # the trainer's vocabulary check before #16
            sched = BatchSchedule(len(blocks), 0, rank, global_batch=args.global_batch, per_rank=per_rank,
                                  micro=args.micro)
            batches = [blocks[idx] for idx in sched.next_micro_batches()]
            out.update(blocks=len(blocks), max_id=top)
        else:
            tok = load_tokenizer(args.model)
            blocks = load_blocks(args.path, tok, args.seq_len)
            top = blocks.max_token_id  # from the manifest
            sched = BatchSchedule(len(blocks), 0, rank, global_batch=args.global_batch, per_rank=per_rank,
                                  micro=args.micro)
            batches = [blocks.take(idx) for idx in sched.next_micro_batches()]
            out.update(blocks=len(blocks), max_id=top)
        if args.child != "imports":
            assert sum(len(b) for b in batches) == per_rank and batches[0].dtype == torch.int64
    except MemoryError:
        out["over_cap"] = True
    out["seconds"] = time.perf_counter() - t0
    out["start_s"] = time.time() - launched
    for line in open("/proc/self/status"):  # what is resident at the end: private memory vs mapped file pages
        if line.startswith(("RssAnon:", "RssFile:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- the parent

def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def watched(argv: list[str], cap: int, timeout: float, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run argv (in the repo, this checkout first on PYTHONPATH), polling the resident set of it and its
    children; kill it over `cap` bytes."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, cwd=REPO,
                                env={**(os.environ if env is None else env), "PYTHONPATH": str(REPO)})
        ps = psutil.Process(proc.pid)
        peak, over = 0, False
        try:
            while proc.poll() is None:
                try:
                    rss = tree_rss(ps)
                except psutil.Error:
                    rss = 0
                peak = max(peak, rss)
                if cap and rss > cap:
                    over = True
                    break
                if time.perf_counter() - t0 > timeout:
                    break
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                for p in ps.children(recursive=True):
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                proc.kill()
            proc.wait()
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return {"code": proc.returncode, "stdout": out.read(), "stderr": err.read(), "wall": wall,
                "tree_peak": peak, "over": over, "timed_out": not over and wall > timeout}


def rank_run(args: argparse.Namespace, mode: str, path: Optional[Path], model: Path) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--model", str(model),
            "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch), "--world", str(args.world),
            "--micro", str(args.micro), "--mem-cap", str(args.mem_cap)]
    if path is not None:
        argv += ["--path", str(path)]
    argv += ["--launched", repr(time.time())]
    res = watched(argv, args.mem_cap, args.timeout)
    lines = [ln for ln in res["stdout"].splitlines() if ln.startswith("{")]
    rec: dict[str, Any] = json.loads(lines[-1]) if lines and res["code"] == 0 else {}
    if res["over"] or rec.get("over_cap"):
        return {"over": True, "seconds": rec.get("seconds", res["wall"]), "start_s": rec.get("start_s", res["wall"]),
                "peak_rss": max(res["tree_peak"], args.mem_cap)}
    if not rec:
        tail = (res["stderr"] or res["stdout"]).strip().splitlines()[-5:]
        sys.exit(f"{mode} rank on {path} failed (exit {res['code']}"
                 f"{', timed out' if res['timed_out'] else ''}):\n" + "\n".join(tail))
    return rec


def reusable(src: Path, dest: Path) -> Optional[dict[str, Any]]:
    """The manifest of a complete prepared folder made from this very corpus file, else None."""
    try:
        manifest = json.loads((dest / "manifest.json").read_text())
        rec = manifest["sources"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    st = src.stat()
    if rec.get("size") != st.st_size or rec.get("mtime_ns") != st.st_mtime_ns or not (dest / "tokens.bin").is_file():
        return None
    return manifest


def prepare_once(args: argparse.Namespace, src: Path, dest: Path) -> dict[str, Any]:
    """`hpcgpu data prepare --input SRC -o DEST` (byte-level tokenizer), timed; peak RSS of its process tree."""
    old = reusable(src, dest) if args.reuse_prepared else None
    if old is not None:
        return {"wall": None, "tree_peak": None, "tokens": old["num_tokens"], "docs": old["num_documents"],
                "seconds": old["seconds"], "tokens_bin": (dest / "tokens.bin").stat().st_size}
    argv = [sys.executable, "-m", "hpcgpu", "data", "prepare", "--input", str(src), "-o", str(dest)]
    if args.prepare_workers:
        argv += ["--workers", str(args.prepare_workers)]
    res = watched(argv, args.mem_cap, args.timeout)
    if res["code"] != 0:
        tail = (res["stderr"] or res["stdout"]).strip().splitlines()[-5:]
        sys.exit(f"hpcgpu data prepare {src} failed (exit {res['code']}{', over the cap' if res['over'] else ''}):\n"
                 + "\n".join(tail))
    manifest = json.loads((dest / "manifest.json").read_text())
    return {"wall": res["wall"], "tree_peak": res["tree_peak"], "tokens": manifest["num_tokens"],
            "docs": manifest["num_documents"], "seconds": manifest["seconds"],
            "tokens_bin": (dest / "tokens.bin").stat().st_size}


def fmt_spread(values: list[float], unit: str, scale: float = 1.0, digits: int = 2) -> str:
    vals = [v / scale for v in values]
    med = statistics.median(vals)
    if len(vals) == 1:
        return f"{med:,.{digits}f} {unit}"
    return f"{med:,.{digits}f} [{min(vals):,.{digits}f}-{max(vals):,.{digits}f}] {unit}"


def seconds(values: list[float]) -> str:
    return fmt_spread(values, "s", 1.0, 3 if statistics.median(values) < 1 else 2)


def cell(runs: list[dict[str, Any]], what: str, cap: int) -> str:
    if any(r.get("over") for r in runs):
        if what == "rss":
            return f"over {cap / GIB:.3g} GiB: stopped"
        return f"stopped after {runs[0]['start_s']:.1f} s"
    if what == "rss":
        return fmt_spread([r["peak_rss"] for r in runs], "MiB", MIB, 0)
    return f"{seconds([r['start_s'] for r in runs])} (data {seconds([r['seconds'] for r in runs])})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10M,100M,1G", help="corpus sizes, decimal (default 10M,100M,1G)")
    ap.add_argument("--work", type=Path, default=None,
                    help="keeps the corpora and prepared folders between runs (default: "
                         "$TMPDIR/hpcgpu-data-bench; --smoke: a temporary dir, removed)")
    ap.add_argument("--repeats", type=int, default=1, help="rank runs per size and path (default 1)")
    ap.add_argument("--mem-cap", type=parse_bytes, default=8 * GIB, help="stop a rank over this RSS (default 8G)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=256, help="sequences per step, all ranks (default 256)")
    ap.add_argument("--world", type=int, default=8, help="ranks the global batch is split over (default 8)")
    ap.add_argument("--micro", type=int, default=8, help="micro batch per rank (default 8)")
    ap.add_argument("--prepare-workers", type=int, default=None, help="hpcgpu data prepare --workers")
    ap.add_argument("--reuse-prepared", action="store_true",
                    help="use a prepared folder in --work made from the same corpus file (prepare not timed)")
    ap.add_argument("--paths", default="raw,prepared", help="which rank paths to run (default raw,prepared)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child (default 900)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and batches: checks the script end to end")
    ap.add_argument("--child", choices=["raw", "prepared", "imports"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--launched", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.smoke:
        args.sizes, args.seq_len, args.global_batch, args.world, args.micro = "150K,300K", 64, 16, 2, 4
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not args.paths or set(args.paths) - {"raw", "prepared"}:
        ap.error("--paths: raw, prepared or both")
    if args.global_batch % args.world or (args.global_batch // args.world) % args.micro:
        ap.error("--global-batch must split into --world ranks of whole --micro batches")
    temp = tempfile.mkdtemp(prefix="data-scaling-") if args.smoke and args.work is None else None
    work = Path(temp or args.work or Path(tempfile.gettempdir()) / "hpcgpu-data-bench").absolute()
    try:
        run(args, sizes, work)
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


def run(args: argparse.Namespace, sizes: list[int], work: Path) -> None:
    model = bytes_model(work)
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, {psutil.virtual_memory().total / GIB:.1f} GiB RAM, "
          f"Python {platform.python_version()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"# rank 0 of {args.world}: seq_len {args.seq_len}, global batch {args.global_batch} "
          f"({args.global_batch // args.world} per rank, micro {args.micro}); byte-level tokenizer; "
          f"memory cap {args.mem_cap / GIB:.3g} GiB; {args.repeats} repeat(s)", flush=True)
    srcs = {size: corpus(work, size) for size in sizes}
    prepared: dict[int, dict[str, Any]] = {}
    for size, src in srcs.items():
        dest = work / f"prepared-{label(size)}"
        prepared[size] = prepare_once(args, src, dest)
        p = prepared[size]
        if p["wall"] is None:
            print(f"# prepared {label(size)}: reused {dest} ({p['tokens']:,} tokens; its prepare took "
                  f"{p['seconds']:.2f} s)", flush=True)
            continue
        print(f"# prepared {label(size)}: {p['tokens']:,} tokens, {p['docs']:,} documents in {p['wall']:.2f} s "
              f"(prepare's own {p['seconds']:.2f} s, {p['tokens'] / p['seconds']:,.0f} tokens/s), "
              f"process tree peak RSS {p['tree_peak'] / MIB:,.0f} MiB", flush=True)
    base = [rank_run(args, "imports", None, model) for _ in range(max(1, min(args.repeats, 3)))]
    print(f"# imports only (python, torch, numpy, hpcgpu.runtime.data): launch to imports done "
          f"{fmt_spread([r['start_s'] for r in base], 's')} (the imports {fmt_spread([r['imports_s'] for r in base], 's')}), "
          f"peak RSS {fmt_spread([r['peak_rss'] for r in base], 'MiB', MIB, 0)}", flush=True)
    results: dict[int, dict[str, list[dict[str, Any]]]] = {size: {"raw": [], "prepared": []} for size in sizes}
    for rep in range(args.repeats):
        for size in sizes:
            order = ["raw", "prepared"] if rep % 2 == 0 else ["prepared", "raw"]  # interleaved, order alternating
            for mode in order:
                if mode not in args.paths:
                    continue
                done = results[size][mode]
                if mode == "raw" and any(r.get("over") for r in done):
                    continue  # over the cap once: it will be again
                path = srcs[size] if mode == "raw" else work / f"prepared-{label(size)}"
                rec = rank_run(args, mode, path, model)
                done.append(rec)
                what = (f"over {args.mem_cap / GIB:.3g} GiB after {rec['seconds']:.1f} s" if rec.get("over") else
                        f"launch to first batch {rec['start_s']:.2f} s (data {rec['seconds']:.3f} s), peak RSS "
                        f"{rec['peak_rss'] / MIB:,.0f} MiB (at the end: private {rec.get('RssAnon', 0) / MIB:,.0f}, "
                        f"file pages {rec.get('RssFile', 0) / MIB:,.0f} MiB)")
                print(f"#   repeat {rep + 1} {label(size)} {mode}: {what}", flush=True)
    report(args, sizes, results, prepared)


def report(args: argparse.Namespace, sizes: list[int], results: dict[int, dict[str, list[dict[str, Any]]]],
           prepared: dict[int, dict[str, Any]]) -> None:
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    print()
    print("| size | tokens | raw: time to first batch | raw: peak RSS | prepared: time to first batch "
          "| prepared: peak RSS | raw/prepared time | raw/prepared RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        raw, prep = results[size]["raw"], results[size]["prepared"]
        over = "> " if any(r.get("over") for r in raw) else ""
        both = raw and prep
        rt = f"{over}{med(raw, 'start_s') / med(prep, 'start_s'):,.1f}x" if both else "-"
        rr = f"{over}{med(raw, 'peak_rss') / med(prep, 'peak_rss'):,.1f}x" if both else "-"
        cells = [cell(runs, what, args.mem_cap) if runs else "-" for runs, what in
                 ((raw, "time"), (raw, "rss"), (prep, "time"), (prep, "rss"))]
        print(f"| {label(size)} | {prepared[size]['tokens']:,} | {' | '.join(cells)} | {rt} | {rr} |")
    print()
    print("| size | prepare (once): wall | tokens/s | process tree peak RSS | tokens.bin |")
    print("|---|---|---|---|---|")
    for size in sizes:
        p = prepared[size]
        if p["wall"] is None:
            print(f"| {label(size)} | reused (made in {p['seconds']:.2f} s) | - | - "
                  f"| {p['tokens_bin'] / MIB:,.1f} MiB |")
            continue
        print(f"| {label(size)} | {p['wall']:.2f} s | {p['tokens'] / p['wall']:,.0f} | {p['tree_peak'] / MIB:,.0f} MiB "
              f"| {p['tokens_bin'] / MIB:,.1f} MiB |")
    print()
    lo, hi = sizes[0], sizes[-1]
    plo, phi = results[lo]["prepared"], results[hi]["prepared"]
    if not (plo and phi):
        print("verdict: - (the prepared path was not run)")
        return
    dt = (med(phi, "start_s") - med(plo, "start_s")) / med(plo, "start_s")
    dm = (med(phi, "peak_rss") - med(plo, "peak_rss")) / med(plo, "peak_rss")
    ddata = (med(phi, "seconds") - med(plo, "seconds")) * 1000
    flat_t, flat_m = abs(dt) <= FLAT, abs(dm) <= FLAT
    print(f"prepared rank, data part alone: {med(plo, 'seconds') * 1000:.1f} ms at {label(lo)}, "
          f"{med(phi, 'seconds') * 1000:.1f} ms at {label(hi)} ({ddata:+.1f} ms)")
    print(f"verdict: prepared rank from {label(lo)} to {label(hi)} ({hi / lo:,.0f}x the data): "
          f"time to first batch {dt * 100:+.1f}% ({'flat' if flat_t else 'NOT flat'}), peak RSS {dm * 100:+.1f}% "
          f"({'flat' if flat_m else 'NOT flat'}); within {FLAT * 100:.0f}%: "
          f"{'met' if flat_t and flat_m else 'NOT met'}")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
