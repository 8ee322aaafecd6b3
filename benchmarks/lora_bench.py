"""LoRA fine-tuning throughput of hpcgpu's train task against a hand-written peft loop and transformers'
Trainer + peft, and the peak GPU memory of full fine-tuning, LoRA and QLoRA side by side (issue #35).

    # on a GPU machine (PYTHONPATH=<this checkout>:<peft, bitsandbytes> where they are not installed):
    PYTHONPATH=$PWD python benchmarks/lora_bench.py [--rounds 3] [--seconds 20] [--work /tmp/lora-bench]
    # only the memory table, or only the throughput rounds:
    PYTHONPATH=$PWD python benchmarks/lora_bench.py --no-throughput
    PYTHONPATH=$PWD python benchmarks/lora_bench.py --memory ""
    # everything tiny on the CPU (2 layers, 64 hidden), to check the script end to end; measures nothing:
    python benchmarks/lora_bench.py --smoke

The model: Llama-3.2-1B's shape (HF LlamaForCausalLM from a config, random weights, sdpa, tied
embeddings: 16 layers, 2048 hidden, 32 heads, 8 KV heads, MLP 8192, vocab 128256, 1.24B params), its
weights in --base-dtype (default float32, hpcgpu's default model.dtype), seq --seq-len 2048, micro batch
--micro-batch 4 (accumulation 1), LoRA r=16 alpha=32 dropout 0.05 on every linear layer of the blocks
(peft's all-linear), bf16 autocast, AdamW (fused) on the adapters only, lr 2e-4 with 10 warmup steps,
grad clip 1.0, torch.compile on (--no-compile: off everywhere). The data: one file of random ASCII
bytes (--data-tokens, default 4M): hpcgpu reads it with its byte tokenizer (a token a byte), the two
others read the same bytes as token ids, cut into the same seq-len blocks.

The three programs, each in a fresh process, one GPU, in interleaved rounds (the order rotating):
    peft      a hand-written loop: get_peft_model, AdamW on the trainable parameters, the blocks on the
              GPU, model(input_ids, labels).loss under bf16 autocast, backward, clip, step, zero_grad;
              the peft model compiled whole (torch.compile)
    trainer   transformers' Trainer on the same peft model: TrainingArguments(bf16=True, torch_compile=True,
              per_device_train_batch_size=micro, max_grad_norm 1.0, cosine, logging_steps 10), a Dataset
              of the blocks, 2 loader workers
    hpcgpu    `python -m hpcgpu submit SPEC --executor local --new`, task: train, model.config the same
              shape, train.lora the same, data.train the file, precision bf16, compile true, gradient
              checkpointing off, log_every 10; its steps: enough for --seconds at the step time measured so
              far (the peft loop's in the first round)

Each run does --warmup untimed steps (compile included), then steps until --seconds of them have
passed, in intervals of 10 steps timed on the GPU's clock (CUDA events; hpcgpu: its metrics.jsonl
records, as benchmarks/train_vs_loops.py reads them). tok/s = tokens of the timed steps / their time.
Printed: median [min-max] of tok/s per program, and hpcgpu / peft and hpcgpu / trainer of the medians
with the range of the per-round ratios (the issue's target: >= 1.0 against both).

Memory (--memory, default "full,lora,lora-gc,qlora"): one process, each variant in turn, 3 eager steps
(no compile) of micro x seq tokens, torch.cuda.max_memory_allocated after each variant's steps, the
allocator emptied between them: full = every weight trained (fp32 weights, AdamW states, bf16
autocast), lora = the LoRA of the throughput runs, lora-gc = with gradient checkpointing, qlora = the
base saved (bf16) and loaded in 4 bits (NF4, bitsandbytes, bf16 compute), peft's
prepare_model_for_kbit_training, gradient checkpointing (non-reentrant), the same adapters (the
issue's target: qlora <= 40% of full). --memory-hpcgpu also runs hpcgpu's train task 4 steps
uncompiled for full, lora and qlora and reads its peak_mem_gib (max_memory_allocated too).

This driver never touches CUDA (hpcgpu's busy-GPU check would see it); workers are its own children
(--worker). --deadline S: no run starts that the longest of its kind so far says would end past S
seconds after the start; what was measured is reported. The JSON report: --json (default
$OUT/lora_bench.json where $OUT is set).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import ratio_of_runs, gpu_name, rotated, spread, train_model_config, work_dir
from train_vs_loops import RunFailed, hpcgpu_timed, launch, on_sigterm, random_text, read_records, tail

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = ["peft", "trainer", "hpcgpu"]
MEMORY = ["full", "lora", "lora-gc", "qlora"]
LLAMA_1B = {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_kv_head": 8, "intermediate": 8192, "vocab": 128256,
            "seq_len": 2048, "micro_batch": 4}
SMOKE = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "intermediate": 128, "vocab": 512,
         "seq_len": 64, "micro_batch": 4}
INTERVAL = 10  # steps per timed interval, and hpcgpu's log_every
TARGET_RATIO, TARGET_QLORA_SHARE = 1.0, 0.40
ORIG_ENV = dict(os.environ)


def note(msg: str) -> None:
    print(f"[lora_bench] {msg}", file=sys.stderr, flush=True)


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return train_model_config("llama-1b", args)


# ---------------------------------------------------------------- workers (torch)

def worker_setup(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return torch, device


def build_base(args: argparse.Namespace, device: Any) -> Any:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    mapping = model_config(args)
    mapping.pop("model_type")
    cfg = AutoConfig.for_model("llama", **mapping)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(getattr(torch, args.base_dtype)).train()


def lora_config(args: argparse.Namespace) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def token_blocks(args: argparse.Namespace, device: Any) -> Any:
    """The data file's bytes as token ids, in seq-len blocks (what hpcgpu's byte tokenizer gives)."""
    import numpy as np
    import torch

    raw = np.fromfile(args.data, dtype=np.uint8)
    n = len(raw) // args.seq_len
    return torch.from_numpy(raw[: n * args.seq_len].astype(np.int64)).view(n, args.seq_len).to(device)


def lr_lambda(warmup: int, total: int = 10_000) -> Any:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / total)))
    return f


class Timer:
    """CUDA events every INTERVAL steps after the warmup (the host clock on CPU); stop once --seconds of
    host time have passed at an interval's end."""

    def __init__(self, torch: Any, device: Any, seconds: float):
        self.torch, self.cuda, self.seconds = torch, device.type == "cuda", seconds
        self.marks: list[Any] = []
        self.t0: float | None = None

    def mark(self) -> None:
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        if self.t0 is None:
            self.t0 = time.perf_counter()

    def after(self, timed_steps: int) -> bool:
        """Called after each timed step (1, 2, ...); True: stop here."""
        if timed_steps % INTERVAL:
            return False
        self.mark()
        return time.perf_counter() - (self.t0 or 0) >= self.seconds

    def result(self, tokens_per_step: int) -> dict[str, Any]:
        if self.cuda:
            self.torch.cuda.synchronize()
            ms = [a.elapsed_time(b) / INTERVAL for a, b in zip(self.marks, self.marks[1:])]
        else:
            ms = [(b - a) * 1000 / INTERVAL for a, b in zip(self.marks, self.marks[1:])]
        if not ms:
            raise RuntimeError("no timed interval: --seconds too short")
        seconds = sum(ms) * INTERVAL / 1000
        steps = len(ms) * INTERVAL
        return {"tokens_per_s": steps * tokens_per_step / seconds, "ms_per_step": 1000 * seconds / steps,
                "timed_s": seconds, "timed_steps": steps,
                "interval_ms": {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "first": ms[0],
                                "last": ms[-1]}}


def peak_gib(torch: Any, device: Any) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def autocast(torch: Any, device: Any, args: argparse.Namespace) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")


def worker_peft(args: argparse.Namespace) -> dict[str, Any]:
    """The hand-written peft loop."""
    torch, device = worker_setup(args)
    from peft import get_peft_model

    model = get_peft_model(build_base(args, device), lora_config(args))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10))
    fwd = torch.compile(model) if args.compile else model
    blocks = token_blocks(args, device)
    n, micro = blocks.shape[0], args.micro_batch
    timer, step, loss = Timer(torch, device, args.seconds), 0, None
    while True:
        start = (step * micro) % (n - micro)
        x = blocks[start:start + micro]
        with autocast(torch, device, args):
            loss = fwd(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == args.warmup:
            timer.mark()
        elif step > args.warmup and timer.after(step - args.warmup):
            break
    res = timer.result(micro * args.seq_len)
    res.update(final_loss=float(loss.item()), peak_mem_gib=peak_gib(torch, device),
               trainable=sum(p.numel() for p in params), params=sum(p.numel() for p in model.parameters()))
    return res


def worker_trainer(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' Trainer on the same peft model and data."""
    torch, device = worker_setup(args)
    from peft import get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = get_peft_model(build_base(args, device), lora_config(args))
    blocks = token_blocks(args, "cpu")

    class Blocks(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return blocks.shape[0]

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": blocks[i], "labels": blocks[i]}

    timer = Timer(torch, device, args.seconds)

    class Clock(TrainerCallback):
        def on_step_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> Any:
            step = state.global_step
            if step == args.warmup:
                timer.mark()
            elif step > args.warmup and timer.after(step - args.warmup):
                control.should_training_stop = True
            return control

    on_gpu = device.type == "cuda"
    targs = TrainingArguments(
        output_dir=str(Path(args.work) / "trainer-out"), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=1, max_steps=1_000_000, learning_rate=args.lr, weight_decay=0.1,
        adam_beta2=0.95, warmup_steps=10, lr_scheduler_type="cosine", max_grad_norm=1.0,
        bf16=args.precision == "bf16" and on_gpu, torch_compile=bool(args.compile), logging_steps=INTERVAL,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=2 if on_gpu else 0,
        dataloader_pin_memory=on_gpu, remove_unused_columns=False, seed=args.seed, use_cpu=not on_gpu)
    trainer = Trainer(model=model, args=targs, train_dataset=Blocks(), callbacks=[Clock()])
    out = trainer.train()
    res = timer.result(args.micro_batch * args.seq_len)
    res.update(final_loss=float(out.training_loss), peak_mem_gib=peak_gib(torch, device),
               optim=str(targs.optim))
    return res


def save_base(args: argparse.Namespace, device: Any) -> Path:
    """The random base saved in bf16 as a Hugging Face folder (QLoRA loads its base from one)."""
    import torch

    folder = Path(args.work) / "base-llama-1b"
    if (folder / "config.json").exists():
        return folder
    model = build_base(args, device).to(torch.bfloat16)
    model.save_pretrained(str(folder) + ".tmp", safe_serialization=True)
    os.replace(str(folder) + ".tmp", folder)
    del model
    return folder


def memory_variant(args: argparse.Namespace, torch: Any, device: Any, variant: str) -> dict[str, Any]:
    from peft import get_peft_model, prepare_model_for_kbit_training

    gc_kwargs = {"use_reentrant": False}
    if variant == "qlora":
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        base = AutoModelForCausalLM.from_pretrained(
            save_base(args, device), dtype=torch.bfloat16, device_map={"": str(device)},
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16))
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=True,
                                               gradient_checkpointing_kwargs=gc_kwargs)
        torch.cuda.reset_peak_memory_stats(device)  # the load's own transient peak is not training's
    else:
        base = build_base(args, device)
        if variant == "lora-gc":
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
            base.enable_input_require_grads()
    model = base if variant == "full" else get_peft_model(base, lora_config(args))
    model.train()  # from_pretrained's model is in eval mode: Hugging Face checkpoints only in training
    model.config.use_cache = False
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    blocks = token_blocks(args, device)
    weights = torch.cuda.memory_allocated(device)
    for step in range(3):
        x = blocks[step * args.micro_batch:(step + 1) * args.micro_batch]
        with autocast(torch, device, args):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    out = {"variant": variant, "peak_gib": peak_gib(torch, device), "weights_gib": weights / 2**30,
           "trainable": sum(p.numel() for p in params), "loss": float(loss.item())}
    del model, base, opt, params, blocks, loss, x
    return out


def worker_memory(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    torch, device = worker_setup(args)
    if device.type != "cuda":
        raise RuntimeError("the memory table needs a GPU")
    out = []
    if "qlora" in args.memory_list:
        save_base(args, device)
    for variant in args.memory_list:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        left = torch.cuda.memory_allocated(device)
        try:
            r = memory_variant(args, torch, device, variant)
        except torch.OutOfMemoryError as exc:
            r = {"variant": variant, "error": f"out of memory: {str(exc)[:200]}"}
        r["left_before_gib"] = left / 2**30
        note(f"memory {variant}: {json.dumps(r)}")
        out.append(r)
    return {"memory": out}


WORKERS = {"peft": worker_peft, "trainer": worker_trainer, "memory": worker_memory}


# ---------------------------------------------------------------- the driver (no torch)

def child_env(args: argparse.Namespace, work: Path) -> dict[str, str]:
    env = dict(ORIG_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "benchmarks")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["HPCGPU_REGISTRY"] = str(work / "jobs.db")
    env["NCCL_NVLS_ENABLE"] = "0"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")  # shared: rounds after the first are warm
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not args.smoke:
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")  # one GPU (the Trainer would take every visible one)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "2")
    return env


def worker_cmd(args: argparse.Namespace, which: str, work: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", which, "--work", str(work),
           "--data", str(args.data), "--seconds", str(args.seconds), "--warmup", str(args.warmup),
           "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--r", str(args.r),
           "--alpha", str(args.alpha), "--dropout", str(args.dropout), "--lr", str(args.lr),
           "--base-dtype", args.base_dtype, "--precision", args.precision, "--memory", ",".join(args.memory_list),
           "--compile" if args.compile else "--no-compile"]
    return cmd + (["--smoke"] if args.smoke else [])


def run_worker(args: argparse.Namespace, which: str, work: Path, tag: str) -> dict[str, Any]:
    cmd = worker_cmd(args, which, work)
    rc, t_launch, out, err = launch(cmd, child_env(args, work), work / "logs" / f"{tag}-{which}", args.timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        raise RunFailed(f"{which} failed (exit {rc}):\n{tail(out, 1000)}\n{tail(err)}")
    res = json.loads(lines[-1])
    res["wall_s"] = time.time() - t_launch
    return res


def hpcgpu_spec(args: argparse.Namespace, work: Path, name: str, max_steps: int, log_every: int,
                variant: str = "lora", compile_: bool | None = None) -> Path:
    model: dict[str, Any] = {"config": model_config(args), "dtype": args.base_dtype}
    train: dict[str, Any] = {
        "global_batch_size": args.micro_batch, "micro_batch_size": args.micro_batch, "max_steps": max_steps,
        "log_every": log_every, "warmup_steps": 10, "lr": args.lr, "min_lr_ratio": 0.1, "weight_decay": 0.1,
        "grad_clip": 1.0, "precision": args.precision, "eval_every": 0, "seed": args.seed,
        "compile": bool(args.compile if compile_ is None else compile_), "gradient_checkpointing": False}
    if variant in ("lora", "qlora"):
        train["lora"] = {"r": args.r, "alpha": args.alpha, "dropout": args.dropout, "target_modules": "auto"}
    if variant == "qlora":
        model = {"name_or_path": str(work / "base-llama-1b"), "quantization": "int4"}
        train["gradient_checkpointing"] = "auto"  # the plan turns it on for QLoRA
    spec = {"name": name, "task": "train", "runs_dir": str(work / "runs"),
            "resources": {"gpus": 1, "cpus_per_gpu": 1 if args.smoke else 4},
            "model": model, "data": {"train": str(args.data), "seq_len": args.seq_len}, "train": train}
    path = work / f"{name}.spec.json"
    path.write_text(json.dumps(spec, indent=1) + "\n")
    return path


def run_hpcgpu(args: argparse.Namespace, work: Path, name: str, warmup: int, steps: int, tag: str,
               variant: str = "lora", compile_: bool | None = None, log_every: int = INTERVAL) -> dict[str, Any]:
    spec = hpcgpu_spec(args, work, name, warmup + steps, log_every, variant, compile_)
    cmd = [sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new"]
    rc, t_launch, out, err = launch(cmd, child_env(args, work), work / "logs" / f"{tag}-{name}", args.timeout)
    if rc != 0:
        raise RunFailed(f"hpcgpu {name} failed (exit {rc}):\n{tail(out, 1500)}\n{tail(err)}")
    run_dir = max((work / "runs" / name).iterdir(), key=lambda p: p.stat().st_mtime)
    recs = read_records(run_dir)
    res: dict[str, Any] = {"run_dir": str(run_dir), "wall_s": time.time() - t_launch}
    train = [r for r in recs if r.get("kind") == "train"]
    res["peak_mem_gib"] = max((r.get("peak_mem_gib") or 0.0) for r in train) if train else None
    plan = [ln for ln in (out + "\n" + err).splitlines() if "run plan:" in ln or " model " in ln and "params" in ln]
    res["plan"] = plan[:2]
    if steps and variant == "lora" and compile_ is None:
        res.update(hpcgpu_timed(recs, warmup, steps))
    return res


def hpcgpu_steps(args: argparse.Namespace, ms_per_step: float) -> int:
    """Timed steps for --seconds at that step time (25% over: it may run faster), a multiple of the interval."""
    want = args.seconds * 1.25 * 1000 / ms_per_step
    return max(INTERVAL, int(math.ceil(want / INTERVAL)) * INTERVAL)


def report(args: argparse.Namespace, rep: dict[str, Any]) -> None:
    print(f"\n== LoRA r={args.r} on all-linear, Llama-3.2-1B shape, seq {args.seq_len}, micro {args.micro_batch}, "
          f"base {args.base_dtype}, {args.precision}, compile {'on' if args.compile else 'off'}; {rep['gpu']}, "
          f"torch {rep.get('torch', '?')}, transformers {rep.get('transformers', '?')}, peft {rep.get('peft', '?')}")
    res = rep["throughput"]
    if res:
        print(f"{'program':<9} {'tok/s median [min-max]':>30} {'ms/step':>10} {'timed s':>16} {'peak GiB':>9} runs")
        for p in PROGRAMS:
            runs = res.get(p, [])
            if not runs:
                continue
            m, lo, hi = spread([r["tokens_per_s"] for r in runs])
            ms = statistics.median(r["ms_per_step"] for r in runs)
            ts = [r["timed_s"] for r in runs]
            pk = [r.get("peak_mem_gib") for r in runs if r.get("peak_mem_gib")]
            print(f"{p:<9} {f'{m:,.0f} [{lo:,.0f}-{hi:,.0f}]':>30} {ms:>10.1f} "
                  f"{f'{min(ts):.1f}-{max(ts):.1f}':>16} {(f'{max(pk):.1f}' if pk else '-'):>9} {len(runs)}")
        for other in ("peft", "trainer"):
            r = rep["ratios"].get(f"hpcgpu/{other}")
            if r:
                pr = r["per_round"]
                verdict = "PASS" if r["of_medians"] >= TARGET_RATIO else "FAIL"
                print(f"hpcgpu / {other}: {r['of_medians']:.3f} of the medians"
                      + (f" [per round {min(pr):.3f}-{max(pr):.3f}]" if pr else "")
                      + f"  target >= {TARGET_RATIO:.2f}: {verdict}")
        if len(next(iter(res.values()), [])) < 3:
            print("(fewer than 3 rounds: the issue asks 3)")
    mem = rep.get("memory") or []
    if mem:
        full = next((m.get("peak_gib") for m in mem if m["variant"] == "full" and m.get("peak_gib")), None)
        print(f"\n== peak GPU memory (max_memory_allocated), micro {args.micro_batch} x seq {args.seq_len}, eager, "
              "3 steps, hand-written")
        for m in mem:
            if "error" in m:
                print(f"{m['variant']:<8} {m['error']}")
                continue
            share = f"{m['peak_gib'] / full:.1%} of full" if full else ""
            print(f"{m['variant']:<8} {m['peak_gib']:>7.2f} GiB  (weights etc. before the steps {m['weights_gib']:.2f} "
                  f"GiB, {m['trainable'] / 1e6:.1f}M trained)  {share}")
        q = next((m.get("peak_gib") for m in mem if m["variant"] == "qlora" and m.get("peak_gib")), None)
        if full and q:
            print(f"qlora / full: {q / full:.3f}  target <= {TARGET_QLORA_SHARE:.2f}: "
                  f"{'PASS' if q / full <= TARGET_QLORA_SHARE else 'FAIL'}")
    hm = rep.get("memory_hpcgpu") or {}
    if hm:
        print("\n== hpcgpu's own peak_mem_gib (4 steps, not compiled)")
        full = hm.get("full", {}).get("peak_mem_gib")
        for k, v in hm.items():
            if "error" in v:
                print(f"{k:<8} {v['error'][:300]}")
            else:
                share = f"  {v['peak_mem_gib'] / full:.1%} of full" if full else ""
                print(f"{k:<8} {v['peak_mem_gib']:.2f} GiB{share}")


def versions(args: argparse.Namespace, work: Path) -> dict[str, str]:
    import subprocess

    code = ("import json, torch, transformers, peft; print(json.dumps({'torch': torch.__version__, "
            "'transformers': transformers.__version__, 'peft': peft.__version__}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(args, work))
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--seconds", type=float, default=20.0, help="timed seconds per run after the warmup (default 20)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first, compile included (a multiple of 10)")
    ap.add_argument("--programs", default=",".join(PROGRAMS), help="subset of peft,trainer,hpcgpu (default all)")
    ap.add_argument("--no-throughput", action="store_true", help="only the memory table")
    ap.add_argument("--memory", default=",".join(MEMORY), help="variants of the memory table ('' for none)")
    ap.add_argument("--memory-hpcgpu", action="store_true", help="also hpcgpu's peak for full, lora and qlora")
    ap.add_argument("--hpcgpu-memory-variants", default="full,lora,qlora", help="those of --memory-hpcgpu")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 2048")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default bf16 (fp32 with --smoke)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default on (off smoke)")
    ap.add_argument("--data-tokens", type=int, default=4_000_000)
    ap.add_argument("--est-ms", type=float, default=200.0, help="hpcgpu's step time before one is measured")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from the start: no run started past it")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds a run may take")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny Llama on the CPU, 2 s runs, 1 round: checks the script")
    ap.add_argument("--worker", choices=list(WORKERS), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = SMOKE if args.smoke else LLAMA_1B
    for key in ("n_layer", "n_embd", "n_head", "n_kv_head", "intermediate", "vocab"):
        setattr(args, key, shape[key])
    args.seq_len = args.seq_len or shape["seq_len"]
    args.micro_batch = args.micro_batch or shape["micro_batch"]
    args.precision = args.precision or ("fp32" if args.smoke else "bf16")
    args.compile = (not args.smoke) if args.compile is None else args.compile
    args.memory_list = [m for m in args.memory.split(",") if m]
    if args.smoke:
        args.seconds, args.rounds, args.data_tokens = min(args.seconds, 2.0), min(args.rounds, 1), 200_000
        args.memory_list = []
    if args.worker:
        res = WORKERS[args.worker](args)
        print(json.dumps(res), flush=True)
        return 0

    signal.signal(signal.SIGTERM, on_sigterm)
    t_start = time.time()
    programs = [p for p in args.programs.split(",") if p]
    with work_dir(args.work, "lora-bench-") as work:
        args.data = work / f"random-{args.data_tokens}.txt"
        if not args.data.exists():
            random_text(args.data, args.data_tokens, args.seed)
        rep: dict[str, Any] = {"gpu": gpu_name(argparse.Namespace(cpu=args.smoke)), "setup": {
            k: getattr(args, k) for k in ("seq_len", "micro_batch", "r", "alpha", "dropout", "lr", "base_dtype",
                                          "precision", "compile", "seconds", "warmup", "data_tokens")},
            "throughput": {}, "ratios": {}, "memory": [], "memory_hpcgpu": {}, "failures": []}
        rep.update(versions(args, work))
        out_json = args.json or (Path(os.environ["OUT"]) / "lora_bench.json" if os.environ.get("OUT") else None)

        def save() -> None:
            if out_json is not None:
                out_json.parent.mkdir(parents=True, exist_ok=True)
                out_json.write_text(json.dumps(rep, indent=1) + "\n")

        longest: dict[str, float] = {}

        def fits(kind: str, default: float) -> bool:
            if args.deadline is None:
                return True
            need = longest.get(kind, default)
            left = args.deadline - (time.time() - t_start)
            if need > left:
                note(f"deadline: {kind} needs ~{need:.0f} s, {left:.0f} s left: not started")
                return False
            return True

        if args.memory_list and fits("memory", 90):
            try:
                r = run_worker(args, "memory", work, "mem")
                rep["memory"] = r["memory"]
                longest["memory"] = r["wall_s"]
            except RunFailed as exc:
                rep["failures"].append(str(exc)[-3000:])
                note(str(exc))
            save()
        if args.memory_hpcgpu:
            for variant in [v for v in args.hpcgpu_memory_variants.split(",") if v]:
                if not fits("hpcgpu-memory", 60):
                    break
                t0 = time.time()
                try:
                    r = run_hpcgpu(args, work, f"mem-{variant}", 0, 4, "mem", variant=variant, compile_=False,
                                   log_every=1)
                    rep["memory_hpcgpu"][variant] = {"peak_mem_gib": r["peak_mem_gib"], "plan": r["plan"]}
                except RunFailed as exc:
                    rep["memory_hpcgpu"][variant] = {"error": str(exc)[-3000:]}
                    note(str(exc))
                longest["hpcgpu-memory"] = max(longest.get("hpcgpu-memory", 0), time.time() - t0)
                save()

        ms_known: dict[str, float] = {}
        for rnd in range(0 if args.no_throughput else args.rounds):
            for program in rotated(programs, rnd):
                if not fits(program, max(longest.values(), default=150)):
                    continue
                t0 = time.time()
                try:
                    if program == "hpcgpu":
                        ms = ms_known.get("hpcgpu") or min(ms_known.values(), default=args.est_ms)
                        steps = hpcgpu_steps(args, ms)
                        r = run_hpcgpu(args, work, "lora-hpcgpu", args.warmup, steps, f"r{rnd}")
                    else:
                        r = run_worker(args, program, work, f"r{rnd}")
                except RunFailed as exc:
                    rep["failures"].append(f"round {rnd} {program}: {str(exc)[-3000:]}")
                    note(f"round {rnd} {program}: {exc}")
                    continue
                finally:
                    longest[program] = max(longest.get(program, 0), time.time() - t0)
                r["round"] = rnd
                ms_known[program] = r["ms_per_step"]
                rep["throughput"].setdefault(program, []).append(r)
                note(f"round {rnd} {program}: {r['tokens_per_s']:,.0f} tok/s, {r['ms_per_step']:.1f} ms/step, "
                     f"{r['timed_s']:.1f} s timed, peak {r.get('peak_mem_gib') or 0:.1f} GiB, wall {r['wall_s']:.0f} s")
                for other in ("peft", "trainer"):
                    ratio = ratio_of_runs(rep["throughput"], "hpcgpu", other)
                    if ratio:
                        rep["ratios"][f"hpcgpu/{other}"] = ratio
                save()
        rep["elapsed_s"] = time.time() - t_start
        save()
        report(args, rep)
        for f in rep["failures"]:
            print(f"\nFAILED: {f[-2000:]}")
        return 1 if rep["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
