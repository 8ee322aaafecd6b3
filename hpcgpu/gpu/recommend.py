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
no micro batch fits without it. FSDP is no rung: a spec's distributed.strategy: fsdp is estimated and
kept, auto never chooses it (that waits for a GPU benchmark).

With train.lora the base is frozen and whole on every rank: there is no ladder to climb, the
micro batch and gradient checkpointing come from the LoRA/QLoRA estimate under DDP (ZeRO-1/2 when the
spec fixes them: the same memory but for the adapters' megabytes). QLoRA turns gradient checkpointing
on where the spec leaves it auto, as the job does.

A Recommendation is advice: `hpcgpu hw` and `hpcgpu estimate` print it, and the job's run plan
(runtime/plan.py) takes its choices from it. Nothing here rewrites a Spec. fine_tuning_methods and
lighter_method compare full fine-tuning with LoRA and QLoRA for the same spec: where the spec's own
does not fit and a lighter one does, one line says which spec keys to add.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from hpcgpu.gpu.estimate import (DDP, STRATEGIES, LoraDims, ModelDims, Strategy, dims_from_config, estimate,
                                 fmt_bytes, fsdp_strategy, max_micro_batch, spec_lora_dims, usable_bytes,
                                 with_checkpointing)
from hpcgpu.spec.derive import batch_split
from hpcgpu.spec.schema import Lora

if TYPE_CHECKING:
    from hpcgpu.spec import Spec

# fastest first: ZeRO-3 on the GPU beats offloading the optimizer to a CPU Adam. No FSDP rung: auto
# does not choose FSDP until a GPU benchmark says where it belongs (only a spec's strategy: fsdp does)
LADDER: tuple[Strategy, ...] = tuple(next(s for s in STRATEGIES if s.name == name and not s.fsdp) for name in
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
    strategy: str  # in spec words: none | ddp | fsdp | deepspeed
    zero_stage: int | None
    offload: str  # none | optimizer | params+optimizer
    reason: str
    workers: int = 0  # data-loader workers per rank
    bytes_per_gpu: int | None = None
    fits: bool = True
    checkpointing: bool = False  # gradient checkpointing on
    method: str = "full"  # full fine-tuning, or train.lora's: 'lora (bfloat16 base)', 'qlora (int4 base)'

    def summary(self) -> str:
        how = self.strategy + (f" ZeRO-{self.zero_stage}" if self.zero_stage is not None else "") + \
            (f" offload {self.offload}" if self.offload != "none" else "") + \
            (" + gradient checkpointing" if self.checkpointing else "")
        lora = "" if self.method == "full" else f"{self.method}, "
        return f"{lora}{how}, micro batch {self.micro_batch} x accum {self.accum}, {self.workers} loader workers"


def method_text(lora: LoraDims | None) -> str:
    """'full', 'lora (bfloat16 base)', 'qlora (int4 base)': a Recommendation's method."""
    if lora is None:
        return "full"
    return f"{'qlora' if lora.quantized else 'lora'} ({lora.base} base)"


def divisors_upto(n: int, top: int) -> list[int]:
    return [d for d in range(1, min(n, top) + 1) if n % d == 0]


def loader_workers(cpus_per_gpu: int) -> int:
    """One core drives the GPU (Python, kernel launches); the rest may feed it, up to 8."""
    return min(8, max(0, cpus_per_gpu - 1))


def spec_strategy_name(st: Strategy, world: int) -> str:
    if st.fsdp:
        return "fsdp"
    if st.zero_stage is None:
        return "ddp" if world > 1 else "none"
    return "deepspeed"


def recommend(d: ModelDims | None, gpu_total: int | None, world: int, global_batch: int, cpus_per_gpu: int = 4,
              micro: int | None = None, strategy: Strategy | None = None,
              ranks: str = "nodes x gpus", checkpointing: Checkpointing = False,
              lora: LoraDims | None = None) -> Recommendation:
    """micro/strategy given: keep them (and check they fit); None: choose. Without GPU memory
    (gpu_total None) the model's shape is not needed (d may be None): the CPU rule decides (gradient
    checkpointing only where it is true). ranks: where `world` comes from, for the error when the
    global batch does not divide. checkpointing: train.gradient_checkpointing. lora: train.lora's
    adapters (estimate.lora_dims): the frozen base under DDP, no ladder (module docstring)."""
    per_rank, _ = batch_split(global_batch, world, micro, ranks=ranks)
    workers = loader_workers(cpus_per_gpu)
    method = method_text(lora)
    if gpu_total is None:
        m = micro or max(divisors_upto(per_rank, CPU_MICRO_MAX))
        st = strategy or DDP
        return Recommendation(m, per_rank // m, spec_strategy_name(st, world), st.zero_stage, st.offload,
                              f"no GPU memory to go by: micro batch {m}, {spec_strategy_name(st, world)}", workers,
                              checkpointing=checkpointing is True, method=method)
    if d is None:
        raise ValueError("recommend: the model's shape is needed to fit it into GPU memory")
    tried: list[str] = []
    ladder = (strategy,) if strategy else (DDP,) if lora is not None else LADDER
    rungs = with_checkpointing_rungs(ladder, checkpointing)
    for st in rungs:
        top = max_micro_batch(d, st, world, gpu_total, lora)
        ok = [m for m in divisors_upto(per_rank, top) if micro is None or m == micro]
        if ok:
            return _chosen(d, st, max(ok), per_rank, world, gpu_total, workers, tried, lora)
        need = estimate(d, st, micro or 1, world, lora).total
        tried.append(f"{rung_text(st, lora)} needs {fmt_bytes(need)} at micro batch {micro or 1}")
    st, m = rungs[-1], micro or 1  # the rung that needs the least memory
    return Recommendation(m, per_rank // m, spec_strategy_name(st, world), st.zero_stage, st.offload,
                          f"does not fit in {fmt_bytes(usable_bytes(gpu_total))} usable: {'; '.join(tried)}",
                          workers, estimate(d, st, m, world, lora).total, fits=False, checkpointing=st.checkpointing,
                          method=method)


def rung_text(st: Strategy, lora: LoraDims | None) -> str:
    return st.name if lora is None else f"{method_text(lora)} {st.name}"


def _chosen(d: ModelDims, st: Strategy, m: int, per_rank: int, world: int, gpu_total: int, workers: int,
            tried: list[str], lora: LoraDims | None = None) -> Recommendation:
    e = estimate(d, st, m, world, lora)
    states = "model states" if lora is None else "frozen base, adapters and their states"
    why = (f"{rung_text(st, lora)}: {states} {fmt_bytes(e.total - e.activations)} + activations "
           f"{fmt_bytes(e.activations)} at micro batch {m} = {fmt_bytes(e.total)} of "
           f"{fmt_bytes(usable_bytes(gpu_total))} usable on a {fmt_bytes(gpu_total)} GPU; "
           f"micro {m} x accum {per_rank // m} x {world} rank(s) = global {per_rank * world}")
    if tried:
        why += f" ({'; '.join(tried)})"
    return Recommendation(m, per_rank // m, spec_strategy_name(st, world), st.zero_stage, st.offload, why,
                          workers, e.total, True, st.checkpointing, method_text(lora))


def spec_strategy(spec: Spec) -> Strategy | None:
    """The spec's fixed strategy as a Strategy, or None for auto."""
    s = spec.distributed.strategy
    if s == "auto":
        return None
    if s in ("ddp", "none"):
        return DDP
    if s == "fsdp":
        fs = spec.distributed.fsdp
        return fsdp_strategy(fs.cpu_offload, fs.reshard_after_forward)
    ds = spec.distributed.deepspeed
    return Strategy(f"zero{ds.zero_stage}", ds.zero_stage, ds.offload_optimizer or ds.offload_params,
                    ds.offload_params)


def compiled_step(spec: Spec, on_gpu: bool = True) -> bool:
    """Whether the DDP step runs under torch.compile (train.compile: auto means on a GPU)."""
    c = spec.train.compile
    return on_gpu if c == "auto" else bool(c)


def spec_checkpointing(spec: Spec, lora: LoraDims | None = None) -> Checkpointing:
    """train.gradient_checkpointing for the estimate: QLoRA (a quantized base, `lora` or the spec's)
    turns auto into on, as the job's run plan does (a base too big to train in full: its activations
    are the memory left to save)."""
    ck = spec.train.gradient_checkpointing
    quantized = lora.quantized if lora is not None else spec.train.lora is not None and \
        spec.model.quantization != "none"
    return True if quantized and ck == "auto" else ck


def recommend_for_job(spec: Spec, n_params: int | None, model_config: Any, gpu_total_bytes: int | None,
                      world: int, compiled: bool | None = None, ranks: str = "nodes x gpus",
                      fused_loss: bool | None = None) -> Recommendation:
    """For the spec: chooses train.micro_batch_size: auto and distributed.strategy: auto, keeps what the
    spec fixes. model_config: the HF config (object or mapping), or None when there is no GPU memory to
    go by (the CPU rule needs no shape); n_params None: counted from it. compiled: whether the DDP step
    runs compiled (None: train.compile as on a GPU). fused_loss: the run plan's train.fused_loss (None:
    only where the spec says true, which is all that is known away from the job's GPUs). With train.lora
    the LoRA/QLoRA estimate of its adapters on the frozen base decides."""
    d = None
    lora = None
    if model_config is not None:
        step = compiled_step(spec) if compiled is None else compiled
        fused = spec.train.fused_loss is True if fused_loss is None else fused_loss
        d = dims_from_config(model_config, spec.data.seq_len, n_params, step, fused)
        lora = spec_lora_dims(spec, model_config) if spec.train.lora is not None else None
    mb = spec.train.micro_batch_size
    return recommend(d, gpu_total_bytes, world, spec.train.global_batch_size, spec.resources.cpus_per_gpu,
                     micro=None if mb == "auto" else int(mb), strategy=spec_strategy(spec), ranks=ranks,
                     checkpointing=spec_checkpointing(spec), lora=lora)


# ---------------------------------------------------------------- full fine-tuning, LoRA or QLoRA

@dataclass(frozen=True)
class Method:
    """One way to fine-tune the spec's model: every weight, or train.lora's adapters on a frozen base."""
    lora: LoraDims | None  # None: full fine-tuning
    keys: str  # the spec keys that make this spec train this way ('' for the spec's own)
    own: bool  # the spec's own way

    @property
    def name(self) -> str:
        return method_text(self.lora)


def fine_tuning_methods(spec: Spec, model_config: Any) -> list[Method]:
    """Full fine-tuning, LoRA on the base as the spec loads it (and in bfloat16 where that is float32),
    QLoRA int4 (and int8 where the spec asks for it), heaviest first; train.lora's settings, else the
    schema's defaults (r 16 on every linear layer)."""
    lora = spec.train.lora
    add = "" if lora is not None else f"train.lora: {{r: {Lora().r}}}"
    quant = spec.model.quantization
    unquantize = "model.quantization: none" if quant != "none" else ""
    unquantized = spec_lora_dims(spec, model_config, "float32" if spec.model.dtype == "auto" else
                                 spec.model.dtype)
    out = [Method(None, "", lora is None),
           Method(unquantized, join_keys(add, unquantize), lora is not None and quant == "none")]
    if unquantized.base == "float32":
        out.append(Method(spec_lora_dims(spec, model_config, "bfloat16"),
                          join_keys(add, "model.dtype: bfloat16", unquantize), False))
    for q in ("int8", "int4"):
        if q == "int4" or quant == q:
            keys = "" if lora is not None and quant == q else join_keys(add, f"model.quantization: {q}")
            if keys and not spec.model.name_or_path:
                keys += " (QLoRA quantizes a saved base: model.name_or_path)"
            out.append(Method(spec_lora_dims(spec, model_config, q), keys, lora is not None and quant == q))
    return out


def join_keys(*keys: str) -> str:
    return ", ".join(k for k in keys if k)


def method_recommendation(spec: Spec, m: Method, n_params: int | None, model_config: Any, gpu_total: int | None,
                          world: int, compiled: bool | None = None) -> Recommendation:
    """recommend() for the spec trained as `m`: the spec's own settings for its own method; another
    method with the micro batch auto and its own strategy (full: the spec's or the ladder; LoRA: DDP)."""
    if m.own:
        return recommend_for_job(spec, n_params, model_config, gpu_total, world, compiled)
    step = compiled_step(spec) if compiled is None else compiled
    d = dims_from_config(model_config, spec.data.seq_len, n_params, step, spec.train.fused_loss is True)
    st = spec_strategy(spec)
    if m.lora is not None and st is not None and (st.zero_stage == 3 or st.fsdp):
        st = None  # LoRA trains under DDP or ZeRO-1/2: its model has a frozen base whole on every rank
    ck = spec_checkpointing(spec, m.lora) if m.lora is not None else spec.train.gradient_checkpointing
    return recommend(d, gpu_total, world, spec.train.global_batch_size, spec.resources.cpus_per_gpu,
                     strategy=st, checkpointing=ck, lora=m.lora)


def lighter_method(methods: list[Method], recs: list[Recommendation]) -> str | None:
    """One line where the spec's own way does not fit the GPU (or fits only by DeepSpeed's or FSDP's
    offload to host RAM, a CPU Adam: slow) and a lighter one fits without offload: the first of those
    and, where it is not the lightest, the lightest that fits too, each with the spec keys that choose
    it; None otherwise (it fits, or there is no GPU memory to go by)."""
    own = next((i for i, m in enumerate(methods) if m.own), None)
    if own is None or recs[own].bytes_per_gpu is None or recs[own].fits and recs[own].offload == "none":
        return None
    fitting = [(m, rec) for m, rec in zip(methods[own + 1:], recs[own + 1:]) if rec.fits and rec.offload == "none"]
    if not fitting:
        return None
    what = "full fine-tuning" if methods[own].lora is None else methods[own].name
    offloader = "FSDP's" if recs[own].strategy == "fsdp" else "DeepSpeed's"
    head = f"{what} does not fit" if not recs[own].fits else \
        f"{what} fits only by offloading to host RAM ({offloader} CPU Adam: slow)"
    picks = fitting[:1] + fitting[-1:] if len(fitting) > 1 else fitting
    said = [f"{m.name} {'does' if i == 0 else 'also fits'} ({fmt_bytes(rec.bytes_per_gpu)} per GPU at micro batch "
            f"{rec.micro_batch}" + (" with gradient checkpointing" if rec.checkpointing else "") + f"): add {m.keys}"
            for i, (m, rec) in enumerate(picks)]
    return f"{head}; " + "; ".join(said)
