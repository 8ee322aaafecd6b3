"""The memory model, the one place its formulas live: GPU memory per rank for training a causal LM
by strategy, and per GPU of a model copy for inference (the section below). `hpcgpu estimate`
prints them; the job decides with them (train: micro_batch_size and strategy auto through
gpu/recommend.py; infer: batch_size auto and the replica fit check). A model you can check by hand;
no torch at import time (the host imports it; count_params alone loads torch, on the meta device).

Model states (Psi = parameter count), per GPU, world size N:
  ddp    (hpcgpu's trainer: fp32 params, bf16 autocast, fused AdamW)
         weights 4 Psi, grads 4 Psi, Adam m+v 8 Psi; buffers: DDP's gradient buckets 4 Psi when N > 1
         and the bf16 copies autocast makes of the weights and keeps for backward, 2 Psi
  ZeRO   (DeepSpeed bf16: bf16 params and grads, fp32 master + m + v = 12 Psi; Rajbhandari et al. 2020)
         stage 1: 2 Psi + 2 Psi + 12 Psi/N      stage 2: 2 Psi + 2 Psi/N + 12 Psi/N
         stage 3: 16 Psi/N + the gathered working set (two layers and the embedding in bf16)
         offload_optimizer moves the fp32 states and grads (16 Psi/N) to host RAM; offload_params the
         bf16 weights too; ZeRO-1/2 add reduce/all-gather buckets (2 x min(Psi, 5e8) bf16 values)
  fsdp   (PyTorch FSDP2: fully_shard on every block and the root; MixedPrecisionPolicy gathers the weights
         in bf16, the sharded master weights, the grads (reduce-scattered in fp32) and AdamW's m and v stay
         fp32): weights 4 Psi/N, grads 4 Psi/N, Adam 8 Psi/N; buffers, the gathered working set: the
         root's own weights R (embeddings, final norm, untied head), gathered at its forward and kept
         to the end of the backward (FSDP2 does not reshard the root after forward), 2 R, and their
         unsharded bf16 grads through the backward, 2 R; the weights of the block computed and of the
         one prefetched, 2 x 2 x layer; one block's unsharded grads as the fp32 reduce-scatter input,
         4 x layer. reshard_after_forward false keeps every block's gathered weights from its forward
         to its backward: 2 x layers x layer instead of the two blocks. cpu_offload (CPUOffloadPolicy,
         the optimizer steps on the CPU): the 16 Psi/N in host RAM, the working set alone on the GPU.
         Not yet checked against a measured peak; distributed.strategy: auto does not choose it
Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", bf16, no recomputation):
  per layer  s*b*h*(34 + 5*a*s/h) bytes; the 5as/h term (the attention matrix) is gone with
             flash/SDPA attention, which never stores it
  logits     b*s*V*(2 + 4 + 4) bytes: bf16 logits, their fp32 copy, fp32 log-softmax (HF's loss);
             with train.fused_loss (Liger's fused linear cross entropy, chunks about h wide, and the
             head's gradient accumulated in fp32) b*s*h*(2 + 4 + 4) + 4*V*h bytes, the 4*V*h only
             where the head trains (not under train.lora: 8B QLoRA, micro 2, eager: 12.08 GiB measured)
  gradient checkpointing (train.gradient_checkpointing; Korthikanti et al. 2022 section 4, "full
             activation recomputation", after Chen et al. 2016): each layer keeps only its input,
             s*b*h*c bytes per layer (c = 4 under DDP, whose residual stream stays fp32 with fp32
             weights under autocast; 2 under DeepSpeed's bf16 weights and FSDP's bf16 gathered ones,
             the paper's 2sbhL), plus the activations of one layer, recomputed during its backward
             (the per-layer figure above); the logits are not checkpointed (Hugging Face checkpoints
             the decoder blocks only). Under train.lora a compiled step keeps more per checkpointed
             layer: CKPT_COMPILED_INPUTS = 3.8 times the input's bytes, measured, not derived (8B Llama
             shape, QLoRA, H200: eager 3.96 GiB a sample of 2048 tokens, compiled 6.75; the 1B bf16
             LoRA run's -6% compiled too). Full training does not: compiled GPT-2 350M with
             checkpointing measured 8.67 GiB against 10.80 estimated without it (+24.5%)
  The 34 assumes fused kernels: it holds for the compiled step (torch.compile, the trainer's default on
  GPU). An eager Hugging Face block under autocast keeps far more: the residual stream and LayerNorm
  inputs in fp32, tanh-GELU's intermediates in fp32 (pow/tanh autocast to fp32), about 88 sbh counted
  op by op for GPT-2; we use ACT_PER_LAYER_EAGER = 90 when the step is not compiled, and under
  DeepSpeed, which hpcgpu runs uncompiled (there bf16 weights keep the residual in bf16: a bound).
  FSDP rows take the coefficient as DDP's do: 34 where the step is compiled (ModelDims.compiled), else 90.
  Estimate vs torch.cuda.max_memory_allocated, GPT-2 124M / 350M, micro 8, seq 1024, accumulation 2:
  hpcgpu's trainer, compiled, H200: +6.4% / -5.4% (tests/gpu/test_gpu_layer.py); a plain loop on an
  H100 (benchmarks/estimate_vs_measured.py): compiled +19% / -5%, eager -7% / -3% (90 was fitted to
  these eager runs); an eager 86M model (vocab 256: all per-layer) at micro 32 on 2 H200s: -3%.
train.lora (LoRA, QLoRA): the frozen base, the adapters and their states, in the LoRA section below;
estimate(), max_micro_batch() and recommend take its LoraDims as `lora`.
A GPU's usable memory is its total less the CUDA context and allocator slack (USABLE_* below).
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hpcgpu.errors import HpcgpuError, SpecError
from hpcgpu.gpu.model_types import model_type_problem

if TYPE_CHECKING:
    from hpcgpu.spec import Spec

GiB = 1 << 30
ACT_PER_LAYER = 34  # Korthikanti's sbh coefficient (fused kernels: a compiled step)
ACT_PER_LAYER_EAGER = 90  # eager HF block under bf16 autocast (see above)
ATTN_SCORES = 5  # the as^2b coefficient, only where attention scores are stored (eager attention)
CKPT_INPUT_BYTES_DDP = 4  # a checkpointed layer's input: the fp32 residual stream (fp32 weights, autocast)
CKPT_INPUT_BYTES_ZERO = 2  # bf16 weights under DeepSpeed: a bf16 residual stream
CKPT_COMPILED_INPUTS = 3.8  # under LoRA a compiled checkpointed layer keeps ~3.8x its input (measured; docstring)
LOGITS_BYTES = 2 + 4 + 4
ZERO_BUCKET_ELEMS = 500_000_000  # DeepSpeed's default reduce_bucket_size / allgather_bucket_size
USABLE_FRACTION = 0.95  # allocator fragmentation
USABLE_RESERVE = GiB  # CUDA context, cuBLAS/NCCL workspaces

# model families whose MLP is gated (3 matrices) / whose linears have biases / learned positions
GATED = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo",
         "olmo2", "granite", "cohere", "smollm3"}
BIASED = {"gpt2", "gpt_neo", "gpt_neox", "gptj", "opt", "bloom", "gpt_bigcode", "codegen", "phi", "starcoder2"}
LEARNED_POSITIONS = {"gpt2", "gpt_neo", "opt", "gpt_bigcode"}
# what transformers fills in when a spec's config mapping leaves a size out (hw reads mappings without it)
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048},
}


@dataclass(frozen=True)
class ModelDims:
    n_params: int
    n_layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    largest_param: int  # the biggest single tensor (usually the embedding): ZeRO-3 gathers it whole
    flash_attention: bool = True  # SDPA/flash: no stored s x s attention matrix
    compiled: bool = True  # torch.compile under DDP or FSDP (train.compile: auto on a GPU); DeepSpeed runs eager
    fused_loss: bool = False  # train.fused_loss: no logits held (module docstring)
    layer_params: int = 0  # one decoder block's parameters (FSDP gathers block by block); 0: not known


def block_params(d: ModelDims) -> int:
    """One decoder block's parameters; where the config did not say, ZeRO-3's reading: all but the
    largest tensor spread evenly over the layers."""
    return d.layer_params or (d.n_params - d.largest_param) // max(1, d.n_layers)


def root_params(d: ModelDims) -> int:
    """The parameters outside the blocks (embeddings, final norm, untied head): FSDP's root unit."""
    if not d.layer_params:
        return d.largest_param
    return max(0, d.n_params - d.n_layers * d.layer_params)


@dataclass(frozen=True)
class Strategy:
    name: str
    zero_stage: int | None  # None: DDP (or a single process), or FSDP
    offload_optimizer: bool = False
    offload_params: bool = False
    checkpointing: bool = False  # gradient checkpointing: layer inputs kept, activations recomputed
    fsdp: bool = False  # PyTorch FSDP2 (zero_stage None); cpu_offload: both offload flags on
    reshard_after_forward: bool = True  # FSDP only: false keeps each block's gathered weights to its backward

    @property
    def bf16_weights(self) -> bool:
        """The blocks compute with bf16 weights (DeepSpeed's, FSDP's gathered ones): a bf16 residual stream."""
        return self.zero_stage is not None or self.fsdp

    @property
    def offload(self) -> str:
        return "params+optimizer" if self.offload_params else "optimizer" if self.offload_optimizer else "none"


def plan_strategy(zero_stage: int | None, offload_optimizer: bool = False, offload_params: bool = False,
                  checkpointing: bool = False, fsdp: bool = False, reshard_after_forward: bool = True) -> Strategy:
    """The Strategy (row of `hpcgpu estimate`) a run plan's settings make. fsdp: FSDP2, offloaded to
    the CPU (cpu_offload) where either offload flag is on; reshard_after_forward: its key of that name."""
    if fsdp:
        if zero_stage is not None:  # two strategies at once: a caller's mistake, not a spec's
            raise ValueError(f"plan_strategy: fsdp has no ZeRO stage (got {zero_stage})")
        base = fsdp_strategy(offload_optimizer or offload_params, reshard_after_forward)
    elif zero_stage is None:
        base = DDP
    else:
        base = next((s for s in STRATEGIES if not s.fsdp and (s.zero_stage, s.offload_optimizer, s.offload_params)
                     == (zero_stage, offload_optimizer, offload_params)),
                    Strategy(f"zero{zero_stage}", zero_stage, offload_optimizer, offload_params))
    return with_checkpointing(base) if checkpointing else base


def fsdp_strategy(cpu_offload: bool = False, reshard_after_forward: bool = True) -> Strategy:
    """FSDP2 as distributed.fsdp sets it: fsdp, fsdp+offload, fsdp+no-reshard, fsdp+no-reshard+offload."""
    name = "fsdp" + ("" if reshard_after_forward else "+no-reshard") + ("+offload" if cpu_offload else "")
    return Strategy(name, None, cpu_offload, cpu_offload, fsdp=True, reshard_after_forward=reshard_after_forward)


def with_checkpointing(st: Strategy) -> Strategy:
    """The same strategy with gradient checkpointing (named `<name>+ckpt`)."""
    return replace(st, name=f"{st.name}+ckpt", checkpointing=True)


DDP = Strategy("ddp", None)
# the rows `hpcgpu estimate` prints; gpu/recommend.py's ladder names the ones distributed.strategy: auto
# may choose, which are not the FSDP rows (that choice waits for a GPU benchmark)
STRATEGIES: tuple[Strategy, ...] = (
    DDP, Strategy("zero1", 1), Strategy("zero2", 2), Strategy("zero2+offload", 2, True),
    Strategy("zero3", 3), Strategy("zero3+offload", 3, True), Strategy("zero3+offload-all", 3, True, True),
    fsdp_strategy(), fsdp_strategy(cpu_offload=True),
)


@dataclass(frozen=True)
class MemoryEstimate:
    strategy: Strategy
    micro_batch: int
    weights: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    host: int  # host RAM per rank for offloaded states

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.buffers + self.activations


# ---------------------------------------------------------------- the model's shape

def cfg_get(cfg: Any, *names: str, default: Any = None) -> Any:
    """A config value under any of its names (HF configs: n_embd == hidden_size, ...); dict or object."""
    for name in names:
        value = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def _require(cfg: Any, *names: str) -> int:
    value = cfg_get(cfg, *names)
    if value is None:
        raise HpcgpuError(f"model.config: cannot tell the model's {names[0]} (give one of {', '.join(names)})")
    return int(value)


def with_defaults(cfg: Any) -> Any:
    """A config mapping completed with its family's defaults; config objects are complete already."""
    if isinstance(cfg, Mapping):
        return {**FAMILY_DEFAULTS.get(str(cfg.get("model_type", "")), {}), **cfg}
    return cfg


# the config key of the MLP's width for families that do not call it intermediate_size (None: bloom's is 4h)
FFN_KEYS: dict[str, str | None] = {"gpt2": "n_inner", "gptj": "n_inner", "codegen": "n_inner",
                                   "gpt_bigcode": "n_inner", "opt": "ffn_dim", "bloom": None}


def ffn_size(cfg: Any, h: int, mtype: str) -> int:
    """The MLP's width, read under the family's own key (a key another family uses is ignored, as
    transformers ignores it); 4h where unset."""
    key = FFN_KEYS.get(mtype, "intermediate_size")
    return int((cfg_get(cfg, key) if key else None) or (3072 if mtype == "opt" else 4 * h))  # OPTConfig's default


def config_hidden(cfg: Any) -> int:
    """The model's hidden size (n_embd, hidden_size, d_model)."""
    return _require(with_defaults(cfg), "hidden_size", "n_embd", "d_model")


def _shape(cfg: Any) -> tuple[int, int, int, int, str]:
    cfg = with_defaults(cfg)
    return (_require(cfg, "hidden_size", "n_embd", "d_model"),
            _require(cfg, "num_hidden_layers", "n_layer", "num_layers"),
            _require(cfg, "num_attention_heads", "n_head"), _require(cfg, "vocab_size"),
            str(cfg_get(cfg, "model_type", default="")))


def analytic_params(cfg: Any) -> tuple[int, int, int]:
    """(total, per layer, embedding) parameter counts from the config alone, no torch: for dense
    GPT-2/Llama-style decoders exact, for other families approximate."""
    h, layers, heads, vocab, mtype = _shape(cfg)
    cfg = with_defaults(cfg)
    head_dim = int(cfg_get(cfg, "head_dim", default=h // heads) or h // heads)
    kv = int(cfg_get(cfg, "num_key_value_heads", default=heads) or heads)
    ffn = ffn_size(cfg, h, mtype)
    bias = mtype in BIASED
    attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim + (heads * head_dim * 2 + 2 * kv * head_dim if bias else 0)
    mlp = (3 if mtype in GATED else 2) * h * ffn + (ffn + h if bias else 0)
    norm = 2 * h if bias else h
    layer = attn + mlp + 2 * norm
    embed = vocab * h
    tied = head_is_tied(cfg)
    positions = int(cfg_get(cfg, "n_positions", "max_position_embeddings", default=0)) * h \
        if mtype in LEARNED_POSITIONS else 0
    return layers * layer + embed * (1 if tied else 2) + positions + norm, layer, embed


def dims_from_config(cfg: Any, seq_len: int, n_params: int | None = None, compiled: bool = True,
                     fused_loss: bool = False) -> ModelDims:
    """ModelDims from an HF config (object or mapping); n_params exact when counted, else analytic."""
    h, layers, heads, vocab, _ = _shape(cfg)
    total, layer, embed = analytic_params(cfg)
    attn_impl = cfg_get(cfg, "_attn_implementation", "attn_implementation", default="sdpa")
    return ModelDims(n_params=int(n_params or total), n_layers=layers, hidden=h, heads=heads, vocab=vocab,
                     seq_len=seq_len, largest_param=max(embed, layer), flash_attention=attn_impl != "eager",
                     compiled=compiled, fused_loss=fused_loss, layer_params=layer)


def model_config(spec: Spec) -> Any:
    """The spec's transformers config object (imports transformers)."""
    from transformers import AutoConfig

    try:
        if spec.model.name_or_path:
            return AutoConfig.from_pretrained(spec.model.name_or_path)
        cfg = dict(spec.model.config or {})
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except Exception as exc:  # noqa: BLE001 - the config is the user's: whatever transformers refuses, one line
        unknown = unknown_model_type(spec)
        if unknown:
            raise unknown from None
        raise HpcgpuError(f"model: cannot build the model config: {library_reason(exc)}") from exc


def unknown_model_type(spec: Spec) -> HpcgpuError | None:
    """validate's line for a model.config.model_type transformers does not know, or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = None if spec.model.name_or_path else (spec.model.config or {}).get("model_type")
    if model_type is None or isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES:
        return None
    problem = model_type_problem(spec)
    return SpecError("model.config.model_type", problem) if problem else None


def library_reason(exc: BaseException) -> str:
    """transformers' reason on one line: its first paragraph, without the list of every model type."""
    text = str(exc).strip().split("\n\n")[0].split(". Should contain one of ")[0]
    return " ".join(text.replace("`", "").split()) or type(exc).__name__


def count_params(spec: Spec) -> tuple[int, Any]:
    """(parameter count, config) of the spec's model, built on the meta device: no weights, no GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(spec)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - sizes the model cannot be built with (n_head not dividing n_embd)
        where = f"model.name_or_path {spec.model.name_or_path}" if spec.model.name_or_path else "model.config"
        raise HpcgpuError(f"{where}: {library_reason(exc)}") from exc
    return sum(p.numel() for p in model.parameters()), config  # parameters() counts tied weights once


# ---------------------------------------------------------------- LoRA and QLoRA (train.lora)
#
# train.lora freezes the base and trains adapters through peft: each adapted layer of fan in x fan out
# gets A (r x in) and B (out x r), r x (in + out) parameters. target_modules auto is peft's all-linear:
# every linear layer (nn.Linear, GPT-2's Conv1D) of the blocks' attention and MLP, not the output head;
# a list adapts the layers of those names (a name matches a layer whose path ends with it). The layer
# names and sizes come from the config (block_linears), exact for the families LINEAR_NAMES knows (the
# tests check them against peft's count); other families are read with Llama's names.
# Per rank (DDP; ZeRO-1/2 differ only in the adapters' megabytes), A = adapter parameters:
#   weights      the frozen base: Psi x 4 (float32, what model.dtype auto loads in a train job) or x 2
#                (bfloat16/float16); QLoRA: the blocks' linear weights Q quantized by bitsandbytes, int4
#                (NF4) INT4_BYTES = 0.5 + 4/64 (an fp32 absmax per 64 values) or int8 1 + an fp32 scale
#                per row, and the rest (embeddings, output head, norms, biases) in fp32 (KBIT_REST_BYTES),
#                where peft's prepare_model_for_kbit_training puts it; plus the adapters in fp32, 4 A
#   grads        4 A: the adapters' only, nothing for the frozen base
#   optimizer    AdamW's m and v in fp32: 8 A
#   buffers      DDP's buckets of the adapters' gradients 4 A when N > 1; the bf16 copies autocast keeps of
#                the adapters 2 A; a float32 base: the bf16 copies autocast makes of its weights for the
#                backward, 2 x (the blocks' linear weights, one block's under checkpointing, + the head);
#                QLoRA: one linear weight dequantized to bf16 for its matmul and the fp32 head's bf16 copy,
#                2 x (largest linear + head); int8 also 4 Q, measured (INT8_TRAIN_BYTES)
#   activations  activation_bytes as for full training, plus per adapted layer its input as the adapter
#                keeps it, s x b x fan in x (2 + 1): peft casts the input to the adapters' fp32 and
#                autocast makes a bf16 copy for each adapted layer (q, k and v keep three), and the dropout
#                mask (1 byte; none with dropout 0); int8 also every quantized layer's fp16 input (2 bytes);
#                checkpointed, one block's of these. A checkpointed layer's input is 2 bytes a value over a
#                16-bit base, 4 over a float32 one or under QLoRA (the fp32 embedding makes the residual
#                stream fp32)
# Estimate vs torch.cuda.max_memory_allocated, H200, bitsandbytes 0.50, peft 0.21, r 16 on all-linear,
# dropout 0.05, seq 2048, random weights (Llama-3.2-1B shape at micro 2, Llama-3-8B shape): with gradient
# checkpointing -1% (bf16 base), -1% (int4), 0% (float32), +5% (8B int4, micro 1), compiled bf16 -6%;
# without it compiled bf16 -2%, eager +14% (int4) to +34% (bf16) over (the eager coefficient is full
# training's, whose trained layers keep their inputs); int8 with checkpointing -17% under (a step's peak
# holds more than these terms).

LORA_INPUT_BYTES = 2  # the bf16 copy of an adapted layer's input its adapter's matmul keeps
LORA_MASK_BYTES = 1  # the dropout mask (bool) of that input, where lora.dropout > 0
KBIT_REST_BYTES = 4  # under QLoRA what bitsandbytes leaves unquantized, cast to fp32 by peft's k-bit preparation
INT8_ROW_BYTES = 4  # LLM.int8: an fp32 scale per output row
INT8_INPUT_BYTES = 2  # bitsandbytes' int8 matmul keeps its input in fp16 for the backward, frozen or not
INT8_TRAIN_BYTES = 4  # measured: bitsandbytes 0.50's int8 layers hold 4 bytes more per weight from the second step
QUANTIZED = ("int8", "int4")
LORA_BASES = ("float32", "bfloat16", "float16") + QUANTIZED
AUTO_TARGETS = "all-linear"

# a block's linear layers (path in the block; fan in and fan out by the names below) for the families
# whose module names are known: q, k, v, o (attention), up/down (MLP) and gate (gated MLPs)
_LLAMA = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")
LINEAR_NAMES: dict[str, tuple[str, ...]] = {
    "gpt2": ("attn.c_attn:qkv", "attn.c_proj:o", "mlp.c_fc:up", "mlp.c_proj:down"),
    "gpt_neox": ("attention.query_key_value:qkv", "attention.dense:o", "mlp.dense_h_to_4h:up",
                 "mlp.dense_4h_to_h:down"),
    "bloom": ("self_attention.query_key_value:qkv", "self_attention.dense:o", "mlp.dense_h_to_4h:up",
              "mlp.dense_4h_to_h:down"),
    "opt": ("self_attn.q_proj:q", "self_attn.k_proj:k", "self_attn.v_proj:v", "self_attn.out_proj:o", "fc1:up",
            "fc2:down"),
    "phi": ("self_attn.q_proj:q", "self_attn.k_proj:k", "self_attn.v_proj:v", "self_attn.dense:o", "mlp.fc1:up",
            "mlp.fc2:down"),
    "phi3": ("self_attn.qkv_proj:qkv", "self_attn.o_proj:o", "mlp.gate_up_proj:gate_up", "mlp.down_proj:down"),
    "gptj": ("attn.q_proj:q", "attn.k_proj:k", "attn.v_proj:v", "attn.out_proj:o", "mlp.fc_in:up",
             "mlp.fc_out:down"),
    "gpt_neo": ("attn.attention.q_proj:q", "attn.attention.k_proj:k", "attn.attention.v_proj:v",
                "attn.attention.out_proj:o", "mlp.c_fc:up", "mlp.c_proj:down"),
    "codegen": ("attn.qkv_proj:qkv", "attn.out_proj:o", "mlp.fc_in:up", "mlp.fc_out:down"),
    "starcoder2": ("self_attn.q_proj:q", "self_attn.k_proj:k", "self_attn.v_proj:v", "self_attn.o_proj:o",
                   "mlp.c_fc:up", "mlp.c_proj:down"),
    **{m: tuple(f"{p}:{p.rsplit('.', 1)[1].removesuffix('_proj')}" for p in _LLAMA)
       for m in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2",
                 "granite", "cohere", "smollm3")},
}

MHA_ONLY = {"gpt2", "gpt_neox", "bloom", "opt", "gptj", "gpt_neo", "codegen"}  # as many K/V heads as queries


@dataclass(frozen=True)
class LoraDims:
    """train.lora as the memory model counts it (lora_dims reads it from a config and the spec's keys)."""
    base: str  # the frozen base's weights: float32 | bfloat16 | float16 (LoRA), int8 | int4 (QLoRA)
    r: int
    adapter_params: int  # r x (fan in + fan out) over the adapted layers of every block (and the head, if named)
    adapted_inputs: int  # the fan in of one block's adapted layers: the inputs their adapters keep
    head_inputs: int  # hidden where the output head has an adapter (a list naming lm_head), else 0
    linear_params: int  # the weights of every block's linear layers: what bitsandbytes quantizes
    linear_rows: int  # their output rows (int8 keeps a scale a row)
    linear_inputs: int  # the fan in of one block's linear layers (int8 keeps each one's input)
    layer_linear_params: int  # one block's linear weights
    largest_linear: int  # the largest linear weight: dequantized whole for its matmul under QLoRA
    head_params: int  # the output head's weight (the embedding's, where tied)
    dropout: bool  # lora.dropout > 0: each adapted input keeps a dropout mask
    exact: bool = True  # the family's layer names are known (LINEAR_NAMES)

    @property
    def quantized(self) -> bool:
        return self.base in QUANTIZED


def block_linears(cfg: Any) -> tuple[list[tuple[str, int, int]], bool]:
    """([(path in the block, fan in, fan out)] of one decoder block's linear layers, whether the family's
    names are known) from the config alone; unknown families are read as Llama-named (gated MLPs) or with
    up/down projections."""
    h, _, heads, _, mtype = _shape(cfg)
    cfg = with_defaults(cfg)
    hd = int(cfg_get(cfg, "head_dim", default=h // heads) or h // heads)
    kv = heads if mtype in MHA_ONLY else int(cfg_get(cfg, "num_key_value_heads", default=heads) or heads)
    ffn = ffn_size(cfg, h, mtype)
    q, k = heads * hd, kv * hd
    size = {"q": (h, q), "k": (h, k), "v": (h, k), "o": (q, h), "qkv": (h, q + 2 * k), "gate": (h, ffn),
            "up": (h, ffn), "down": (ffn, h), "gate_up": (h, 2 * ffn)}
    names = LINEAR_NAMES.get(mtype)
    known = names is not None
    if names is None:
        names = LINEAR_NAMES["llama"] if mtype in GATED else tuple(
            p for p in LINEAR_NAMES["llama"] if not p.startswith("mlp.gate_proj"))
    return [(path, *size[part]) for path, part in (n.split(":") for n in names)], known


# where each family's decoder blocks sit in the model AutoModelForCausalLM builds (peft's module paths:
# transformer.h.0.attn.c_attn); the others' are model.layers
BLOCKS = {"gpt2": "transformer.h", "bloom": "transformer.h", "gptj": "transformer.h", "gpt_neo": "transformer.h",
          "codegen": "transformer.h", "gpt_neox": "gpt_neox.layers", "opt": "model.decoder.layers"}
HEAD = "lm_head"  # the output head's path
# families whose output head is a weight of its own unless the config says tie_word_embeddings (transformers'
# default for each; the others share the input embedding's weight)
UNTIED_BY_DEFAULT = {"gpt_neox", "phi", "gptj", "codegen", "llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3",
                     "olmo", "olmo2", "granite"}
TARGETS_KEY = "train.lora.target_modules"


def head_is_tied(cfg: Any) -> bool:
    """The output head shares the input embedding's weight (tie_word_embeddings, else the family's default)."""
    cfg = with_defaults(cfg)
    return bool(cfg_get(cfg, "tie_word_embeddings",
                        default=str(cfg_get(cfg, "model_type", default="")) not in UNTIED_BY_DEFAULT))


@dataclass(frozen=True)
class LinearLayers:
    """A model's layers LoRA can adapt (nn.Linear, GPT-2's Conv1D) as peft finds them: module path ->
    (fan in, fan out), and whether its head is tied to the input embedding. The host reads them from the
    config (linear_layers), the job from the built model (runtime/lora.py model_layers): both then ask
    target_modules_problem and adapter_shape_problem, so they decide alike."""
    model_type: str
    hidden: int
    paths: dict[str, tuple[int, int]]
    tied_head: bool


def linear_layers(cfg: Any) -> LinearLayers | None:
    """Every linear layer of a model of this config with its full path and size, as the job's model has
    them, without torch; None where not known for certain: a family outside LINEAR_NAMES, a multimodal
    config (its other towers have layers of their own), a folder's own modelling code (auto_map)."""
    mtype = cfg_get(cfg, "model_type")
    # gpt_neox's head is embed_out before transformers 5 and lm_head since: not certain here
    if (not isinstance(mtype, str) or mtype not in LINEAR_NAMES or mtype == "gpt_neox"
            or cfg_get(cfg, "text_config") is not None or cfg_get(cfg, "auto_map") is not None):
        return None
    h, layers, _, vocab, _ = _shape(cfg)
    block, _ = block_linears(cfg)
    prefix = BLOCKS.get(mtype, "model.layers")
    paths = {f"{prefix}.{i}.{rel}": (fan_in, fan_out) for i in range(layers) for rel, fan_in, fan_out in block}
    head_in = h
    # layers a config option adds: GPT-2's cross-attention, OPT's projections around a narrower embedding
    if mtype == "gpt2" and cfg_get(cfg, "add_cross_attention"):
        paths.update({f"{prefix}.{i}.crossattention.{name}": size for i in range(layers)
                      for name, size in (("c_attn", (h, 2 * h)), ("q_attn", (h, h)), ("c_proj", (h, h)))})
    proj = cfg_get(cfg, "word_embed_proj_dim")
    if mtype == "opt" and proj not in (None, h):
        paths.update({"model.decoder.project_in": (proj, h), "model.decoder.project_out": (h, proj)})
        head_in = proj
    paths[HEAD] = (head_in, vocab)
    return LinearLayers(mtype, h, paths, head_is_tied(cfg))


def target_modules_problem(targets: list[str], layers: LinearLayers | None,
                           fused_loss: bool = False) -> str | None:
    """The one decision on a train.lora.target_modules list, the host's (launch/checks.py, from the config)
    and the job's (runtime/lora.py check_targets, from the built model), one line: each name must match a
    linear layer by peft's rule (target_matches) and nothing else; the output head not where it is tied to
    the input embedding, nor under train.fused_loss. layers None (a model the host cannot read): only
    what the names alone tell."""
    if fused_loss and any(target_matches(HEAD, t) for t in targets):
        return (f"{TARGETS_KEY}: names {HEAD}, whose forward train.fused_loss skips (its adapter would not train); "
                f"drop {HEAD} or set train.fused_loss: false")
    if layers is None:
        return None
    for target in targets:
        problem = _target_problem(target, layers)
        if problem:
            return f"{TARGETS_KEY}: {problem}"
    return None


def _target_problem(target: str, layers: LinearLayers) -> str | None:
    """Why one name in target_modules adapts nothing, or nothing it should (module paths: LinearLayers)."""
    paths = list(layers.paths)
    model = f"this {layers.model_type} model"
    if layers.tied_head and target_matches(HEAD, target):
        return (f"{target} is {model}'s output head, whose weight is its input embedding's (tied): an adapter "
                f"there would change both; drop {target} (auto adapts every linear layer of the blocks)")
    if any(target_matches(path, target) for path in paths):
        return None
    modules = {path.rsplit(".", n)[0] for path in paths for n in range(1, path.count(".") + 1)}
    held = [m for m in sorted(modules) if target_matches(m, target)]
    if held:
        inside = sorted({p.rsplit(".", 1)[-1] for p in paths if any(p.startswith(m + ".") for m in held)})
        return f"{target} is not a linear layer of {model} but a module holding {', '.join(inside)}: name those"
    names = sorted({p.rsplit(".", 1)[-1] for p in paths})
    return f"{target} is not a linear layer of {model}{_did_you_mean(target, paths)}; its linear layers: " \
           f"{', '.join(names)}"


def _did_you_mean(target: str, paths: list[str]) -> str:
    """A close name: a dotted name's layer under another module (attn.c_fc -> mlp.c_fc), else a near
    spelling of a layer's name or path inside its block (c_atn -> c_attn)."""
    inside = sorted({_in_block(p) for p in paths})
    leaf = target.rsplit(".", 1)[-1]
    same_leaf = [p for p in inside if p.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(
        target, sorted({p.rsplit(".", 1)[-1] for p in paths} | set(inside)), n=1, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def _in_block(path: str) -> str:
    """A layer's path inside its block (transformer.h.3.attn.c_attn -> attn.c_attn); the path outside one."""
    parts = path.split(".")
    index = max((i for i, part in enumerate(parts) if part.isdigit()), default=-1)
    return ".".join(parts[index + 1:])


def target_matches(path: str, target: str) -> bool:
    """peft's rule for a name in a target_modules list: the module's path is the name or ends with '.name'."""
    return path == target or path.endswith("." + target)


# ---- a trained adapter folder (model.adapter), read without torch: its adapter_config.json and the
# shapes in adapter_model.safetensors' header (JSON after an 8-byte little-endian length)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class Adapter:
    folder: str
    base: str | None  # base_model_name_or_path: what it was trained on
    shapes: dict[str, tuple[int, int]]  # adapted layer path -> (fan in, fan out): lora_A is r x in, lora_B out x r


def read_adapter(folder: str) -> Adapter | None:
    """The adapter folder peft wrote (None without a readable adapter_config.json); no shapes where its
    weights are not a safetensors file."""
    path = Path(folder).expanduser()
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return Adapter(folder, base if isinstance(base, str) and base else None, adapter_shapes(path / ADAPTER_WEIGHTS))


def not_an_adapter(folder: str) -> str:
    """model.adapter naming a folder without adapter_config.json (read_adapter None), host and job."""
    return (f"model.adapter: {folder} holds no adapter_config.json (not an adapter folder: a train run's model/ "
            "with train.lora is one)")


def adapter_shapes(path: Path) -> dict[str, tuple[int, int]]:
    """layer path -> (fan in, fan out) of each layer with an adapter, from peft's keys
    (base_model.model.<path>.lora_A.weight, r x in; ...lora_B.weight, out x r)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size <= MAX_HEADER_BYTES else {}
    except (OSError, ValueError):
        return {}
    halves: dict[str, dict[str, list[int]]] = {"A": {}, "B": {}}
    for key, info in header.items() if isinstance(header, dict) else ():
        found = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
        if found and isinstance(info, dict) and len(info.get("shape") or ()) == 2:
            halves[found[2]][found[1]] = info["shape"]
    a, b = halves["A"], halves["B"]
    return {layer: (a[layer][1], b[layer][0]) for layer in a if layer in b}


def adapter_shape_problem(adapter: Adapter, layers: LinearLayers, base: str) -> str | None:
    """The one line refusing an adapter on a base without the layers it was trained on, in those shapes:
    the host's (launch/checks.py, the base's config) and the job's (runtime/lora.py load_adapter, the
    loaded base); None where every adapted layer is there, the same size."""
    for path, (fan_in, fan_out) in sorted(adapter.shapes.items()):
        here = layers.paths.get(path)
        if here == (fan_in, fan_out):
            continue
        has = f"{path} {here[0]} -> {here[1]}" if here else f"no {path}"
        return (f"model.adapter: {adapter.folder} was trained on {adapter.base or 'another base'} ({path} "
                f"{fan_in} -> {fan_out}), not on this base {base} ({layers.model_type}, hidden size "
                f"{layers.hidden}, has {has}); give model.name_or_path the base it was trained on")
    return None


def lora_dims(cfg: Any, r: int = 16, target_modules: Any = "auto", dropout: float = 0.05,
              base: str = "bfloat16") -> LoraDims:
    """The adapters of train.lora (r, target_modules: auto or [names], dropout) on a model config
    (object or mapping) whose frozen base is `base` (see LORA_BASES), without torch."""
    if base not in LORA_BASES:
        raise ValueError(f"lora_dims: base {base!r} is not one of {', '.join(LORA_BASES)}")
    h, layers, _, vocab, mtype = _shape(cfg)
    linears, known = block_linears(cfg)
    prefix = BLOCKS.get(mtype, "model.layers")
    if target_modules in ("auto", AUTO_TARGETS, None):
        adapted, hits, head_adapted = linears, linears * layers, False
    else:
        targets = [str(t) for t in target_modules]
        known_layers = linear_layers(cfg)
        problem = target_modules_problem(targets, known_layers) if known_layers else None
        if problem:
            raise SpecError(TARGETS_KEY, problem.removeprefix(f"{TARGETS_KEY}: "))
        # every block's layers the names match: a dotted name may reach into some blocks only (h.0.attn.c_attn)
        hits = [(rel, fi, fo) for i in range(layers) for rel, fi, fo in linears
                if any(target_matches(f"{prefix}.{i}.{rel}", t) for t in targets)]
        adapted = [x for x in linears if x in hits]
        head_adapted = any(target_matches(HEAD, t) for t in targets)
        if not adapted and not head_adapted:  # names of a family not known here: every linear layer, approximately
            adapted, hits, known = linears, linears * layers, False
    return LoraDims(
        base=base, r=r,
        adapter_params=sum(r * (fi + fo) for _, fi, fo in hits) + (r * (h + vocab) if head_adapted else 0),
        adapted_inputs=sum(fi for _, fi, _ in adapted), head_inputs=h if head_adapted else 0,
        linear_params=layers * sum(fi * fo for _, fi, fo in linears),
        linear_rows=layers * sum(fo for _, _, fo in linears), linear_inputs=sum(fi for _, fi, _ in linears),
        layer_linear_params=sum(fi * fo for _, fi, fo in linears),
        largest_linear=max(fi * fo for _, fi, fo in linears), head_params=vocab * h, dropout=dropout > 0,
        exact=known)


def lora_base_format(spec: Spec) -> str:
    """The frozen base of a train.lora spec as the train task loads it: model.quantization (QLoRA), else
    model.dtype, whose auto is float32 in a train job (runtime/model.py build_model)."""
    if spec.model.quantization != "none":
        return spec.model.quantization
    return "float32" if spec.model.dtype == "auto" else spec.model.dtype


def spec_lora_dims(spec: Spec, cfg: Any, base: str | None = None) -> LoraDims:
    """lora_dims of the spec's train.lora (the schema's defaults where the spec has none: the rows a full
    fine-tuning spec is compared with) on its frozen base (lora_base_format, or `base`)."""
    from hpcgpu.spec.schema import Lora

    lora = spec.train.lora or Lora()
    return lora_dims(cfg, lora.r, lora.target_modules, lora.dropout, base or lora_base_format(spec))


def lora_weight_bytes(n_params: int, a: LoraDims) -> int:
    """The frozen base's weights (module comment above), without the adapters."""
    if a.base == "float32":
        return 4 * n_params
    if not a.quantized:
        return 2 * n_params
    q = min(a.linear_params, n_params)
    rest = KBIT_REST_BYTES * (n_params - q)
    if a.base == "int8":
        return q + INT8_ROW_BYTES * a.linear_rows + rest
    return int(INT4_BYTES * q) + rest


# ---------------------------------------------------------------- bytes

def activation_bytes(d: ModelDims, micro: int, st: Strategy = DDP, lora: LoraDims | None = None) -> int:
    """Activations of a micro batch; with `lora` (train.lora) plus what the adapters keep (LoRA section)."""
    s, b, h = d.seq_len, micro, d.hidden
    coef = ACT_PER_LAYER if d.compiled and st.zero_stage is None else ACT_PER_LAYER_EAGER
    per_layer = s * b * h * coef + (0 if d.flash_attention else ATTN_SCORES * d.heads * s * s * b)
    head_trains = lora is None  # under train.lora the head is frozen: no fp32 gradient of it to accumulate
    logits = (b * s * h * LOGITS_BYTES + (4 * d.vocab * h if head_trains else 0) if d.fused_loss
              else b * s * d.vocab * LOGITS_BYTES)
    kept = CKPT_INPUT_BYTES_ZERO if st.bf16_weights else CKPT_INPUT_BYTES_DDP
    if lora is not None:
        keep = LORA_INPUT_BYTES + (LORA_MASK_BYTES if lora.dropout else 0)
        per_layer += s * b * lora.adapted_inputs * keep
        if lora.base == "int8":
            per_layer += s * b * lora.linear_inputs * INT8_INPUT_BYTES
        logits += s * b * lora.head_inputs * keep
        kept = CKPT_INPUT_BYTES_ZERO if lora.base in ("bfloat16", "float16") else CKPT_INPUT_BYTES_DDP
    if st.checkpointing:  # inputs of every layer + one layer recomputed (module docstring)
        if lora is not None and d.compiled and st.zero_stage is None:
            kept = int(kept * CKPT_COMPILED_INPUTS)
        return d.n_layers * s * b * h * kept + per_layer + logits
    return d.n_layers * per_layer + logits


def lora_state_bytes(d: ModelDims, a: LoraDims, st: Strategy, world: int) -> tuple[int, int, int, int, int]:
    """(weights, grads, optimizer, buffers, host RAM) per rank under train.lora (LoRA section)."""
    n_adapter, n = a.adapter_params, max(1, world)
    buffers = (4 * n_adapter if n > 1 else 0) + 2 * n_adapter
    if a.base == "float32":
        buffers += 2 * ((a.layer_linear_params if st.checkpointing else a.linear_params) + a.head_params)
    elif a.quantized:
        buffers += 2 * (a.largest_linear + a.head_params)
        if a.base == "int8":
            buffers += INT8_TRAIN_BYTES * a.linear_params
    return lora_weight_bytes(d.n_params, a) + 4 * n_adapter, 4 * n_adapter, 8 * n_adapter, buffers, 0


def state_bytes(d: ModelDims, st: Strategy, world: int, lora: LoraDims | None = None) -> tuple[int, int, int, int, int]:
    """(weights, grads, optimizer, buffers, host RAM) per rank for the model states; `lora`: train.lora's."""
    if lora is not None:
        return lora_state_bytes(d, lora, st, world)
    p, n = d.n_params, max(1, world)
    if st.fsdp:
        return fsdp_state_bytes(d, st, n)
    if st.zero_stage is None:
        return 4 * p, 4 * p, 8 * p, (4 * p if n > 1 else 0) + 2 * p, 0
    buckets = 2 * 2 * min(p, ZERO_BUCKET_ELEMS)
    if st.zero_stage < 3:
        grads = 2 * p if st.zero_stage <= 1 else 2 * p // n
        if st.offload_optimizer:
            return 2 * p, 0, 0, buckets, 16 * p // n
        return 2 * p, grads, 12 * p // (n if st.zero_stage else 1), buckets, 0
    gathered = 2 * (2 * d.largest_param + 2 * (p - d.largest_param) // max(1, d.n_layers))
    if st.offload_params:
        return 0, 0, 0, gathered + buckets // 2, 18 * p // n
    if st.offload_optimizer:
        return 2 * p // n, 0, 0, gathered + buckets // 2, 16 * p // n
    return 2 * p // n, 2 * p // n, 12 * p // n, gathered + buckets // 2, 0


def fsdp_state_bytes(d: ModelDims, st: Strategy, n: int) -> tuple[int, int, int, int, int]:
    """(weights, grads, optimizer, buffers, host RAM) per rank under FSDP2 (module docstring): fp32
    shards of 16 bytes a parameter, on the GPU or (cpu_offload) in host RAM, and the gathered working set."""
    p, layer, root = d.n_params, block_params(d), root_params(d)
    gathered_blocks = 2 if st.reshard_after_forward else d.n_layers  # computed + prefetched, or all of them
    buffers = (2 * root  # the root's bf16 weights: gathered at its forward, kept to the end of the backward
               + 2 * root  # their unsharded bf16 grads, from the head's backward to the root's reduce
               + 2 * gathered_blocks * layer  # the blocks' bf16 weights
               + 4 * layer)  # one block's unsharded grads, cast to fp32 for the reduce-scatter
    if st.offload_params:
        return 0, 0, 0, buffers, 16 * p // n
    return 4 * p // n, 4 * p // n, 8 * p // n, buffers, 0


def estimate(d: ModelDims, st: Strategy, micro: int, world: int, lora: LoraDims | None = None) -> MemoryEstimate:
    """Memory per rank of `st` at a micro batch; `lora`: training train.lora's adapters on a frozen base."""
    w, g, o, buf, host = state_bytes(d, st, world, lora)
    return MemoryEstimate(st, micro, w, g, o, buf, activation_bytes(d, micro, st, lora), host)


def usable_bytes(gpu_total: int) -> int:
    return int(gpu_total * USABLE_FRACTION) - USABLE_RESERVE


def max_micro_batch(d: ModelDims, st: Strategy, world: int, gpu_total: int, lora: LoraDims | None = None) -> int:
    """The largest micro batch whose estimate fits (0: not even one sequence). Activations are linear
    in the micro batch, so this is a division, not a search."""
    fixed = estimate(d, st, 0, world, lora).total  # with what the activations hold at any micro batch
    per_sample = activation_bytes(d, 1, st, lora) - activation_bytes(d, 0, st, lora)
    room = usable_bytes(gpu_total) - fixed
    return max(0, room // per_sample) if per_sample else 0


def fits(e: MemoryEstimate, gpu_total: int) -> bool:
    return e.total <= usable_bytes(gpu_total)


# ---------------------------------------------------------------- sizes as people write them

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'80G', '80GB', '79.6GiB', '81559M' -> bytes (binary units, as SLURM's --mem reads them); a bare
    number is GiB (nobody means 80 bytes)."""
    m = _SIZE.match(text)
    if not m:
        raise HpcgpuError(f"--gpu-memory: {text!r} is not a size like 80G, 40GB or 81559M")
    unit = m.group(2) or ("B" if m.group(3) else "G")
    return int(float(m.group(1)) * 1024 ** "BKMGT".index(unit.upper()))


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB / 10 else f"{n / (1 << 20):.0f} MiB"


# ---------------------------------------------------------------- inference (task: infer)
#
# One model copy (replica), per GPU. `hpcgpu estimate` prints these and the job fits its batch_size:
# auto with them (runtime/tasks/infer.py row_bytes, memory_budget; runtime/plan.py plan_infer).
#   weights      Psi x bytes per parameter: float32 4, bfloat16/float16 2; int8 (bitsandbytes LLM.int8)
#                1 and int4 (NF4, one fp32 absmax per 64 values) 0.5 + 4/64 for the linear layers, the
#                embedding kept in 16 bits (bitsandbytes quantizes nn.Linear only)
#   per row of a batch of T tokens (generate: the longest prompt + max_new_tokens; score: the longest
#   text), c bytes of the compute dtype (4 for float32 weights, else 2):
#   KV cache     2 (K, V) x layers x kv_heads x head_dim x T x c; none in score mode (one forward)
#   activations  16 x hidden x T x c, the attention and MLP intermediates of one layer, plus the
#                logits: generate V x 16 (the last position's fp32 logits and the sampling copies),
#                score T x V x (c + 8) (logits, fp32 copy, log-probabilities), plus heads x T x T x c
#                attention scores where attention is eager
#   room         what the rows may use: HEADROOM of the memory free beside the weights less
#                HEADROOM_BYTES (allocator slack, CUDA graphs, library workspaces), within
#                infer.max_memory's cap
# The row figures are the job's, which its GPU runs were sized by.

INT4_BYTES = 0.5 + 4 / 64
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": INT4_BYTES}
INFER_FORMATS = ("float32", "bfloat16", "int8", "int4")  # the rows `hpcgpu estimate` shows
ACT_PER_TOKEN = 16  # x hidden: one layer's attention and MLP intermediates, per token of a row
HEADROOM = 0.9  # of the GPU memory free beside the weights, for the rows of a batch (the rest: allocator slack)
HEADROOM_BYTES = GiB  # and this much less again (CUDA graphs, library workspaces)
# batch_size: auto on a GPU: the largest power of two that fits (GPUs of one kind whose free memory
# differs by a few MB choose the same), at most the cap. The batch engine (score mode, models the slot
# engine does not take) also keeps it small enough to make INFER_MIN_BATCHES batches where that leaves
# INFER_MIN_ROWS rows or more a batch (many replicas all get rows, a stop comes soon); the slot engine
# (generate) to SLOT_FILLS fills of every replica's slots (its slots refill row by row: more slots are
# more rows a decode step, up to the cap, where the KV cache read dominates the step)
INFER_BATCH_CAP = {"generate": 256, "score": 64, "slots": 512}
INFER_MIN_BATCHES = 16
INFER_MIN_ROWS = 8
SLOT_FILLS = 2


@dataclass(frozen=True)
class InferDims:
    n_params: int
    n_layers: int
    hidden: int
    heads: int
    kv_dim: int  # kv_heads x head_dim: the width of K (and of V) per token and layer
    ffn: int
    vocab: int
    embed_params: int  # the input embedding (kept 16-bit under int8/int4)
    context: int | None  # the longest sequence the model takes (n_positions, max_position_embeddings)
    flash_attention: bool = True


@dataclass(frozen=True)
class InferEstimate:
    weights_format: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def infer_dims(cfg: Any, n_params: int | None = None) -> InferDims:
    """The shape inference memory depends on, from a transformers config (object or mapping): the one
    reader for `hpcgpu estimate` and the job."""
    h, layers, heads, vocab, mtype = _shape(cfg)
    cfg = with_defaults(cfg)
    total, _, embed = analytic_params(cfg)
    head_dim = int(cfg_get(cfg, "head_dim", default=h // heads) or h // heads)
    kv_heads = int(cfg_get(cfg, "num_key_value_heads", default=heads) or heads)
    ffn = ffn_size(cfg, h, mtype)
    context = cfg_get(cfg, "n_positions", "max_position_embeddings")
    attn_impl = cfg_get(cfg, "_attn_implementation", "attn_implementation", default="sdpa")
    return InferDims(n_params=int(n_params or total), n_layers=layers, hidden=h, heads=heads,
                     kv_dim=kv_heads * head_dim, ffn=ffn, vocab=vocab, embed_params=embed,
                     context=int(context) if context else None, flash_attention=attn_impl != "eager")


def compute_bytes(weights_format: str) -> int:
    """Bytes of the dtype the model computes in: quantized weights compute in 16 bits."""
    return 4 if weights_format == "float32" else 2


def weight_bytes(d: InferDims, weights_format: str) -> int:
    per = WEIGHT_BYTES[weights_format]
    if weights_format in ("int8", "int4"):
        embed = min(d.embed_params, d.n_params)
        return int(per * (d.n_params - embed) + 2 * embed)
    return int(per * d.n_params)


def infer_row_bytes(d: InferDims, mode: str, tokens: int, c: int) -> tuple[int, int]:
    """(KV cache, activations with the logits) of one row of `tokens` tokens, c bytes a value."""
    activations = tokens * d.hidden * ACT_PER_TOKEN * c
    if not d.flash_attention:
        activations += d.heads * tokens * tokens * c
    if mode == "score":
        return 0, activations + tokens * d.vocab * (c + 8)
    return 2 * d.n_layers * d.kv_dim * tokens * c, activations + d.vocab * 16


def row_tokens(prompt: int, new: int, mode: str) -> int:
    return prompt if mode == "score" else prompt + new


def row_bytes_per_gpu(d: InferDims, mode: str, tokens: int, c: int, gpus: int = 1) -> int:
    """One row's memory on one GPU of a copy split over `gpus`: its share of the KV cache (a layer's K
    and V live on that layer's GPU) and the whole activations (the batch passes every GPU in turn)."""
    kv, activations = infer_row_bytes(d, mode, tokens, c)
    return -(-kv // max(1, gpus)) + activations


def rows_room(free: int, cap_left: int | None = None) -> int:
    """Memory one GPU has for the rows of a batch: HEADROOM of the `free` bytes beside its weights less
    HEADROOM_BYTES, within `cap_left` (infer.max_memory's cap less the weights) where there is a cap."""
    room = int(free * HEADROOM) - HEADROOM_BYTES
    return max(0, room if cap_left is None else min(room, cap_left))


# architectures whose slot-engine decode (runtime/slots.py) the tests check token for token against generate
SLOT_MODEL_TYPES = ("llama", "gpt2", "qwen2", "mistral")


def why_batches(mode: str, setting: str, config: Any, quantization: str, width: int, devices: int = 1) -> str | None:
    """Why a run takes the batch engine (one short clause for the log), or None: the slot engine. The
    job asks it of the loaded model (runtime/tasks/infer.py pick_engine), `hpcgpu estimate` of the spec's
    config and each table row's placement, so the two show the same engine and the same auto batch."""
    from transformers import cache_utils

    if mode == "score":
        return "score mode: one forward a batch"
    if setting == "batches":
        return "infer.engine: batches"
    if devices > 1:
        return f"the model copy is split over {devices} devices (accelerate's hooks)"
    if quantization != "none":
        return f"{quantization} weights (bitsandbytes)"
    if not hasattr(cache_utils, "CacheLayerMixin"):
        return "this transformers has no cache layer API (4.56 or newer has)"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    kind = getattr(config, "model_type", None)
    if kind not in SLOT_MODEL_TYPES:
        return f"model type {kind!r} is not one it was checked with ({', '.join(SLOT_MODEL_TYPES)})"
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in ("sdpa", "eager"):
        return f"attention {attn!r} takes no 4D mask"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < width:
        return f"sliding-window attention ({window} tokens, shorter than the rows' {width})"
    return None


def infer_batch_limit(mode: str, rows: int | None = None, engine: str = "slots",
                      replicas: int = 1) -> tuple[int, str]:
    """The most rows batch_size: auto puts in a batch (slots: in the slots) for `rows` rows (None: not
    known) over `replicas` model copies, and why."""
    if mode == "generate" and engine == "slots":
        cap = INFER_BATCH_CAP["slots"]
        spread = cap if rows is None else max(INFER_MIN_ROWS, pow2_floor(-(-rows // (SLOT_FILLS * replicas))))
        if spread >= cap:
            return cap, f"at most {cap} slots"
        return spread, f"at most {spread} slots: {SLOT_FILLS} fills of each replica's slots from the {rows} rows"
    cap = INFER_BATCH_CAP[mode]
    spread = cap if rows is None else max(INFER_MIN_ROWS, pow2_floor(-(-rows // INFER_MIN_BATCHES)))
    if spread >= cap:
        return cap, f"at most {cap}"
    return spread, f"at most {spread} for {INFER_MIN_BATCHES} batches of the {rows} rows"


def auto_infer_batch(fit: int, mode: str, rows: int | None = None, engine: str = "slots", replicas: int = 1) -> int:
    """batch_size: auto on a GPU where `fit` rows fit: the largest power of two within the limit, at least 1."""
    return max(1, min(infer_batch_limit(mode, rows, engine, replicas)[0], pow2_floor(fit)))


def pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def infer_estimate(d: InferDims, weights_format: str, batch: int, prompt: int, new: int,
                   mode: str = "generate") -> InferEstimate:
    """Memory of one replica on one GPU for `batch` rows of `prompt` tokens (+ `new` generated)."""
    new = 0 if mode == "score" else new
    kv, activations = infer_row_bytes(d, mode, row_tokens(prompt, new, mode), compute_bytes(weights_format))
    return InferEstimate(weights_format, batch, prompt, new, weight_bytes(d, weights_format), batch * kv,
                         batch * activations)


def spec_weights_format(spec: Spec) -> str:
    """The weights as the job loads them on a GPU: quantization, else the dtype (auto: bfloat16)."""
    if spec.model.quantization != "none":
        return spec.model.quantization
    return "bfloat16" if spec.model.dtype == "auto" else spec.model.dtype


# ---------------------------------------------------------------- a model copy over several GPUs
#
# gpus_per_replica: the layers of one copy are spread over g GPUs of a node (accelerate's planner,
# device_map="auto"), optionally with a part on the CPU (max_memory "...,cpu=SIZE"). A split fits when
# the weights take at most WEIGHTS_SHARE of the g GPUs' usable memory (plus the CPU part): the rest
# holds a batch's KV cache and activations. The one rule for `estimate`, `submit` (auto) and the job.
#
# Per GPU of a width-g split (infer_split_estimate), for the table `hpcgpu estimate` shows:
#   weights      (weights - offloaded) / g: each GPU holds its share of the layers; offloaded is the part
#                accelerate puts in CPU memory (max_memory cpu=), what WEIGHTS_SHARE of the g GPUs leaves
#   KV cache     / g: a layer's K and V live on the GPU of that layer
#   activations  not divided: the whole batch passes through every GPU in turn
# The batch: the least over the g GPUs of rows_room over one row's share (row_bytes_per_gpu), by
# `hpcgpu estimate` for a GPU of the given size and by the job for what its GPUs have free.

REPLICA_WIDTHS = (1, 2, 4, 8)  # the widths `hpcgpu estimate` shows
WEIGHTS_SHARE = 0.85


@dataclass(frozen=True)
class MaxMemory:
    """infer.max_memory: a per-GPU cap (None: auto, the GPU's free memory less headroom) and the CPU
    memory the weights may be offloaded to (0: none)."""
    gpu: int | None = None
    cpu: int = 0

    def gpu_budget(self, gpu_total: int | None) -> int | None:
        """The memory one GPU of a replica may use: the cap, else the card's usable memory."""
        if self.gpu is not None:
            return self.gpu if gpu_total is None else min(self.gpu, usable_bytes(gpu_total))
        return usable_bytes(gpu_total) if gpu_total else None


def parse_max_memory(text: str) -> MaxMemory:
    """'auto', '70GiB', '70GiB,cpu=200GiB' or 'auto,cpu=100G' -> MaxMemory; a bad one names the key."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        gpu = None if parts[0] == "auto" else parse_size(parts[0])
        cpu = 0
        for extra in parts[1:]:
            key, sep, value = extra.partition("=")
            if key.strip() != "cpu" or not sep:
                raise HpcgpuError(extra)
            cpu = parse_size(value.strip())
    except HpcgpuError:
        raise HpcgpuError(f"infer.max_memory: {text!r} is not auto or a size like 70GiB, optionally followed by "
                          "',cpu=SIZE' (weights offloaded to CPU memory)") from None
    return MaxMemory(gpu, cpu)


def replica_fits(weights: int, gpus: int, gpu_budget: int, cpu_bytes: int = 0) -> bool:
    return weights <= gpus * gpu_budget * WEIGHTS_SHARE + cpu_bytes


def fewest_gpus_per_replica(weights: int, gpu_budget: int, gpus_per_node: int, cpu_bytes: int = 0) -> int | None:
    """The fewest GPUs of a node (a divisor of gpus_per_node: every GPU serves a replica) one copy of
    `weights` bytes fits on; None: not even all of them."""
    for g in range(1, gpus_per_node + 1):
        if gpus_per_node % g == 0 and replica_fits(weights, g, gpu_budget, cpu_bytes):
            return g
    return None


def config_weight_bytes(cfg: Any, weights_format: str) -> int:
    """The weights of a model config (dict or object) as loaded in `weights_format`, without torch."""
    return weight_bytes(infer_dims(cfg), weights_format)


def offloaded_bytes(weights: int, gpus: int, gpu_budget: int, cpu_bytes: int = 0) -> int:
    """The part of a copy's weights put in CPU memory: what WEIGHTS_SHARE of the `gpus` GPUs' budget
    does not hold, at most cpu_bytes (0 without max_memory's cpu=)."""
    return min(cpu_bytes, max(0, weights - int(gpus * gpu_budget * WEIGHTS_SHARE)))


def infer_split_estimate(d: InferDims, weights_format: str, batch: int, prompt: int, new: int,
                         mode: str = "generate", gpus: int = 1, offloaded: int = 0) -> InferEstimate:
    """Memory of one GPU of a copy whose layers are split over `gpus` GPUs: the weights on GPUs and the
    KV cache divide, the activations do not (see the section comment)."""
    e = infer_estimate(d, weights_format, batch, prompt, new, mode)
    return InferEstimate(weights_format, batch, e.prompt_tokens, e.new_tokens, -(-(e.weights - offloaded) // gpus),
                         -(-e.kv_cache // gpus), e.activations)


def infer_split_max_batch(d: InferDims, weights_format: str, prompt: int, new: int, mode: str, gpus: int,
                          gpu_memory: int, offloaded: int = 0, cap: int | None = None) -> int:
    """The largest batch one GPU of a width-`gpus` copy holds beside its share of the weights (0: not
    even one row): rows_room of what a `gpu_memory` GPU has free (within the `cap` per GPU) over one
    row's share, the rule the job's batch_size: auto fits by."""
    held = -(-(weight_bytes(d, weights_format) - offloaded) // gpus)
    room = rows_room(gpu_memory - held, None if cap is None else cap - held)
    per_row = row_bytes_per_gpu(d, mode, row_tokens(prompt, new, mode), compute_bytes(weights_format), gpus)
    return room // per_row
