"""Settings that fit a spec on given hardware: micro batch, accumulation, workers, strategy.

Pure functions over (model shape, GPU memory, world size, batch): unit-testable on a CPU machine.
The ladder follows the memory each step saves: DDP while the model states fit, ZeRO-2 when the
optimizer states do not, ZeRO-3 when the parameters do not, then offload to host RAM. With
train.gradient_checkpointing: auto every rung is tried first without, then with gradient
checkpointing: DDP, DDP + checkpointing, ZeRO-2, ZeRO-2 + checkpointing, ZeRO-3, ... Checkpointing
costs one more forward per step (about 30% more compute) and nothing on the wire or in host RAM, so
it comes before the next rung (DeepSpeed runs eager here; ZeRO-3 gathers every layer's weights in
forward and backward; offload crosses PCIe and steps a CPU Adam), and after the plain rung, because
a smaller micro batch with more accumulation costs less than recomputation: it is chosen only where
no micro batch fits without it.

A Recommendation is advice: `hpcgpu hw` and `hpcgpu estimate` print it, and the job's run plan
(runtime/plan.py) takes its choices from it. Nothing here rewrites a Spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from hpcgpu.gpu.estimate import (DDP, STRATEGIES, ModelDims, Strategy, dims_from_config, estimate, fmt_bytes,
                                 max_micro_batch, usable_bytes, with_checkpointing)
from hpcgpu.spec.derive import batch_split

if TYPE_CHECKING:
    from hpcgpu.spec import Spec

# fastest first: ZeRO-3 on the GPU beats offloading the optimizer to a CPU Adam
LADDER: tuple[Strategy, ...] = tuple(next(s for s in STRATEGIES if s.name == name) for name in
                                     ("ddp", "zero2", "zero3", "zero2+offload", "zero3+offload", "zero3+offload-all"))
CPU_MICRO_MAX = 8  # without GPU memory to go by: the trainer's old rule
Checkpointing = Union[bool, str]  # train.gradient_checkpointing: True | False | "auto"


def with_checkpointing_rungs(rungs: tuple[Strategy, ...], checkpointing: Checkpointing) -> tuple[Strategy, ...]:
    """The rungs for a gradient_checkpointing setting: as they are (false), each with it (true), or
    each without and then with it (auto; see the module docstring for the order)."""
    if checkpointing is True:
        return tuple(with_checkpointing(st) for st in rungs)
    if checkpointing == "auto":
        return tuple(x for st in rungs for x in (st, with_checkpointing(st)))
    return rungs


@dataclass(frozen=True)
class Recommendation:
    micro_batch: int
    accum: int
    strategy: str  # in spec words: none | ddp | deepspeed
    zero_stage: int | None
    offload: str  # none | optimizer | params+optimizer
    reason: str
    workers: int = 0  # data-loader workers per rank
    bytes_per_gpu: int | None = None
    fits: bool = True
    checkpointing: bool = False  # gradient checkpointing on

    def summary(self) -> str:
        how = self.strategy + (f" ZeRO-{self.zero_stage}" if self.zero_stage is not None else "") + \
            (f" offload {self.offload}" if self.offload != "none" else "") + \
            (" + gradient checkpointing" if self.checkpointing else "")
        return f"{how}, micro batch {self.micro_batch} x accum {self.accum}, {self.workers} loader workers"


def divisors_upto(n: int, top: int) -> list[int]:
    return [d for d in range(1, min(n, top) + 1) if n % d == 0]


def loader_workers(cpus_per_gpu: int) -> int:
    """One core drives the GPU (Python, kernel launches); the rest may feed it, up to 8."""
    return min(8, max(0, cpus_per_gpu - 1))


def spec_strategy_name(st: Strategy, world: int) -> str:
    if st.zero_stage is None:
        return "ddp" if world > 1 else "none"
    return "deepspeed"


def recommend(d: ModelDims | None, gpu_total: int | None, world: int, global_batch: int, cpus_per_gpu: int = 4,
              micro: int | None = None, strategy: Strategy | None = None,
              ranks: str = "nodes x gpus", checkpointing: Checkpointing = False) -> Recommendation:
    """micro/strategy given: keep them (and check they fit); None: choose. Without GPU memory
    (gpu_total None) the model's shape is not needed (d may be None): the CPU rule decides (gradient
    checkpointing only where it is true). ranks: where `world` comes from, for the error when the
    global batch does not divide. checkpointing: train.gradient_checkpointing."""
    per_rank, _ = batch_split(global_batch, world, micro, ranks=ranks)
    workers = loader_workers(cpus_per_gpu)
    if gpu_total is None:
        m = micro or max(divisors_upto(per_rank, CPU_MICRO_MAX))
        st = strategy or DDP
        return Recommendation(m, per_rank // m, spec_strategy_name(st, world), st.zero_stage, st.offload,
                              f"no GPU memory to go by: micro batch {m}, {spec_strategy_name(st, world)}", workers,
                              checkpointing=checkpointing is True)
    if d is None:
        raise ValueError("recommend: the model's shape is needed to fit it into GPU memory")
    tried: list[str] = []
    rungs = with_checkpointing_rungs((strategy,) if strategy else LADDER, checkpointing)
    for st in rungs:
        top = max_micro_batch(d, st, world, gpu_total)
        ok = [m for m in divisors_upto(per_rank, top) if micro is None or m == micro]
        if ok:
            return _chosen(d, st, max(ok), per_rank, world, gpu_total, workers, tried)
        need = estimate(d, st, micro or 1, world).total
        tried.append(f"{st.name} needs {fmt_bytes(need)} at micro batch {micro or 1}")
    st, m = rungs[-1], micro or 1  # the rung that needs the least memory
    return Recommendation(m, per_rank // m, spec_strategy_name(st, world), st.zero_stage, st.offload,
                          f"does not fit in {fmt_bytes(usable_bytes(gpu_total))} usable: {'; '.join(tried)}",
                          workers, estimate(d, st, m, world).total, fits=False, checkpointing=st.checkpointing)


def _chosen(d: ModelDims, st: Strategy, m: int, per_rank: int, world: int, gpu_total: int, workers: int,
            tried: list[str]) -> Recommendation:
    e = estimate(d, st, m, world)
    why = (f"{st.name}: model states {fmt_bytes(e.total - e.activations)} + activations "
           f"{fmt_bytes(e.activations)} at micro batch {m} = {fmt_bytes(e.total)} of "
           f"{fmt_bytes(usable_bytes(gpu_total))} usable on a {fmt_bytes(gpu_total)} GPU; "
           f"micro {m} x accum {per_rank // m} x {world} rank(s) = global {per_rank * world}")
    if tried:
        why += f" ({'; '.join(tried)})"
    return Recommendation(m, per_rank // m, spec_strategy_name(st, world), st.zero_stage, st.offload, why,
                          workers, e.total, True, st.checkpointing)


def spec_strategy(spec: Spec) -> Strategy | None:
    """The spec's fixed strategy as a Strategy, or None for auto."""
    s = spec.distributed.strategy
    if s == "auto":
        return None
    if s in ("ddp", "none"):
        return DDP
    ds = spec.distributed.deepspeed
    return Strategy(f"zero{ds.zero_stage}", ds.zero_stage, ds.offload_optimizer or ds.offload_params,
                    ds.offload_params)


def compiled_step(spec: Spec, on_gpu: bool = True) -> bool:
    """Whether the DDP step runs under torch.compile (train.compile: auto means on a GPU)."""
    c = spec.train.compile
    return on_gpu if c == "auto" else bool(c)


def recommend_for_job(spec: Spec, n_params: int | None, model_config: Any, gpu_total_bytes: int | None,
                      world: int, compiled: bool | None = None, ranks: str = "nodes x gpus",
                      fused_loss: bool | None = None) -> Recommendation:
    """For the spec: chooses train.micro_batch_size: auto and distributed.strategy: auto, keeps what the
    spec fixes. model_config: the HF config (object or mapping), or None when there is no GPU memory to
    go by (the CPU rule needs no shape); n_params None: counted from it. compiled: whether the DDP step
    runs compiled (None: train.compile as on a GPU). fused_loss: the run plan's train.fused_loss (None:
    only where the spec says true, which is all that is known away from the job's GPUs)."""
    d = None
    if model_config is not None:
        step = compiled_step(spec) if compiled is None else compiled
        fused = spec.train.fused_loss is True if fused_loss is None else fused_loss
        d = dims_from_config(model_config, spec.data.seq_len, n_params, step, fused)
    mb = spec.train.micro_batch_size
    return recommend(d, gpu_total_bytes, world, spec.train.global_batch_size, spec.resources.cpus_per_gpu,
                     micro=None if mb == "auto" else int(mb), strategy=spec_strategy(spec), ranks=ranks,
                     checkpointing=spec.train.gradient_checkpointing)
