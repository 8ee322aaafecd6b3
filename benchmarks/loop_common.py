"""What benchmarks/loop_minimal.py and loop_careful.py share: the torchrun-style process group, the
model (--model and its size flags), and the FLOP counts behind MFU (the peak table is hpcgpu's own,
hpcgpu/gpu/peak.py)."""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench_common import TRAIN_MODELS, fill_model_defaults, train_model_config
from hpcgpu.gpu.peak import peak_flops as peak_of_name


def setup_dist(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    rank, local, world = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1:
        if use_cuda:
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return rank, world, device


LLAMA_ONLY = ("n_kv_head", "intermediate")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--model and the size flags (defaults: the model's, from TRAIN_MODELS)."""
    ap.add_argument("--model", choices=list(TRAIN_MODELS), default="gpt2-124m",
                    help="gpt2-124m: HF GPT2LMHeadModel, GPT-2 124M (default); llama-1b: HF LlamaForCausalLM, "
                         "Llama-3.2-1B's shape (rope_theta 500000, tied embeddings); from a config, random init")
    ap.add_argument("--n-layer", type=int, default=None, help="layers (default 12 / 16)")
    ap.add_argument("--n-embd", type=int, default=None, help="hidden size (default 768 / 2048)")
    ap.add_argument("--n-head", type=int, default=None, help="attention heads (default 12 / 32)")
    ap.add_argument("--n-kv-head", type=int, default=None, help="llama-1b: key/value heads (default 8)")
    ap.add_argument("--intermediate", type=int, default=None, help="llama-1b: MLP width (default 8192)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 50304 / 128256)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="tokens per sequence, also the position table (default 1024 / 2048)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per forward pass (default 16 / 4)")


def model_defaults(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The size flags not given take --model's values."""
    if args.model != "llama-1b" and any(getattr(args, k) is not None for k in LLAMA_ONLY):
        ap.error("--n-kv-head and --intermediate are for --model llama-1b")
    fill_model_defaults(args)


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, GPT2LMHeadModel, LlamaForCausalLM

    mapping = train_model_config(getattr(args, "model", "gpt2-124m"), args)
    kind = mapping.pop("model_type")
    cfg = AutoConfig.for_model(kind, **{**mapping, "attn_implementation": "sdpa"})
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    with torch.device(device):
        model = (LlamaForCausalLM if kind == "llama" else GPT2LMHeadModel)(cfg)
    if getattr(args, "name_loss", False):  # runtime/model.py name_its_loss: one graph with the loss
        model.loss_type = "ForCausalLM"  # (LlamaForCausalLM's name says it already)
    return model.train()


def flops_per_token(model: torch.nn.Module, args: argparse.Namespace) -> float:
    """hpcgpu's count (runtime/tasks/train.py flops_per_token): 6N plus attention, PaLM appendix B, from
    the model's config (GPT-2's n_layer / n_head / n_embd answer to these names too); N counts tied
    weights once, as model.parameters() does."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    layers, heads, hidden = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size
    return 6 * n + 12 * layers * heads * (hidden // heads) * args.seq_len


def peak_flops(args: argparse.Namespace, device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, args.peak_tflops * 1e12 if args.peak_tflops else peak_of_name(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class IntervalMarks:
    """The timed loop's ms/step over every `every` steps, as hpcgpu's step log gives it: a mark per interval
    (a CUDA event on the GPU, so the loop never waits for it; the host clock on CPU), read once at the end.
    A steady step has a narrow range; a drift shows as first != last."""

    def __init__(self, device: torch.device, every: int):
        self.cuda, self.every = device.type == "cuda", every
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def after_step(self, done: int) -> None:
        """`done` timed steps are queued: a mark at every interval's end."""
        if done % self.every == 0:
            self.mark()

    def summary(self) -> dict | None:
        """median/min/max/first/last ms/step of the intervals (call after the final synchronisation)."""
        pairs = list(zip(self.marks, self.marks[1:]))
        if self.cuda:
            ms = [a.elapsed_time(b) / self.every for a, b in pairs]
        else:
            ms = [(b - a) * 1000 / self.every for a, b in pairs]
        if not ms:
            return None
        return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "first": ms[0], "last": ms[-1]}


def add_interval_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--interval", type=int, default=10,
                    help="steps per timed interval for the ms/step range (as hpcgpu's log_every; default 10)")
