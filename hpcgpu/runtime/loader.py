"""`ctx.data_loader`: a torch DataLoader over this rank's share of a seeded per-epoch order, that
resumes mid-epoch exactly.

The order of an epoch depends only on (seed, epoch), as in runtime/data.py's BatchSchedule. Ranks
take it interleaved (rank r: positions r, r + world, ...), so with the per-rank batch = global batch /
world, the k-th global batch is positions [k*G, (k+1)*G) of the order whatever the number of ranks:
a 1-rank and a 2-rank run see the same samples at every step.

The position is that of the next batch the user gets (batches handed out count as consumed, those a
worker prefetched do not). Iterating the loader goes on where the last iteration stopped, also after
a `break` or a resume (load_state_dict); once an epoch is used up, iterating again starts the next
(set_epoch is never the user's job). So a checkpoint saved inside the loop or after leaving it
resumes at the same batch the uninterrupted run takes next.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sized

import torch
from torch.utils.data import DataLoader, Sampler

from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.recommend import loader_workers
from hpcgpu.runtime.plan import RunPlan
from hpcgpu.runtime.watchdog import beat

ORDER_SEED_STRIDE = 1_000_003  # as BatchSchedule: seed s, epoch e -> generator seed s * stride + e


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The dataset's indices in epoch `epoch`'s order: a function of (seed, epoch) only."""
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed * ORDER_SEED_STRIDE + epoch)
    return torch.randperm(n, generator=g)


class EpochSampler(Sampler[int]):
    """DistributedSampler's split (drop_last: cut to a multiple of the world; else padded from the
    start of the order), with a start offset, so that an epoch can begin mid-way."""

    def __init__(self, n: int, rank: int, world: int, seed: int, shuffle: bool, drop_last: bool):
        self.n, self.rank, self.world = n, rank, world
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.start = 0  # samples of this rank's share already handed out this epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.world if self.drop_last else math.ceil(self.n / self.world)

    def indices(self) -> list[int]:
        """This rank's share of the epoch's order, in order."""
        order = epoch_order(self.n, self.seed, self.epoch, self.shuffle)
        total = len(self) * self.world
        if total > self.n:  # padded, as DistributedSampler does, so that every rank gets as many
            order = torch.cat([order, order.repeat(math.ceil(total / self.n))[: total - self.n]])
        return order[:total][self.rank::self.world].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start:])


def cpus_per_rank(spec_cpus: int | None, local_world: int) -> int:
    """The cores a rank has: the spec's cpus_per_gpu (what srun and the local executor give it), else
    SLURM's count, else this process's cores shared among the node's ranks."""
    if spec_cpus:
        return spec_cpus
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit():
        return int(slurm)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world))


def recommended_options(cpus: int, on_gpu: bool) -> dict[str, Any]:
    """DataLoader settings for a rank with `cpus` cores: the loader workers `hpcgpu hw` recommends
    (gpu/recommend.py), page-locked batches on a GPU (an asynchronous copy), workers kept between
    epochs and two batches in flight each."""
    workers = loader_workers(cpus)
    options: dict[str, Any] = {"num_workers": workers, "pin_memory": on_gpu}
    if workers > 0:
        options.update(prefetch_factor=2, persistent_workers=True)
    return options


OWN_KEYWORDS = ("sampler", "batch_sampler")  # the split over the ranks is the point of ctx.data_loader


def merged_options(recommended: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The user's keyword arguments over the recommendation. Without workers, the worker-only settings
    the recommendation added are dropped (torch refuses them); ones the user gave are kept, and torch
    says what is wrong with them."""
    taken = [key for key in OWN_KEYWORDS if key in given]
    if taken:
        raise HpcgpuError(f"ctx.data_loader makes its own {' and '.join(taken)} (this rank's share of each "
                          "epoch, resumable); for a sampler of yours, make a torch DataLoader yourself")
    out = {**recommended, **given}
    if out.get("num_workers", 0) == 0:
        for key in ("prefetch_factor", "persistent_workers"):
            if key not in given:
                out.pop(key, None)
    return out


@dataclass
class LoaderPosition:
    epoch: int = 0
    batches: int = 0  # batches of this epoch handed out


class ResumableLoader:
    """A DataLoader over an EpochSampler that counts the batches it hands out (see the module doc)."""

    def __init__(self, dataset: Sized, *, batch_size: int, rank: int, world: int, seed: int, shuffle: bool,
                 drop_last: bool, options: dict[str, Any]):
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.sampler = EpochSampler(len(dataset), rank, world, seed, shuffle, drop_last)
        options = dict(options)
        # a generator of our own for the workers' base seed: torch otherwise draws it from the global
        # RNG at every iter(), and a resumed run (one iter() fewer) would continue with another RNG
        given = options.pop("generator", None)
        self.generator = given or torch.Generator()
        self._seed_workers = given is None  # a generator of the user's is left as it is
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, drop_last=drop_last,
                                 generator=self.generator, **options)
        self.pos = LoaderPosition()
        if len(self) == 0:
            raise HpcgpuError(f"ctx.data_loader: {len(dataset)} samples give rank {rank} of {world} no batch of "
                              f"{batch_size}{' (drop_last)' if drop_last else ''}; use a smaller batch_size")

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        share = len(self.sampler)
        return share // self.batch_size if self.drop_last else math.ceil(share / self.batch_size)

    @property
    def epoch(self) -> int:
        return self.pos.epoch

    def _begin(self) -> None:
        if self.pos.batches >= len(self):  # the epoch is used up: the next one
            self.pos = LoaderPosition(self.pos.epoch + 1, 0)
        self.sampler.set_epoch(self.pos.epoch)
        self.sampler.start = self.pos.batches * self.batch_size
        if self._seed_workers:
            self.generator.manual_seed(self.sampler.seed * ORDER_SEED_STRIDE + self.pos.epoch)

    def __iter__(self) -> Iterator[Any]:
        self._begin()
        for batch in self.loader:
            self.pos.batches += 1
            beat()
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The epoch and the batches of it handed out so far."""
        return {"epoch": self.pos.epoch, "batches": self.pos.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = LoaderPosition(int(state["epoch"]), int(state["batches"]))


def per_rank_batch(plan: RunPlan) -> int:
    """The default batch of a rank: the run plan's share of train.global_batch_size, so that the global
    batch (and with it the loss curve) stays the same whatever the number of ranks."""
    if not plan.training.batch_per_rank:  # no spec, or a global batch the ranks cannot split
        raise HpcgpuError(f"ctx.data_loader needs batch_size= without a spec (train.global_batch_size) or "
                          f"where the ranks cannot split it: {plan.reason}")
    return plan.training.batch_per_rank
