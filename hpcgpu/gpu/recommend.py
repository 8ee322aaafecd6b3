"""Settings that fit a spec on given hardware: micro batch, accumulation, workers, strategy.

Pure functions over (model shape, GPU memory, world size, batch): unit-testable on a CPU machine.
The ladder follows the memory each step saves: DDP while the model states fit, ZeRO-2 when the
optimizer states do not, ZeRO-3 when the parameters do not, then offload to host RAM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.estimate import (DDP, STRATEGIES, ModelDims, Strategy, dims_from_config, estimate, fmt_bytes,
                                 max_micro_batch, usable_bytes)

# fastest first: ZeRO-3 on the GPU beats offloading the optimizer to a CPU Adam
LADDER: tuple[Strategy, ...] = tuple(next(s for s in STRATEGIES if s.name == name) for name in
                                     ("ddp", "zero2", "zero3", "zero2+offload", "zero3+offload", "zero3+offload-all"))
CPU_MICRO_MAX = 8  # without GPU memory to go by: the trainer's old rule


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

    def summary(self) -> str:
        how = self.strategy + (f" ZeRO-{self.zero_stage}" if self.zero_stage is not None else "") + \
            (f" offload {self.offload}" if self.offload != "none" else "")
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


def per_rank_batch(global_batch: int, world: int) -> int:
    if global_batch % world:
        raise HpcgpuError(f"train.global_batch_size {global_batch} is not divisible by the {world} ranks")
    return global_batch // world


def recommend(d: ModelDims, gpu_total: int | None, world: int, global_batch: int, cpus_per_gpu: int = 4,
              micro: int | None = None, strategy: Strategy | None = None) -> Recommendation:
    """micro/strategy given: keep them (and check they fit); None: choose."""
    per_rank = per_rank_batch(global_batch, world)
    if micro is not None and per_rank % micro:
        raise HpcgpuError(f"train.micro_batch_size {micro} does not divide the {per_rank} sequences per rank")
    workers = loader_workers(cpus_per_gpu)
    if gpu_total is None:
        m = micro or max(divisors_upto(per_rank, CPU_MICRO_MAX))
        st = strategy or DDP
        return Recommendation(m, per_rank // m, spec_strategy_name(st, world), st.zero_stage, st.offload,
                              f"no GPU memory to go by: micro batch {m}, {spec_strategy_name(st, world)}", workers)
    tried: list[str] = []
    for st in ([strategy] if strategy else LADDER):
        top = max_micro_batch(d, st, world, gpu_total)
        ok = [m for m in divisors_upto(per_rank, top) if micro is None or m == micro]
        if ok:
            return _chosen(d, st, max(ok), per_rank, world, gpu_total, workers, tried)
        need = estimate(d, st, micro or 1, world).total
        tried.append(f"{st.name} needs {fmt_bytes(need)} at micro batch {micro or 1}")
    st, m = strategy or LADDER[-1], micro or 1
    return Recommendation(m, per_rank // m, spec_strategy_name(st, world), st.zero_stage, st.offload,
                          f"does not fit in {fmt_bytes(usable_bytes(gpu_total))} usable: {'; '.join(tried)}",
                          workers, estimate(d, st, m, world).total, fits=False)


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
                          workers, e.total, True)


def spec_strategy(spec: Any) -> Strategy | None:
    """The spec's fixed strategy as a Strategy, or None for auto."""
    s = spec.distributed.strategy
    if s == "auto":
        return None
    if s in ("ddp", "none"):
        return DDP
    ds = spec.distributed.deepspeed
    return Strategy(f"zero{ds.zero_stage}", ds.zero_stage, ds.offload_optimizer or ds.offload_params,
                    ds.offload_params)


def compiled_step(spec: Any, on_gpu: bool = True) -> bool:
    """Whether the DDP step runs under torch.compile (train.compile: auto means on a GPU)."""
    c = spec.train.compile
    return on_gpu if c == "auto" else bool(c)


def recommend_for_job(spec: Any, n_params: int | None, model_config: Any, gpu_total_bytes: int | None,
                      world: int) -> Recommendation:
    """For the job: fills train.micro_batch_size: auto and distributed.strategy: auto, keeps what the
    spec fixes. model_config: the HF config (object or mapping); n_params None: counted from it."""
    d = dims_from_config(model_config, spec.data.seq_len, n_params, compiled_step(spec))
    mb = spec.train.micro_batch_size
    return recommend(d, gpu_total_bytes, world, spec.train.global_batch_size, spec.resources.cpus_per_gpu,
                     micro=None if mb == "auto" else int(mb), strategy=spec_strategy(spec))


def apply_recommendation(spec: Any, rec: Recommendation) -> Any:
    """The spec with its `auto` micro batch and strategy replaced by the recommendation's; what the
    spec fixed stays. (The resolved spec is what the trainer and its DeepSpeed config read.)"""
    from dataclasses import replace

    train, dist = spec.train, spec.distributed
    if train.micro_batch_size == "auto":
        train = replace(train, micro_batch_size=rec.micro_batch)
    if dist.strategy == "auto":
        dist = replace(dist, strategy=rec.strategy)
        if rec.zero_stage is not None:
            dist = replace(dist, deepspeed=replace(dist.deepspeed, zero_stage=rec.zero_stage,
                                                   offload_optimizer=rec.offload != "none",
                                                   offload_params=rec.offload == "params+optimizer"))
    return replace(spec, train=train, distributed=dist)
