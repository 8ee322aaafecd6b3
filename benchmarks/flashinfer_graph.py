"""FlashInfer's paged decode the slot engine's way (issue #46), for benchmarks/decode_attention_probe.py's
"flashinfer graph" rows: NOT in hpcgpu. On an H100 (FlashInfer 0.5.3, torch 2.x, CUDA 13) this plan-once,
page-lists-written-on-the-device form passed a kernel test once (512 slots x 256 columns, CUDA-core
kernel, in a captured graph, against masked sdpa) and failed everywhere else: illegal memory accesses
(the probe at 512 x 640, the tensor-core kernel at 32 x 256 even uncaptured), "operation not supported
on global/shared address space", and in the engine at 128 slots (tensor-core) greedy text that parted
from varlen's in 49% of 384 rows. FlashInfer's kernels read a request's length from indptr before their
`griddepcontrol.wait` (decode.cuh), so a programmatic dependent launch right after `update` reads stale
lists: `enable_pdl=False` below; the crashes stayed. Planned at the exact lengths (no CUDA graph) the same
kernel is right (max error 0.0038) and 2.0x the varlen kernel at 512 slots (the probe's "flashinfer" row).

The slot cache is stored (slots, width, KV heads, head dim), contiguous: read as FlashInfer's NHD paged
cache it is slots x width pages of page_size 1, so a slot's live columns [start, col] are the pages
slot x width + start ... slot x width + col, whatever the column a row starts at (rows are left-padded
in their prefill group). The kernel reads those pages only.

Planned once, for every slot at the cache's full width, in FlashInfer's CUDA-graph mode (fixed buffers);
each step then writes the slots' page lists (indptr, indices) into those buffers on the device, so a
captured step needs no host plan. A split of a slot's KV follows the planned lengths, not the step's:
the CUDA-core kernel does not split with as many (slot, KV head) pairs as the GPU runs blocks at once
(`plan_splits`); the tensor-core kernel is planned with `disable_split_kv`.
"""
from __future__ import annotations

import time
from typing import Any

import torch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partials; its docs' size)
HEAD_DIMS = (64, 128, 256)  # the head dims FlashInfer's decode kernels are built for


def unavailable(dtype: torch.dtype, dim: int) -> str | None:
    """Why FlashInfer's decode cannot run this model here (None: it can): the package, the dtype, the
    head dim. The GPU's generation is the caller's check (the varlen kernel needs the same)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{str(dtype).replace('torch.', '')} weights (FlashInfer takes fp16 and bf16)"
    if dim not in HEAD_DIMS:
        return f"head dim {dim} (FlashInfer's decode takes {', '.join(map(str, HEAD_DIMS))})"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - not installed, or a build that does not load here
        first = next((x for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
        return f"FlashInfer is not importable ({first[:160]}; pip install 'hpcgpu[flashinfer]')"
    return None


def page_lists(start: torch.Tensor, col: torch.Tensor, width: int, places: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged cache's lists for slots whose live columns are [start, col] in a (slots, width) cache of
    pages of one column: (indptr[1:], the slots' ends in the list; indices, the page at each place, valid
    up to the last end), at fixed shapes (places: arange(slots x width)), with no host sync."""
    lengths = (col - start + 1).to(torch.int32)
    ends = torch.cumsum(lengths, 0, dtype=torch.int32)
    slot = torch.searchsorted(ends, places, right=True).clamp_(max=len(start) - 1)
    first = ends[slot] - lengths[slot]
    return ends, (slot * width + start.to(torch.int32)[slot] + places - first).to(torch.int32)


class FlashInferDecode:
    """FlashInfer's batch decode over the slot cache: `update` (each step's page lists, on the device),
    `attend` (one layer). `setup_s`: import, plan and the kernels' first load or compile."""

    def __init__(self, slots: int, width: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                 device: torch.device, tensor_cores: bool = False):
        t0 = time.perf_counter()
        import flashinfer

        self.slots, self.width, self.heads, self.kv_heads, self.dim = slots, width, heads, kv_heads, dim
        int32 = dict(dtype=torch.int32, device=device)
        self.indptr = torch.arange(slots + 1, **int32) * width
        self.indices = torch.arange(slots * width, **int32)
        self.last_page_len = torch.ones(slots, **int32)
        self.pages = torch.arange(slots * width, **int32)  # a page's place in the flat list of live pages
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores, paged_kv_indptr_buffer=self.indptr,
            paged_kv_indices_buffer=self.indices, paged_kv_last_page_len_buffer=self.last_page_len)
        self.dtype, self.tensor_cores = dtype, tensor_cores
        self.scale: float | None = None
        self.plan(dim ** -0.5)
        torch.cuda.synchronize(device)
        self.setup_s = time.perf_counter() - t0

    def plan(self, scale: float) -> None:
        """FlashInfer's plan for every slot at the full width (its page lists are rewritten each step)."""
        n, w = self.slots, self.width
        self.wrapper.plan(torch.arange(n + 1, dtype=torch.int32) * w, torch.arange(n * w, dtype=torch.int32),
                          torch.ones(n, dtype=torch.int32), self.heads, self.kv_heads, self.dim, 1,
                          q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=scale,
                          disable_split_kv=self.tensor_cores)  # the CUDA-core kernel ignores it
        self.scale = scale

    def plan_splits(self) -> bool:
        """Whether FlashInfer split a slot's KV over several blocks in its plan (DecodePlanInfo's last
        field): then a step's page lists may not outgrow the plan's tiles, and this plan cannot run. The
        tensor-core plan is made with disable_split_kv: it never splits."""
        if self.tensor_cores:
            return False
        try:  # a tvm-ffi Array of DecodePlanInfo's 10 fields, split_kv last
            return bool(list(self.wrapper._plan_info)[9])
        except (AttributeError, TypeError, IndexError):  # another FlashInfer's plan: assume it splits
            return True

    def update(self, start: torch.Tensor, col: torch.Tensor) -> None:
        """Each slot's live columns [start, col] as its pages, written into the plan's buffers in place
        (device ops only: a captured step replays them)."""
        ends, indices = page_lists(start, col, self.width, self.pages)
        self.indptr[1:].copy_(ends)
        self.indices.copy_(indices)

    @torch.compiler.disable
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """One query token a slot: query (slots, heads, 1, dim), key/value the flat cache (slots x width,
        KV heads, dim); (slots, 1, heads, dim) back."""
        if scale != self.scale:  # a model of another attention scale: planned again (before any capture)
            self.plan(scale)
        q = query.transpose(1, 2).reshape(self.slots, self.heads, self.dim)
        pages = (key.view(-1, 1, self.kv_heads, self.dim), value.view(-1, 1, self.kv_heads, self.dim))
        # no programmatic dependent launch: FlashInfer's kernels read a request's length from indptr before
        # they wait on the kernel before them, which is update's when this is a step's first layer (with it
        # on, an H100 read stale page lists: wrong rows, illegal addresses)
        out = self.wrapper.run(q, pages, enable_pdl=False)
        return out.reshape(self.slots, 1, self.heads, self.dim)

    def describe(self) -> str:
        """Where its kernels came from, for the start-up line."""
        from flashinfer.jit import env

        cores = "tensor-core kernel, unsplit: too few slots for the CUDA-core one" if self.tensor_cores \
            else "CUDA-core kernel"
        return f"{cores}; kernels ready in {self.setup_s:.1f}s, cached in {env.FLASHINFER_CACHE_DIR}"
