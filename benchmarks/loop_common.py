"""What benchmarks/loop_minimal.py and loop_careful.py share: the torchrun-style process group, the
model, and the FLOP counts behind MFU (the peak table is hpcgpu's own, hpcgpu/gpu/peak.py)."""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

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


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    extra = {} if args.vocab > 50256 else {"bos_token_id": None, "eos_token_id": None}  # gpt2's 50256 lies outside
    cfg = GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, n_positions=args.seq_len,
                     vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     attn_implementation="sdpa", **extra)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    if getattr(args, "name_loss", False):  # what hpcgpu does (runtime/model.py name_its_loss): one graph
        model.loss_type = "ForCausalLM"
    return model.train()


def flops_per_token(model: torch.nn.Module, args: argparse.Namespace) -> float:
    """hpcgpu's count (runtime/tasks/train.py flops_per_token): 6N plus attention, PaLM appendix B."""
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * args.n_layer * args.n_head * (args.n_embd // args.n_head) * args.seq_len


def peak_flops(args: argparse.Namespace, device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, args.peak_tflops * 1e12 if args.peak_tflops else peak_of_name(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
