"""The experiment spec as typed, frozen dataclasses.

Each section owns a small dataclass. Field metadata carries the checks (range, pattern, choices) and
the help text, so the parser, the validator and the JSON Schema all read one description.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

NAME_RE = r"^[A-Za-z0-9_.-]+$"
TIME_RE = r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$"
# The signals `sbatch --signal` takes by name (SLURM's sig_name2num list, checked against sbatch 22.05),
# less KILL and STOP, which no process can catch: the job could never checkpoint on them.
SLURM_SIGNALS = ("HUP", "INT", "QUIT", "ABRT", "ALRM", "TERM", "USR1", "USR2", "URG", "CONT", "TSTP", "TTIN",
                 "TTOU", "XCPU")
SIGNAL_RE = r"^(B:)?(SIG)?[A-Z0-9]+@\d+$"  # the shape; signal_problem() checks the name and the seconds
SIGNAL_MAX_S = 65535  # SLURM keeps the lead time in 16 bits: sbatch refuses more
MEM_RE = r"^\d+(\.\d+)?[KMGT]?$"
ENV_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"
SBATCH_OPT_RE = r"^[a-z][a-z0-9-]*$"
DEVICES_RE = r"^\d+(,\d+)*$"
ENTRY_RE = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


def signal_problem(value: str) -> str | None:
    """What is wrong with a `[B:][SIG]NAME@seconds` value that has the right shape, or None."""
    name, _, seconds = value.removeprefix("B:").partition("@")
    name = name.removeprefix("SIG")
    if name in ("KILL", "STOP"):
        return (f"{name} cannot be caught, so the job could never checkpoint on it; "
                f"use one of {', '.join(SLURM_SIGNALS)} (e.g. USR2@120)")
    if name not in SLURM_SIGNALS:
        return (f"{name!r} is not a signal name sbatch --signal takes; use one of {', '.join(SLURM_SIGNALS)} "
                "(with or without SIG, e.g. USR2@120)")
    if int(seconds) > SIGNAL_MAX_S:
        return f"{seconds} seconds is more than SLURM's limit of {SIGNAL_MAX_S} (the part after @)"
    return None


def meta(help: str, *, min: float | None = None, max: float | None = None, pattern: str | None = None,
         key: str | None = None, fmt: str | None = None,
         check: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """Field metadata read by the parser and the JSON Schema generator.

    `check` takes a string that matched `pattern` and returns what is wrong with it, or None.
    """
    out: dict[str, Any] = {"help": help}
    if min is not None:
        out["min"] = min
    if max is not None:
        out["max"] = max
    if pattern is not None:
        out["pattern"] = pattern
        out["fmt"] = fmt or pattern
    if key is not None:
        out["key"] = key
    if check is not None:
        out["check"] = check
    return out


@dataclass(frozen=True)
class Busy:
    memory_pct: float = field(default=10.0, metadata=meta(
        "a GPU with more than this % of its memory used counts as busy", min=0, max=100))
    util_pct: float = field(default=10.0, metadata=meta(
        "a GPU with more than this % utilization counts as busy", min=0, max=100))
    processes: bool = field(default=True, metadata=meta("a GPU running any compute process counts as busy"))


@dataclass(frozen=True)
class Resources:
    nodes: int = field(default=1, metadata=meta("number of nodes", min=1))
    gpus: int = field(default=1, metadata=meta("GPUs per node; one task (rank) per GPU", min=1))
    cpus_per_gpu: int = field(default=4, metadata=meta("CPU cores per task", min=1))
    mem_per_gpu: Optional[str] = field(default=None, metadata=meta(
        "host memory per GPU, e.g. 32G (the node request is this times gpus)", pattern=MEM_RE,
        fmt="a size like 32G, 512M or 1T"))
    time: str = field(default="01:00:00", metadata=meta(
        "time limit", pattern=TIME_RE, fmt="HH:MM:SS or D-HH:MM:SS"))
    gpu_type: Optional[str] = field(default=None, metadata=meta(
        "GPU type for --gres=gpu:TYPE:N, e.g. a100", pattern=r"^[A-Za-z0-9_.-]+$",
        fmt="letters, digits, '_', '.', '-'"))
    devices: Optional[str] = field(default=None, metadata=meta(
        "local GPU indices to use, e.g. \"0,1,4,7\" (local executor and queue)", pattern=DEVICES_RE,
        fmt="comma-separated GPU indices like 0,1,4,7"))
    busy: Busy = field(default_factory=Busy, metadata=meta(
        "when a local GPU counts as busy (hpcgpu hw, local executor warnings)"))


@dataclass(frozen=True)
class Slurm:
    partition: Optional[str] = field(default=None, metadata=meta("partition (-p)", pattern=r"^[A-Za-z0-9_.,-]+$",
                                                                 fmt="a partition name"))
    account: Optional[str] = field(default=None, metadata=meta("account (-A)", pattern=r"^[A-Za-z0-9_.-]+$",
                                                               fmt="an account name"))
    qos: Optional[str] = field(default=None, metadata=meta("quality of service", pattern=r"^[A-Za-z0-9_.-]+$",
                                                           fmt="a QOS name"))
    constraint: Optional[str] = field(default=None, metadata=meta(
        "node features, e.g. a100|h100", pattern=r"^[A-Za-z0-9_.|&,\[\]*:()-]+$", fmt="a feature expression"))
    signal: str = field(default="USR2@120", metadata=meta(
        "signal sent before the time limit or preemption kill", pattern=SIGNAL_RE, check=signal_problem,
        fmt="NAME@seconds, e.g. USR2@120"))
    requeue: bool = field(default=True, metadata=meta("let SLURM requeue the job (preemption)"))
    max_requeues: int = field(default=10, metadata=meta("most requeues after preemption/timeout", min=0))
    max_retries: int = field(default=0, metadata=meta("requeues after a crash (0: a crash ends the job)", min=0))
    array_parallelism: Optional[int] = field(default=None, metadata=meta(
        "most array tasks running at once (%N)", min=1))
    gpu_request: Literal["gres", "gpus-per-node", "none"] = field(default="gres", metadata=meta(
        "how GPUs are asked for: --gres=gpu[:type]:N or --gpus-per-node; none asks for no GPU (a CPU "
        "job: resources.gpus then counts its tasks per node, cpus_per_gpu the cores of each)"))
    setup: list[str] = field(default_factory=list, metadata=meta(
        "shell lines run before the job starts (module load, conda activate); kept verbatim"))
    extra: dict[str, Union[str, int, bool]] = field(default_factory=dict, metadata=meta(
        "more sbatch options: {option: value}; true for a flag"))


@dataclass(frozen=True)
class DeepSpeed:
    zero_stage: int = field(default=2, metadata=meta("ZeRO stage", min=0, max=3))
    offload_optimizer: bool = field(default=False, metadata=meta("optimizer states in CPU memory"))
    offload_params: bool = field(default=False, metadata=meta("parameters in CPU memory (ZeRO-3)"))
    config: Optional[str] = field(default=None, metadata=meta("a DeepSpeed JSON file merged into the generated one"))


@dataclass(frozen=True)
class Fsdp:
    """PyTorch FSDP2 (torch.distributed.fsdp.fully_shard on each transformer block and the root)."""

    reshard_after_forward: bool = field(default=True, metadata=meta(
        "free each block's gathered weights after its forward and gather them again for the backward "
        "(ZeRO-3's memory); false keeps them until the backward (ZeRO-2's: more memory, one all-gather less)"))
    cpu_offload: bool = field(default=False, metadata=meta(
        "weights, gradients and optimizer states in CPU memory between uses (CPUOffloadPolicy; the "
        "optimizer steps on the CPU)"))
    reduce_dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata=meta(
        "dtype of the gradient reduce-scatter; the weights are gathered in train.precision's dtype"))


@dataclass(frozen=True)
class Nccl:
    debug: Optional[Literal["VERSION", "WARN", "INFO", "TRACE"]] = field(default=None, metadata=meta("NCCL_DEBUG"))
    socket_ifname: Optional[str] = field(default=None, metadata=meta(
        "NCCL_SOCKET_IFNAME, e.g. ib0 or ^lo,docker", pattern=r"^[A-Za-z0-9_.,^=-]+$", fmt="an interface list"))
    ib_disable: Optional[bool] = field(default=None, metadata=meta("NCCL_IB_DISABLE"))
    timeout_s: int = field(default=600, metadata=meta("process-group timeout in seconds", min=10))


@dataclass(frozen=True)
class Ddp:
    """torch's DistributedDataParallel arguments, passed through as written (defaults: torch's, but
    the two autos)."""
    bucket_cap_mb: Union[float, Literal["auto"]] = field(default="auto", metadata=meta(
        "gradient bucket size in MiB; auto: 100 around a compiled model (task: train with compile, or a "
        "compiled model given to ctx.prepare: it is split into a graph per bucket, each launched every "
        "step), else torch's 25", min=1))
    gradient_as_bucket_view: Union[bool, Literal["auto"]] = field(default="auto", metadata=meta(
        "gradients are views into the all-reduce buckets: one copy and its memory less per step; auto: on "
        "in task: train (its loop never touches a gradient in place), off under ctx.prepare (your loop may)"))
    static_graph: bool = field(default=False, metadata=meta(
        "the same parameters are used in the same order every step (lets DDP skip the search)"))
    find_unused_parameters: bool = field(default=False, metadata=meta(
        "for models whose forward leaves some parameters unused (slower)"))


@dataclass(frozen=True)
class Distributed:
    strategy: Literal["auto", "ddp", "fsdp", "deepspeed", "none"] = field(default="auto", metadata=meta(
        "auto: ddp for several ranks, none for one, or deepspeed when the memory estimate says the model "
        "does not fit DDP on these GPUs (the run plan decides, plan.json records it); fsdp: PyTorch FSDP2, "
        "the model sharded block by block"))
    ddp: Ddp = field(default_factory=Ddp, metadata=meta("DistributedDataParallel settings (strategy ddp)"))
    fsdp: Fsdp = field(default_factory=Fsdp, metadata=meta("FSDP2 settings (strategy fsdp)"))
    deepspeed: DeepSpeed = field(default_factory=DeepSpeed, metadata=meta("DeepSpeed settings"))
    nccl: Nccl = field(default_factory=Nccl, metadata=meta("NCCL settings exported before init"))
    hang_timeout_s: Optional[int] = field(default=None, metadata=meta(
        "a rank with no progress (a step, a batch, a checkpoint, ctx.heartbeat()) for this long prints its "
        "stacks and ends the job FAILED, naming it and where it was; 3x before the first progress. "
        "null: max(300, 20x the median time between its progress)", min=5))
    sync_batchnorm: Union[bool, Literal["auto"]] = field(default="auto", metadata=meta(
        "ctx.prepare turns BatchNorm layers into SyncBatchNorm (statistics over every rank's batch); "
        "auto: when the model has BatchNorm and several GPU ranks. CPU ranks keep plain BatchNorm "
        "(torch's SyncBatchNorm runs on GPUs only)"))


@dataclass(frozen=True)
class Model:
    name_or_path: Optional[str] = field(default=None, metadata=meta(
        "a local directory (from_pretrained) or a hub id found in the local cache"))
    config: Optional[dict[str, Any]] = field(default=None, metadata=meta(
        "a transformers config as a mapping with model_type; weights are randomly initialised"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata=meta(
        "dtype of the weights as loaded"))
    quantization: Literal["none", "int8", "int4"] = field(default="none", metadata=meta(
        "weights quantized at load, on a GPU, through bitsandbytes (pip install 'hpcgpu[quant]'): int8 "
        "(LLM.int8) or int4 (NF4); task: infer, and task: train with train.lora (QLoRA: the frozen base in "
        "4 or 8 bits, the adapters in the compute dtype)"))
    adapter: Optional[str] = field(default=None, metadata=meta(
        "task: infer: a LoRA adapter folder (a train run's model/ with train.lora) on top of "
        "model.name_or_path, its base (without it: the base its adapter_config.json names, written into the "
        "run's spec.yaml); merged into the weights at load unless they are quantized. A base whose layers "
        "are not the shapes the adapter was trained on is refused in one line, before the job where the "
        "base's config is here"))


@dataclass(frozen=True)
class Data:
    train: Optional[str] = field(default=None, metadata=meta(
        "a .txt file, a .jsonl (one document a line, in data.text_field), .parquet/.arrow files or a folder "
        "of them (prepared once into data.cache_dir), or a folder `hpcgpu data prepare` wrote"))
    eval: Optional[str] = field(default=None, metadata=meta(
        "held-out data for the eval loss, in any form data.train takes"))
    seq_len: int = field(default=256, metadata=meta("tokens per training sequence", min=8))
    text_field: str = field(default="text", metadata=meta(
        "the field of a .jsonl line (column of a parquet/arrow file) that holds a document's text"))
    cache_dir: Optional[str] = field(default=None, metadata=meta(
        "where raw data files are prepared (tokenized) once; default $HPCGPU_DATA_CACHE or ~/.cache/hpcgpu/data"))
    format: Literal["text", "chat", "prompt_completion"] = field(default="text", metadata=meta(
        "text: every token counts in the loss; chat: .jsonl rows {\"messages\": [{\"role\", \"content\"}]} through "
        "the tokenizer's chat template, the assistant messages count; prompt_completion: .jsonl rows "
        "{\"prompt\", \"completion\"}, the completion counts"))
    packing: bool = field(default=True, metadata=meta(
        "chat/prompt_completion: fill each seq_len block with whole examples (false: one example a block)"))


@dataclass(frozen=True)
class EarlyStopping:
    metric: Literal["eval_loss"] = field(default="eval_loss", metadata=meta("the metric watched after each eval"))
    patience: int = field(default=3, metadata=meta(
        "evals in a row without improvement after which training stops", min=1))
    min_delta: float = field(default=0.0, metadata=meta(
        "an eval improves on the best so far only when lower by more than this", min=0))


@dataclass(frozen=True)
class Profile:
    start_step: int = field(default=10, metadata=meta(
        "the first profiled optimizer step (1-based); the step before it runs under the profiler as an "
        "untimed warm-up", min=1))
    steps: int = field(default=3, metadata=meta("optimizer steps profiled", min=1))


@dataclass(frozen=True)
class Lora:
    r: int = field(default=16, metadata=meta("rank of each adapter's two matrices", min=1))
    alpha: float = field(default=32.0, metadata=meta(
        "scale of the adapter's update: alpha / r times B A", min=0))
    dropout: float = field(default=0.05, metadata=meta("dropout on the adapter's input", min=0, max=1))
    target_modules: Union[Literal["auto"], list[str], str] = field(default="auto", metadata=meta(
        "the linear layers that get adapters, by name (q_proj, v_proj, c_attn, ...) or the end of their path "
        "(attn.c_attn), matched as peft matches a list; one name may be written alone (c_attn); auto: every "
        "linear layer of the attention and MLP blocks (peft's all-linear: not the output head). A name that "
        "matches no linear layer, or a module holding some, is refused (before the job where the model's "
        "config is here), as is lm_head where the head is tied to the input embedding (GPT-2)"))

    def __post_init__(self) -> None:
        # one name written alone is the one-element list the job runs (peft would read a string as a
        # regular expression over full paths, which a plain name like c_attn never matches)
        if isinstance(self.target_modules, str) and self.target_modules != "auto":
            object.__setattr__(self, "target_modules", [self.target_modules])


@dataclass(frozen=True)
class Train:
    global_batch_size: int = field(default=8, metadata=meta("sequences per optimizer step, on all GPUs", min=1))
    micro_batch_size: Union[int, Literal["auto"]] = field(default="auto", metadata=meta(
        "sequences per GPU per forward pass; auto: the largest that divides the global batch", min=1))
    max_steps: Optional[int] = field(default=None, metadata=meta(
        "optimizer steps (give this or train.epochs; neither: 100)", min=1))
    epochs: Optional[int] = field(default=None, metadata=meta(
        "passes over data.train instead of max_steps: epochs x (sequences // global batch) steps, decided "
        "in the run plan", min=1))
    lr: float = field(default=3e-4, metadata=meta("peak learning rate", min=0))
    min_lr_ratio: float = field(default=0.1, metadata=meta("final lr as a fraction of lr (cosine)", min=0, max=1))
    warmup_steps: int = field(default=10, metadata=meta("linear warmup steps", min=0))
    weight_decay: float = field(default=0.1, metadata=meta("AdamW weight decay", min=0))
    grad_clip: float = field(default=1.0, metadata=meta("max gradient norm (0: off)", min=0))
    seed: int = field(default=0, metadata=meta("seed of weights, data order and dropout", min=0))
    precision: Literal["auto", "bf16", "fp16", "fp32"] = field(default="auto", metadata=meta(
        "auto: bf16 autocast on GPUs that support it, fp32 on CPU"))
    compile: Union[bool, Literal["auto"]] = field(default="auto", metadata=meta("torch.compile; auto: on GPU"))
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = field(
        default="default", metadata=meta(
            "torch.compile's mode, as torch names it: reduce-overhead and max-autotune replay the step's "
            "kernels as CUDA graphs (static shapes: text data), max-autotune* search matmul kernels at "
            "compile time"))
    fused_loss: bool = field(default=False, metadata=meta(
        "the loss from the last hidden states through Liger's fused linear cross entropy, never holding the "
        "[tokens x vocab] logits (their memory goes to an auto micro batch), for model types gpt2, llama, "
        "mistral, qwen2, qwen3, phi3, olmo2 on GPUs (pip install 'hpcgpu[fused]'); it saves memory, not time "
        "(benchmarks/RESULTS.md has the measured cost)"))
    gc_every: int = field(default=50, metadata=meta(
        "Python's garbage collection runs on every rank at the same steps, every N, instead of whenever a "
        "rank has allocated enough (a rank paused by it holds up the others' all-reduce); 0: automatic",
        min=0))
    log_every: int = field(default=1, metadata=meta("log every N steps", min=1))
    eval_every: int = field(default=0, metadata=meta("eval loss every N steps (0: only at the end)", min=0))
    eval_batches: int = field(default=4, metadata=meta(
        "global batches of data.eval per eval: its first eval_batches x global_batch_size sequences, the "
        "same at every GPU count and micro batch; the loss is per labelled token over all of them", min=1))
    gradient_checkpointing: Union[bool, Literal["auto"]] = field(default="auto", metadata=meta(
        "recompute each layer's activations in backward (about 30% more compute, far less activation "
        "memory); auto: on only where the memory estimate needs it for the micro batch to fit"))
    early_stopping: Optional[EarlyStopping] = field(default=None, metadata=meta(
        "stop when the eval loss has not improved for `patience` evals; keeps the best model in "
        "checkpoints/best/ (needs data.eval and train.eval_every)"))
    lora: Optional[Lora] = field(default=None, metadata=meta(
        "fine-tune LoRA adapters through peft instead of every weight: the base model stays frozen (bitwise), "
        "checkpoints hold the adapters, optimizer, data position and RNG, and model/ is the adapter folder "
        "(PeftModel.from_pretrained(base, dir)); with model.quantization int4/int8 the base is loaded in "
        "4/8 bits (QLoRA, on a GPU)"))
    merge: bool = field(default=False, metadata=meta(
        "train.lora: also write merged/, the base with the adapters merged in, in the base's dtype (a full "
        "model from_pretrained loads)"))
    profile: Optional[Profile] = field(default=None, metadata=meta(
        "runs torch.profiler over steps start_step..start_step+steps-1 of this start (a start resumed past "
        "start_step profiles nothing), writes <run dir>/profile/: rank{R}.trace.json (Perfetto, "
        "chrome://tracing) and rank{R}.txt (time per step, GPU busy, top ops)"))


@dataclass(frozen=True)
class Infer:
    input: Optional[str] = field(default=None, metadata=meta(
        ".jsonl with one object a line ({\"id\", \"prompt\"} or {\"id\", \"messages\"}; score: "
        "{\"id\", \"text\"}), or .txt with one prompt a line (id = line number)"))
    mode: Literal["generate", "score"] = field(default="generate", metadata=meta(
        "generate: completions; score: log-likelihood and perplexity of each row's text"))
    max_new_tokens: int = field(default=256, metadata=meta("tokens generated per row at most", min=1))
    temperature: float = field(default=0.0, metadata=meta("0: greedy; above 0: sampling", min=0))
    top_p: float = field(default=1.0, metadata=meta("nucleus sampling (temperature > 0)", min=0, max=1))
    top_k: int = field(default=0, metadata=meta("top-k sampling (temperature > 0); 0: off", min=0))
    seed: int = field(default=0, metadata=meta("seed of sampling (each row's draw depends on it and the row)",
                                               min=0))
    stop: list[str] = field(default_factory=list, metadata=meta(
        "strings that end a completion (cut before them)"))
    batch_size: Union[int, Literal["auto"]] = field(default="auto", metadata=meta(
        "rows per forward pass (engine slots: the slots of each replica); auto: 8 on CPU, from free memory "
        "on a GPU", min=1))
    gpus_per_replica: Union[int, Literal["auto"]] = field(default="auto", metadata=meta(
        "GPUs of a node one model copy spans (its layers spread over them, accelerate's device_map); "
        "auto: the fewest that fit, decided at submit from the model's config and the GPU memory "
        "(infer.max_memory's cap, or the GPUs detected here; 1 when neither is known)", min=1))
    max_memory: str = field(default="auto", metadata=meta(
        "per-GPU memory a model copy may use (\"70GiB\"), optionally weights offloaded to CPU memory "
        "(\"70GiB,cpu=200GiB\"); auto: each GPU's free memory less headroom", pattern=r"^[^\x00-\x1f]*$",
        fmt="auto or a size like 70GiB, optionally ',cpu=SIZE'"))
    engine: Literal["slots", "batches"] = field(default="slots", metadata=meta(
        "generate: slots (a static KV cache of batch_size slots, the decode step compiled and captured as a CUDA graph on a GPU, a "
        "finished row's slot refilled while the other rows decode; a model it does not take runs on batches, with a log line "
        "saying why) or batches (model.generate a batch at a time); score runs on batches"))
    refill: bool = field(default=True, metadata=meta(
        "engine slots: once 1/8 of the slots (at least one) are free, the next rows are prefilled into them "
        "while the other rows go on decoding; false: new rows only once every slot is free (a fixed batch, "
        "for comparison)"))
    attention: Literal["auto", "varlen", "sdpa"] = field(default="auto", metadata=meta(
        "engine slots: how a decode step attends. auto: PyTorch's flash varlen kernel over each slot's live "
        "columns where it runs (a GPU of sm80 or newer, bf16/fp16 weights), else sdpa; varlen: the same; "
        "sdpa: the model's own attention over a masked view of the cache (the start-up line says which and "
        "why)"))
    kv_cache: Literal["dynamic", "static"] = field(default="dynamic", metadata=meta(
        "engine batches: generate's KV cache: dynamic (grows with the batch) or static (transformers' "
        "preallocated cache, sized by the first batch, the longest)"))


@dataclass(frozen=True)
class Checkpoint:
    every_steps: Optional[int] = field(default=None, metadata=meta("save every N steps", min=1))
    every_minutes: Optional[float] = field(default=None, metadata=meta("save every M minutes", min=0))
    keep: int = field(default=2, metadata=meta("complete checkpoints kept (the newest is never deleted)", min=1))
    async_: bool = field(default=False, metadata=meta("save in the background", key="async"))


@dataclass(frozen=True)
class Monitor:
    enabled: bool = field(default=True, metadata=meta("record GPU utilization, memory, power to gpu.jsonl"))
    interval_s: float = field(default=5.0, metadata=meta("seconds between GPU samples", min=0.1))


TRACKER_NAME_RE = r"^[A-Za-z0-9_.-]+$"


@dataclass(frozen=True)
class Wandb:
    project: Optional[str] = field(default=None, metadata=meta(
        "W&B project; default: the spec's name", pattern=TRACKER_NAME_RE, fmt="letters, digits, '_', '.', '-'"))
    entity: Optional[str] = field(default=None, metadata=meta(
        "W&B user or team; default: your default entity", pattern=TRACKER_NAME_RE,
        fmt="letters, digits, '_', '.', '-'"))
    mode: Literal["offline", "online", "disabled"] = field(default="offline", metadata=meta(
        "offline: files under <run dir>/wandb/ to `wandb sync` later (compute nodes often have no internet); "
        "online: needs a login (WANDB_API_KEY or ~/.netrc); disabled: no W&B"))
    tags: list[str] = field(default_factory=list, metadata=meta(
        "tags of the W&B run", pattern=r"^[^\x00-\x1f]{1,64}$", fmt="a tag of 1 to 64 characters on one line"))


@dataclass(frozen=True)
class Track:
    tensorboard: bool = field(default=False, metadata=meta(
        "TensorBoard event files in <run dir>/tensorboard/ (pip install 'hpcgpu[tensorboard]')"))
    wandb: Optional[Wandb] = field(default=None, metadata=meta(
        "Weights & Biases (pip install 'hpcgpu[wandb]'); absent: no W&B"))
    every_steps: Optional[int] = field(default=None, metadata=meta(
        "send every Nth train step to the trackers (metrics.jsonl keeps every logged one); default: "
        "train.log_every", min=1))


# SRC:DST[:ro|rw], both absolute (SRC may start with ~); no ',' (pyxis's list separator) nor spaces
MOUNT_RE = r"^(~|/)[^:,\s]*:/[^:,\s]*(:(ro|rw))?$"


@dataclass(frozen=True)
class Container:
    image: str = field(metadata=meta(
        "the image every rank runs in: a SIF file or a docker:// URI (apptainer, singularity); an enroot "
        "URI or a squashfs file (pyxis)"))
    runtime: Literal["apptainer", "singularity", "pyxis"] = field(default="apptainer", metadata=meta(
        "apptainer or singularity (`exec` around each rank, also under the local executor); pyxis "
        "(srun --container-image, SLURM only)"))
    mounts: list[str] = field(default_factory=list, metadata=meta(
        "more folders to mount; the runs dir, the spec's input paths, hpcgpu's code and the working dir are "
        "mounted always", pattern=MOUNT_RE, fmt="SRC:DST or SRC:DST:ro, absolute paths, no commas"))
    env: dict[str, str] = field(default_factory=dict, metadata=meta(
        "variables set inside the container over the image's own (the host's environment reaches the "
        "ranks already)"))


@dataclass(frozen=True)
class Code:
    snapshot: bool = field(default=True, metadata=meta(
        "copy the code a command or callable job runs into <run dir>/code/ at submit (the git-tracked and "
        "untracked, not-ignored files of the spec's repository, or the spec's folder): every rank, requeue "
        "and resume runs that copy; false: the job runs the working tree as it is then (provenance.json "
        "still records the commit, the dirty diff and the versions)"))
    max_mb: float = field(default=100.0, metadata=meta(
        "a bigger snapshot is refused at submit, naming its biggest files (data or checkpoints tracked by "
        "mistake)", min=0))


@dataclass(frozen=True)
class Spec:
    name: str = field(metadata=meta("experiment name", pattern=NAME_RE, fmt="letters, digits, '_', '.', '-'"))
    task: Literal["train", "infer", "command", "callable"] = field(default="train", metadata=meta(
        "what runs: train, infer (batch generation or scoring), command (your program), callable"))
    resources: Resources = field(default_factory=Resources, metadata=meta("what the job asks for"))
    slurm: Slurm = field(default_factory=Slurm, metadata=meta("SLURM options"))
    distributed: Distributed = field(default_factory=Distributed, metadata=meta("process group and strategy"))
    model: Model = field(default_factory=Model, metadata=meta("the model (task: train | infer)"))
    data: Data = field(default_factory=Data, metadata=meta("the data (task: train)"))
    train: Train = field(default_factory=Train, metadata=meta("the training loop (task: train)"))
    infer: Infer = field(default_factory=Infer, metadata=meta("batch inference (task: infer)"))
    checkpoint: Checkpoint = field(default_factory=Checkpoint, metadata=meta("checkpoints and resume"))
    monitor: Monitor = field(default_factory=Monitor, metadata=meta("GPU sampling inside the job (gpu.jsonl)"))
    track: Track = field(default_factory=Track, metadata=meta("experiment trackers fed by rank 0 (TensorBoard, W&B)"))
    command: Optional[list[str]] = field(default=None, metadata=meta(
        "argv of the user's program, started once per rank (task: command)"))
    entry: Optional[str] = field(default=None, metadata=meta(
        "pkg.module:function called with the context (task: callable)", pattern=ENTRY_RE,
        fmt="pkg.module:function"))
    env: dict[str, str] = field(default_factory=dict, metadata=meta(
        "environment variables of every rank; written into spec.yaml and job.sbatch, so never a secret "
        "(a name like *_TOKEN, *_KEY, *_SECRET, *PASSWORD* is refused: use env_passthrough); so are the names the "
        "launcher sets for every rank: SLURM_*, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
        "CUDA_VISIBLE_DEVICES (resources.devices chooses GPUs), HPCGPU_RUN_DIR, HPCGPU_SPEC and hpcgpu's other "
        "per-rank variables (MASTER_PORT is yours to pick)"))
    env_passthrough: list[str] = field(default_factory=list, metadata=meta(
        "names of variables the job takes from the environment you submit from (HF_TOKEN, WANDB_API_KEY); "
        "their values are never written to a file; submit checks that they are set",
        pattern=ENV_NAME_RE, fmt="an environment variable name like HF_TOKEN"))
    sweep: dict[str, list[Any]] = field(default_factory=dict, metadata=meta("dotted.key: [values] grid"))
    runs_dir: str = field(default="runs", metadata=meta("where run directories are made", pattern=r"^[^\x00-\x1f]*$", fmt="a path on one line"))
    container: Optional[Container] = field(default=None, metadata=meta(
        "run every rank inside this container image (docs/containers.md); absent: on the host"))
    code: Code = field(default_factory=Code, metadata=meta(
        "the code snapshot and provenance.json of each run (docs/running.md)"))

    @property
    def gpus_per_task(self) -> int:
        """GPUs one rank (task) spans: infer.gpus_per_replica once decided, else 1."""
        g = self.infer.gpus_per_replica
        return g if self.task == "infer" and isinstance(g, int) else 1

    @property
    def own_gpu_group(self) -> bool:
        """Each rank sees only its own GPUs (CUDA_VISIBLE_DEVICES narrowed, runtime/env.py
        bind_gpu_group): infer replicas, which share nothing on a GPU. Training ranks see the node's
        GPUs, as under torchrun, for NCCL's peer-to-peer paths between them."""
        return self.task == "infer"

    @property
    def tasks_per_node(self) -> int:
        return self.resources.gpus // self.gpus_per_task

    @property
    def world_size(self) -> int:
        """Ranks: one per GPU, or one per model copy (task: infer, gpus_per_replica > 1)."""
        return self.resources.nodes * self.tasks_per_node


# names whose value is a credential: a literal value in `env:` would land in spec.yaml and job.sbatch
SECRET_NAME_RE = r"(?i)(_TOKEN|_KEY|_SECRET)$|PASSWORD"


def looks_secret(name: str) -> bool:
    return re.search(SECRET_NAME_RE, name) is not None
