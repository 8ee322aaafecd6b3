"""A small CNN with BatchNorm on synthetic images, trained by a loop of your own through hpcgpu.

    hpcgpu submit configs/cnn-callable.yaml --executor local     # from the repository root

`task: callable` calls main(ctx) in every rank. ctx.prepare puts the model on the rank's device under
the spec's strategy (DDP here), SyncBatchNorm on GPUs, and the spec's precision; ctx.data_loader
gives this rank its share of each epoch; ctx.save / ctx.resume checkpoint and restore all of it
(model, optimizer, scheduler, RNG, the loader's place in the epoch); ctx.should_stop is the agreed
preemption flag and ctx.stop checkpoints, requeues and returns the exit code of a stopped run.

The spec's train section gives the global batch, steps, learning rate and seed; checkpoint.every_steps
how often it saves. Two knobs for experiments and tests, from the environment (the spec's `env:`):
CNN_NORM=group swaps BatchNorm for GroupNorm and CNN_DROPOUT sets the dropout (default 0.1);
CNN_STOP_AT=STEP[:RANK] makes that rank send itself the spec's stop signal after STEP, as a
preemption would (a drill).
"""
from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

IMAGES = 192  # 12 steps an epoch at the shipped global batch of 16
CLASSES = 4
SIZE = 16


def synthetic_images(n: int, seed: int) -> TensorDataset:
    """Noisy images around one random pattern per class: learnable in a few dozen steps. Seeded, so
    every rank holds the same dataset (each reads only its share)."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, 3, SIZE, SIZE, generator=g)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    images = 0.5 * patterns[labels] + torch.randn(n, 3, SIZE, SIZE, generator=g)
    return TensorDataset(images, labels)


def make_model(norm: str = "batch", dropout: float = 0.1) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        layer = nn.BatchNorm2d(cout) if norm == "batch" else nn.GroupNorm(4, cout)
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), layer, nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 16), *block(16, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Dropout(dropout), nn.Linear(32, CLASSES))


def mean_over_ranks(value: torch.Tensor, world: int) -> float:
    v = value.detach().float().clone()
    if world > 1:
        dist.all_reduce(v)
        v /= world
    return float(v.item())


def stop_drill(ctx: Any, step: int, start: int) -> None:
    """CNN_STOP_AT=STEP[:RANK]: that rank gets the spec's stop signal after STEP (never in the run that
    resumed from STEP, which must go on)."""
    at, _, rank = os.environ.get("CNN_STOP_AT", "").partition(":")
    if at and step == int(at) != start and (not rank or int(rank) == ctx.rank):
        from hpcgpu.spec.derive import signal_name

        os.kill(os.getpid(), getattr(signal, f"SIG{signal_name(ctx.spec)}"))


def main(ctx: Any) -> int:
    t = ctx.spec.train
    torch.manual_seed(t.seed)  # the same initial weights on every rank
    model = make_model(os.environ.get("CNN_NORM", "batch"), float(os.environ.get("CNN_DROPOUT", "0.1")))
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t.max_steps)
    model, optimizer = ctx.prepare(model, optimizer, scheduler=scheduler)
    # per-rank batch: train.global_batch_size / world, so 1 and 2 ranks see the same global batches
    loader = ctx.data_loader(synthetic_images(IMAGES, t.seed), shuffle=True, drop_last=True)
    start = step = ctx.resume()
    model.train()
    while step < t.max_steps:
        for images, labels in loader:
            with ctx.autocast():
                logits = model(images.to(ctx.device, non_blocking=True))
                loss = F.cross_entropy(logits, labels.to(ctx.device, non_blocking=True))
            ctx.backward(loss)
            ctx.step()
            step += 1
            mean = mean_over_ranks(loss, ctx.world_size)
            ctx.metrics.write("train", step=step, loss=mean, epoch=loader.epoch, max_steps=t.max_steps)
            if ctx.is_main and (step % t.log_every == 0 or step == t.max_steps):
                print(f"step {step:>5}/{t.max_steps} | epoch {loader.epoch} | loss {mean:.4f}", flush=True)
            stop_drill(ctx, step, start)
            if ctx.should_stop():
                return ctx.stop(step)
            if ctx.checkpoint.due_by_steps(step):
                ctx.save(step)
            if step == t.max_steps:
                break
    if step > start:  # a rerun of a finished run resumes at the end and has nothing to add
        ctx.save(step)
        ctx.metrics.write("end", step=step)
    if ctx.is_main:
        torch.save(getattr(model, "module", model).state_dict(), ctx.run_dir / "model.pt")
    return 0
