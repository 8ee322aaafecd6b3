"""PyTorch FSDP2 (`distributed.strategy: fsdp`): `fully_shard` on each transformer block, then the root.

Sharding replaces every parameter by a sharded DTensor, so it happens before an optimizer is made
(the train task) or the optimizer is pointed at the new parameters (`ctx.prepare`, `rebind_optimizer`).
Checkpoints need nothing of their own: torch.distributed.checkpoint's get/set_state_dict read and write
the shards, and a checkpoint saved at N ranks loads at M (DCP reshards). The final model is gathered
whole (`full_state_dict`) for save_pretrained.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime import dist as _dist
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.strategies.base import Strategy
from hpcgpu.spec.schema import Fsdp

log = logging.getLogger("hpcgpu")

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to shard one by one: Hugging Face's own unit (`_no_split_modules`, the layer class
    it never splits across devices), else every entry of the model's ModuleLists (a user's model)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    return [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]


def fsdp_kwargs(options: Fsdp, precision: str, device: torch.device) -> dict[str, Any]:
    """fully_shard's arguments: the mesh of every rank, the gather dtype of the plan's precision
    (weights stay fp32 in their shards), the spec's reduce dtype and CPU offload."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if options.cpu_offload and device.type != "cuda":
        raise HpcgpuError("distributed.fsdp.cpu_offload: the ranks run on CPUs already; set it to false")
    world = dist.get_world_size() if dist.is_initialized() else 1
    kwargs: dict[str, Any] = {"mesh": init_device_mesh(device.type, (world,))}
    if precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[options.reduce_dtype])
    if options.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    return kwargs


def shard_model(model: torch.nn.Module, options: Fsdp, precision: str, device: torch.device,
                compile_blocks: bool = False) -> torch.nn.Module:
    """The model sharded in place (the same object, now an FSDPModule): each block compiled where
    asked (a graph per block, as torchtitan does: FSDP's collectives stay outside the graphs), then
    sharded; the last block keeps its gathered weights for the backward that follows at once."""
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise HpcgpuError("distributed.strategy: fsdp needs a process group: run it through hpcgpu (submit, "
                          "the local executor, srun or torchrun)")
    kwargs = fsdp_kwargs(options, precision, device)
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        if compile_blocks:
            block.compile()
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=options.reshard_after_forward and not last, **kwargs)
    fully_shard(model, reshard_after_forward=options.reshard_after_forward, **kwargs)
    log.info(f"fsdp: {len(blocks)} block(s) and the root sharded over {kwargs['mesh'].size()} rank(s)"
             + (", blocks compiled" if compile_blocks else "")
             + (f", weights gathered in {precision}" if precision == "bf16" else "")
             + (", CPU offload" if options.cpu_offload else ""))
    return model


def rebind_optimizer(optimizer: torch.optim.Optimizer, before: dict[str, torch.nn.Parameter],
                     model: torch.nn.Module) -> None:
    """Point an optimizer made before sharding at the sharded parameters, by name. Its state must be
    empty (no step taken): a state of whole tensors cannot follow the parameters into shards."""
    if any(optimizer.state.values()):
        raise HpcgpuError("ctx.prepare: under distributed.strategy: fsdp the optimizer must not have stepped "
                          "yet; call ctx.prepare(model, optimizer) before the first step")
    name_of = {id(p): n for n, p in before.items()}
    after = dict(model.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [after[name_of[id(p)]] for p in group["params"]]
        except KeyError:
            raise HpcgpuError("ctx.prepare: the optimizer holds a parameter that is not the model's; under "
                              "distributed.strategy: fsdp it must be made from model.parameters()") from None


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the whole weights on rank 0's CPU (empty on the other ranks), for save_pretrained."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class FSDP(Strategy):
    name = "fsdp"
    lone_rank_group = True

    def shard(self, module: torch.nn.Module, compile_blocks: bool = False) -> torch.nn.Module:
        """Sharded in place, before its optimizer is made. CPU offload is the plan's (recorded at the
        first start), the other options the spec's."""
        spec_options = self.spec.distributed.fsdp if self.spec is not None else Fsdp()
        options = dataclasses.replace(spec_options, cpu_offload=self.plan.training.offload_params)
        return shard_model(module, options, self.plan.precision, self.device, compile_blocks=compile_blocks)

    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> torch.nn.Module:
        """Sharding makes new parameters: the optimizer follows them."""
        module = self.place(module)
        _dist.init_process_group(env, self.spec, self.device, alone=True)  # a lone rank's group
        before = dict(module.named_parameters())
        module = self.shard(module)
        rebind_optimizer(optimizer, before, module)
        return module

    def compiled(self, model: torch.nn.Module, mode: str) -> torch.nn.Module:
        return model  # each block was compiled as it was sharded

    def describe(self) -> str:
        return self.name + (" (CPU offload)" if self.plan.training.offload_params else "")

    def guards_first_step(self) -> bool:
        return False  # its forward gathers weights: a collective a rank out of memory would leave waiting

    def final_state_dict(self, lora: bool) -> dict[str, torch.Tensor] | None:
        return full_state_dict(self.module)
