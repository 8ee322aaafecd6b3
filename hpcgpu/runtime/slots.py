"""The slot engine of `task: infer` (generate): a static KV cache of N slots, a decode step for every
slot at one fixed shape (captured once as a CUDA graph on a GPU), rows that refill free slots.

Why this shape: with a dynamic cache a decode step costs ~20 ms of Python and kernel launches
whatever the batch; the GPU's bound is a fraction of a millisecond. A cache allocated once (slots x
width columns, width = the run's longest prompt + max_new_tokens, rounded up) gives every decode step
the same shapes, so one CUDA graph replays SYNC_STEPS of them per launch, and the host looks at the
tokens only between two replays. A row that ends (EOS, a stop string, max_new_tokens) frees its slot;
the next rows are prefilled (uncaptured, left-padded, a few at a time) into the free slots, so a batch
never waits for its longest row.

Each slot holds its own row: its prompt's keys and values in columns [start, L) of the slot, its
generated tokens after them. The decode step writes slot s's new key/value at its own column col[s]
(an index_copy_, SlotLayer.update) and attends to columns [start[s], col[s]] only (attention_mode):
on a GPU through PyTorch's flash varlen kernel (each slot's span as cu_seqlens_k / seqused_k), the
decode forward compiled by torch.compile before its capture; elsewhere through the model's own sdpa
or eager attention with a 4D mask; no kernel of ours. Positions are passed per slot, so a row sees
exactly what `model.generate` shows it row by row: the same greedy tokens (fp32, CPU: tests show it).

Sampling draws each token with a Gumbel-max from a counter-based hash of (row seed, position, token
id) (mix64): a row's text depends on infer.seed and the row, never on its slot, its neighbours or the
replica count. temperature, top_k, top_p are applied as transformers' warpers do, in that order.

Models the engine does not take (see refusal) run on the batch engine (tasks/infer.py BatchRunner).
"""
from __future__ import annotations

import inspect
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from hpcgpu.runtime.watchdog import beat

log = logging.getLogger("hpcgpu")

WIDTH_BUCKET = 64  # cache columns rounded up to this: aligned rows for the attention kernels
PREFILL_TOKENS = 16384  # padded tokens of one prefill forward at most: bounds its activations
SYNC_STEPS = {"cuda": 8, "cpu": 1}  # decode steps per replay between two looks from the host
VIEWS = 8  # view widths captured at most
FLEX_BLOCK = 64  # flex_attention's block mask: columns a block (WIDTH_BUCKET: whole blocks)
REFILL_SHARE = 8  # prefill once 1/8 of the slots are free (or none is running): fewer, fuller prefills
INT64 = 1 << 64
try:  # decode needs no backward: skip the block mask's transposed (query-block) copy where torch can
    import inspect as _inspect
    from torch.nn.attention.flex_attention import BlockMask as _BlockMask

    FLEX_KW = ({"compute_q_blocks": False}
               if "compute_q_blocks" in _inspect.signature(_BlockMask.from_kv_blocks).parameters else {})
except ImportError:  # torch without flex_attention
    FLEX_KW = {}


# ---------------------------------------------------------------- which models

def view_widths(width: int) -> list[int]:
    """The view widths decode steps are captured at (VIEWS of them at most, multiples of
    WIDTH_BUCKET): rows taken longest first fill the slots with rows of like length, so most steps
    read far fewer columns than the longest row needs."""
    step = -(-width // (VIEWS * WIDTH_BUCKET)) * WIDTH_BUCKET
    return sorted({min(width, k * step) for k in range(1, VIEWS + 1)})


def cache_width(ids: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Columns of each slot: the longest prompt + max_new_tokens, rounded up to WIDTH_BUCKET."""
    need = max(len(s) for s in ids) + max_new_tokens
    return -(-need // WIDTH_BUCKET) * WIDTH_BUCKET


# ---------------------------------------------------------------- sampling

def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping products; logical shifts by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * (0xBF58476D1CE4E5B9 - INT64)
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * (0x94D049BB133111EB - INT64)
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def row_seed(seed: int, index: int) -> int:
    """The sampling seed of one input row: from (infer.seed, row index) only, as a signed int64."""
    value = int(mix64(torch.tensor([seed * 1_000_003 + index], dtype=torch.long))[0])
    return value


class Sampler:
    """The next token of every row: greedy, or a Gumbel-max draw keyed by (row seed, position)."""

    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0:
            return logits.argmax(dim=-1)
        x = logits.float() / self.temperature
        if self.top_k > 0:  # transformers' TopKLogitsWarper
            kth = torch.topk(x, min(self.top_k, x.shape[-1])).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:  # transformers' TopPLogitsWarper
            sorted_x, order = torch.sort(x, descending=False)
            remove = sorted_x.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p)
            remove[..., -1:] = False
            x = x.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        return (x + self.gumbel(seeds, positions, x.shape[-1])).argmax(dim=-1)

    @staticmethod
    def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
        base = mix64(seeds ^ (positions * (0x9E3779B97F4A7C15 - INT64)))
        key = mix64(base[:, None] + torch.arange(vocab, device=seeds.device)[None, :])
        u = (((key >> 40) & ((1 << 24) - 1)).float() + 0.5) * (1.0 / (1 << 24))
        return -torch.log(-torch.log(u))


# ---------------------------------------------------------------- the cache

def slot_cache(storage: list[tuple[torch.Tensor, torch.Tensor]], col: torch.Tensor, view: dict[str, int],
               flat: bool = False) -> Any:
    """transformers' Cache over our slot tensors, stored (slots, width, kv heads, head dim) so that a
    decode step's write of slot s at column col[s] is one index_copy_ of rows. The model sees the
    (slots, kv heads, view["width"], head dim) view it expects (the first columns only, where every
    running row fits: fewer bytes read a step), or with `flat` the (slots x width, kv heads, head dim)
    rows that decode_attention's varlen kernel reads slot by slot."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    n, width = storage[0][0].shape[:2]
    flat_rows = torch.arange(n, device=col.device) * width

    class SlotLayer(CacheLayerMixin):
        is_compileable = True
        is_sliding = False

        def __init__(self, k: torch.Tensor, v: torch.Tensor):
            super().__init__()
            self.flat_k, self.flat_v = k.view(n * width, *k.shape[2:]), v.view(n * width, *v.shape[2:])
            self.keys, self.values, self.is_initialized = k.transpose(1, 2), v.transpose(1, 2), True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            at = flat_rows + col
            self.flat_k.index_copy_(0, at, key_states[:, :, 0])
            self.flat_v.index_copy_(0, at, value_states[:, :, 0])
            if flat:
                return self.flat_k, self.flat_v
            w = view["width"]
            return self.keys[:, :, :w], self.values[:, :, :w]

        def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
            return view["width"], 0

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return 0  # positions come per slot, never from the cache

        def get_max_length(self) -> int:
            return width

        def get_max_cache_shape(self) -> int:
            return width

    return Cache(layers=[SlotLayer(k, v) for k, v in storage])


DECODE_ATTENTION = "hpcgpu_slots"
# the varlen kernel's per-step arguments, (cu_seqlens_q, cu_seqlens_k, seqused_k, width), set by the engine
# whose decode step runs (tensors in its graph's memory: a replay reads them where the capture left them)
VARLEN: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}


def decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """One query token a slot. Flat keys (slots x width rows, see slot_cache): PyTorch's flash-attention
    varlen kernel reads each slot's live columns [start, col] only (cu_seqlens_k at the slot's start,
    seqused_k its length), grouped-query heads included: a step costs the bytes of the rows in flight,
    not of the cache's width. Otherwise sdpa with the 4D mask, grouped-query attention without
    repeat_kv (a KV head's query heads are g query rows against its keys: one read, not a copy per
    query head). Anything else goes to transformers' own sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n, heads, q_len, dim = query.shape
    if type(attention_mask).__name__ == "BlockMask":
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling,
                             enable_gqa=heads != key.shape[1])
        return out.transpose(1, 2), None
    if key.dim() == 3:
        cu_q, cu_k, used, width = VARLEN["args"]
        out = torch.ops.aten._flash_attention_forward(
            query.transpose(1, 2).reshape(n, heads, dim), key, value, cu_q, cu_k, 1, width, 0.0, False, False,
            scale=scaling, seqused_k=used)[0]
        return out.reshape(n, 1, heads, dim), None
    kv_heads = key.shape[1]
    if q_len != 1 or heads % kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    grouped = query.reshape(n, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(n, 1, heads, dim), None


def attention_mode(model: Any, device: torch.device, settings: "EngineSettings") -> tuple[str, str | None]:
    """How decode steps attend, and why not the faster way: "flex" (flex_attention over each slot's live
    blocks, compiled), "varlen" (PyTorch's flash varlen kernel over each slot's live columns) or "sdpa"
    (a 4D mask over the narrowest view width the running rows fit)."""
    config = model.config
    dtype = next(model.parameters()).dtype
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else 0)
    asked = settings.attention
    if (getattr(config, "_attn_implementation", None) or "eager") != "sdpa":
        return "sdpa", f"attention {config._attn_implementation!r}"
    if asked == "sdpa":
        return "sdpa", "asked"
    if asked == "flex":  # measured 2.2x slower than varlen at 512 slots on an H200: only when asked
        if dim >= 16 and dim & (dim - 1) == 0:
            return "flex", None
        return "sdpa", f"head dim {dim} (flex_attention takes powers of 2 from 16)"
    if device.type != "cuda":
        return "sdpa", "not on a GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return "sdpa", f"{str(dtype).replace('torch.', '')} weights (the varlen kernel takes fp16 and bf16)"
    if not dim or dim % 8 or dim > 256:
        return "sdpa", f"head dim {dim}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "sdpa", "a GPU older than sm80"
    if "seqused_k" not in str(torch.ops.aten._flash_attention_forward.default._schema):
        return "sdpa", f"torch {torch.__version__} has no seqused_k"
    return "varlen", None


def register_decode_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)


def dynamic_cache(config: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers < 4.56
        return DynamicCache()


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


# ---------------------------------------------------------------- the engine

@dataclass
class Done:
    """A finished row: its completion up to its end (an EOS not included) and why it ended."""

    index: int
    tokens: list[int]
    reason: str  # "stop": an EOS or a stop string; "length": max_new_tokens


@dataclass
class EngineSettings:
    slots: int
    width: int
    max_new_tokens: int
    eos: Sequence[int]
    pad: int
    sampler: Sampler
    seed: int
    stop_at: Callable[[list[int], int], int | None] | None  # (tokens, checked before) -> count at a stop string
    refill: bool = True
    compile: bool = False  # the decode forward through torch.compile (inductor) before its capture
    attention: str = "auto"  # flex, varlen, sdpa or auto (attention_mode)


class SlotEngine:
    """Runs rows through N slots of one model copy; see the module docstring."""

    def __init__(self, model: Any, device: torch.device, ids: Sequence[list[int]], settings: EngineSettings):
        self.model, self.device, self.ids, self.s = model, device, ids, settings
        n = settings.slots
        self.steps = SYNC_STEPS.get(device.type, 1)
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep = ({"logits_to_keep": 1} if "logits_to_keep" in params else
                     {"num_logits_to_keep": 1} if "num_logits_to_keep" in params else {})
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        self.pos_cap = int(limit) - 1 if isinstance(limit, int) and limit > 0 else (1 << 62)
        dtype = next(model.parameters()).dtype
        long = dict(dtype=torch.long, device=device)
        self.tokens, self.pos = torch.zeros(n, **long), torch.zeros(n, **long)
        self.col = torch.zeros(n, **long)
        self.start = torch.zeros(n, **long)
        self.seeds = torch.zeros(n, **long)
        self.cols = torch.arange(settings.width, device=device)[None, :]
        self.hist = torch.zeros((n, self.steps), **long)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.neg = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
        self.cache: Any = None
        self.view = {"width": settings.width}
        # how a decode step attends (attention_mode): flex and varlen read each slot's live blocks or columns
        # whatever the width: one width, one graph, one compile
        self.mode, self.mode_why = attention_mode(model, device, settings)
        self.widths = [settings.width] if self.mode != "sdpa" else view_widths(settings.width)
        int32 = dict(dtype=torch.int32, device=device)
        self.cu_q = torch.arange(n + 1, **int32)
        self.base = torch.arange(n, **long) * settings.width
        self.total = torch.full((1,), n * settings.width, **int32)
        self.no_mask = torch.zeros((n, 1, 1, 1), dtype=dtype, device=device)  # a 4D mask transformers passes on
        self.blocks = torch.arange(-(-settings.width // FLEX_BLOCK), **long)
        start, col = self.start, self.col
        self.live = lambda b, h, q, kv: (kv >= start[b]) & (kv <= col[b])  # flex's mask_mod: a slot's span
        self.col_host = [0] * n  # col, as the host knows it for the running rows
        self.graphs: dict[int, Any] = {}  # view width -> its captured steps
        self.replays = 0  # decode calls: SYNC_STEPS steps each
        self.pool: Any = None
        self.capture_s = 0.0
        self.graphs_off_why: str | None = None if device.type == "cuda" else "not on a GPU"
        # inductor fuses a layer's ~40 small kernels (norms, rotary, residuals) into a few: at 64 slots a
        # captured step was ~4 ms of launches against ~0.3 ms of bytes. One width only: a compile a width
        self.compile_off_why = (None if settings.compile and self.mode != "sdpa" else
                                "not asked" if not settings.compile else "more than one view width")
        self.forward: Callable[..., torch.Tensor] = (torch.compile(self._logits, dynamic=False)
                                                     if self.compile_off_why is None else self._logits)
        register_decode_attention()
        self.row: list[int] = [-1] * n  # the input row each slot runs, -1: free
        self.gen: list[list[int]] = [[] for _ in range(n)]

    # ------------------------------------------------ the loop

    def run(self, take: Callable[[], list[int] | None], emit: Callable[[list[Done]], None],
            stop: Callable[[], bool]) -> int:
        """Runs the rows `take` hands out (None: no more) until all are done (0) or `stop` says so: the
        rows taken and not finished then (dropped: the caller redoes them on resume)."""
        pending: deque[int] = deque()
        more = True
        while True:
            if stop():
                return sum(r >= 0 for r in self.row) + len(pending)
            free = [s for s, r in enumerate(self.row) if r < 0]
            live = len(self.row) - len(free)
            if free and (live == 0 or (self.s.refill and len(free) >= max(1, len(self.row) // REFILL_SHARE))):
                while more and len(pending) < len(free):
                    rows = take()
                    more = rows is not None
                    pending.extend(rows or [])
                pairs = [(s, pending.popleft()) for s in free[:len(pending)]]
                if pairs:
                    emit(self.prefill(pairs))
                    live = sum(r >= 0 for r in self.row)
            if live == 0:
                if not more and not pending:
                    return 0
                continue
            emit(self.advance(self.decode()))
            beat()

    def prefill(self, pairs: list[tuple[int, int]]) -> list[Done]:
        """Prompts into their slots, in forwards of PREFILL_TOKENS padded tokens at most; each row's
        first token comes from its prefill."""
        pairs = sorted(pairs, key=lambda p: len(self.ids[p[1]]))
        done: list[Done] = []
        k = 0
        while k < len(pairs):
            g = k + 1
            while g < len(pairs) and (g - k + 1) * len(self.ids[pairs[g][1]]) <= PREFILL_TOKENS:
                g += 1
            done += self._prefill_group(pairs[k:g])
            k = g
        return done

    def _prefill_group(self, pairs: list[tuple[int, int]]) -> list[Done]:
        seqs = [self.ids[i] for _, i in pairs]
        width = max(len(x) for x in seqs)
        input_ids = torch.full((len(seqs), width), self.s.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, x in enumerate(seqs):  # left padding: every row's last prompt token in the last column
            input_ids[r, width - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[r, width - len(x):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, mask, positions = input_ids.to(self.device), mask.to(self.device), positions.to(self.device)
        dyn = dynamic_cache(self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            **{self.cache_kw: dyn}, **self.keep).logits[:, -1]
        kv = cache_tensors(dyn)
        if self.cache is None:
            self._allocate(kv)
        slots = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        for (keys, values), (k, v) in zip(self.cache_kv, kv):
            keys[slots, :width] = k.transpose(1, 2)
            values[slots, :width] = v.transpose(1, 2)
        lengths = torch.tensor([len(x) for x in seqs], dtype=torch.long, device=self.device)
        seeds = torch.tensor([row_seed(self.s.seed, i) for _, i in pairs], dtype=torch.long, device=self.device)
        first = self.s.sampler(logits, seeds, lengths)
        self.tokens[slots], self.pos[slots], self.seeds[slots] = first, lengths, seeds
        self.col[slots] = width
        self.start[slots] = width - lengths
        for s, i in pairs:
            self.row[s], self.gen[s], self.col_host[s] = i, [], width
        return self.advance_slots([s for s, _ in pairs], [[t] for t in first.tolist()])

    def prepare(self) -> None:
        """Before the loop: the cache allocated (its shapes from a one-token forward) and, on a GPU,
        every view width's decode steps captured, so that the start pays the capture once and the
        loop's time is decoding alone."""
        with torch.inference_mode():
            dyn = dynamic_cache(self.model.config)
            one = torch.full((1, 1), self.s.pad, dtype=torch.long, device=self.device)
            # without a mask, a pad token as input makes transformers warn that the row may be padded
            self.model(input_ids=one, attention_mask=torch.ones_like(one), use_cache=True,
                       **{self.cache_kw: dyn}, **self.keep)
            self._allocate(cache_tensors(dyn))
            for width in self.widths:
                if self.graphs_off_why is None:
                    self._capture(width)

    def _allocate(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n, w = self.s.slots, self.s.width
        self.cache_kv = [(torch.zeros((n, w, k.shape[1], k.shape[3]), dtype=k.dtype, device=self.device),
                          torch.zeros((n, w, v.shape[1], v.shape[3]), dtype=v.dtype, device=self.device))
                         for k, v in kv]
        self.cache = slot_cache(self.cache_kv, self.col, self.view, flat=self.mode == "varlen")

    # ------------------------------------------------ decode

    def _steps(self, width: int) -> None:
        """SYNC_STEPS decode steps of every slot over the first `width` columns, each token also into
        hist (no host sync)."""
        self.view["width"] = width
        config = self.model.config
        plain = config._attn_implementation
        if plain == "sdpa":
            config._attn_implementation = DECODE_ATTENTION
        try:
            self._decode_steps(width)
        finally:
            config._attn_implementation = plain

    def _decode_steps(self, width: int) -> None:
        cols = self.cols[:, :width]
        for i in range(self.steps):
            logits = self.forward(self.tokens, self.pos, self.step_mask(cols))
            nxt = self.s.sampler(logits, self.seeds, self.pos + 1)
            self.hist[:, i] = nxt
            self.tokens.copy_(nxt)
            self.pos.add_(1).clamp_(max=self.pos_cap)
            self.col.add_(1).clamp_(max=self.s.width - 1)  # not the view's: the next step may take a wider one

    def _logits(self, tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens[:, None], position_ids=pos[:, None], attention_mask=mask, use_cache=True,
                          **{self.cache_kw: self.cache}).logits[:, -1]

    def step_mask(self, cols: torch.Tensor) -> Any:
        """The attention mask of one decode step: flex's BlockMask of each slot's live blocks, for the
        varlen kernel its per-slot spans (VARLEN) and a placeholder mask, or a 4D additive mask over the
        view's columns."""
        if self.mode == "flex":
            from torch.nn.attention.flex_attention import BlockMask

            first, last = self.start // FLEX_BLOCK, self.col // FLEX_BLOCK
            count = (last - first + 1).to(torch.int32)[:, None, None]
            index = (first[:, None] + self.blocks[None, :]).clamp(max=len(self.blocks) - 1).to(torch.int32)
            return BlockMask.from_kv_blocks(count, index[:, None, None, :], BLOCK_SIZE=FLEX_BLOCK, mask_mod=self.live,
                                            seq_lengths=(1, self.s.width), **FLEX_KW)
        if self.mode == "varlen":
            cu_k = torch.cat([(self.base + self.start).to(torch.int32), self.total])
            used = (self.col - self.start + 1).to(torch.int32)
            VARLEN["args"] = (self.cu_q, cu_k, used, self.s.width)
            return self.no_mask
        valid = (cols >= self.start[:, None]) & (cols <= self.col[:, None])
        return torch.where(valid, self.zero, self.neg)[:, None, None, :]

    @property
    def attention(self) -> str:
        """How decode steps attend, for the start-up line."""
        how = "compiled" if self.compile_off_why is None else "uncompiled"
        if self.mode == "flex":
            return f"flex_attention over each slot's live blocks, {how}"
        if self.mode == "varlen":
            return f"flash varlen over each slot's live columns, {how}"
        return f"sdpa over {len(self.widths)} view width(s) ({self.mode_why})"

    def decode(self) -> list[list[int]]:
        """SYNC_STEPS decode steps over the narrowest view every running row fits for them."""
        live = [self.col_host[s] for s, r in enumerate(self.row) if r >= 0]
        need = max(live, default=0) + self.steps
        width = next((w for w in self.widths if w >= need), self.s.width)
        for s, r in enumerate(self.row):
            if r >= 0:
                self.col_host[s] += self.steps
        self.replays += 1
        if width not in self.graphs and self.graphs_off_why is None:
            self._capture(width)
        graph = self.graphs.get(width)
        if graph is not None:
            graph.replay()
        else:
            self._steps(width)
        return self.hist.tolist()

    def _capture(self, width: int) -> None:
        """The CUDA graph of SYNC_STEPS decode steps at this view width, after a warm-up on a side
        stream (the torch.cuda.graphs recipe), in one memory pool shared by the widths' graphs; the
        slots' state is put back after the warm-up. On failure: uncaptured steps, one line."""
        t0 = time.perf_counter()
        state = [t.clone() for t in (self.tokens, self.pos, self.col)]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._steps(width)
            torch.cuda.current_stream().wait_stream(side)
            for t, saved in zip((self.tokens, self.pos, self.col), state):
                t.copy_(saved)
            graph = torch.cuda.CUDAGraph()
            self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                self._steps(width)
            self.graphs[width] = graph
        except Exception as exc:  # a model whose forward syncs or allocates outside the graph's pool
            first = next((x for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
            if self.compile_off_why is None:  # torch.compile's failure: the same steps uncompiled
                self.compile_off_why = f"torch.compile failed ({first[:200]})"
                log.warning(f"{self.compile_off_why}: decode steps run uncompiled")
                self.forward = self._logits
                if self.mode == "flex":  # flex_attention uncompiled is a reference, not a kernel: masks
                    self.mode, self.mode_why = "sdpa", self.compile_off_why
                    self.widths = view_widths(self.s.width)
                    self.cache = slot_cache(self.cache_kv, self.col, self.view)
                    width = self.widths[-1]
                for t, saved in zip((self.tokens, self.pos, self.col), state):
                    t.copy_(saved)
                self.capture_s += time.perf_counter() - t0  # the failed compile is start-up time too
                return self._capture(width)
            self.graphs_off_why = f"CUDA graph capture failed ({first[:200]})"
            log.warning(f"{self.graphs_off_why}: decode steps run uncaptured")
        for t, saved in zip((self.tokens, self.pos, self.col), state):
            t.copy_(saved)
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        self.capture_s += took
        if width in self.graphs:
            log.debug(f"decode steps captured: a CUDA graph of {self.steps} steps of {self.s.slots} slots over "
                      f"{width} of {self.s.width} columns in {took:.1f}s")

    # ------------------------------------------------ ends of rows

    def advance(self, hist: list[list[int]]) -> list[Done]:
        live = [s for s, r in enumerate(self.row) if r >= 0]
        return self.advance_slots(live, [hist[s] for s in live])

    def advance_slots(self, slots: list[int], new: list[list[int]]) -> list[Done]:
        """Appends each slot's new tokens; a row that reached its end is done and frees its slot."""
        done = []
        eos, limit = set(self.s.eos), self.s.max_new_tokens
        for s, tokens in zip(slots, new):
            gen = self.gen[s]
            before = len(gen)
            end = None
            for t in tokens:
                if t in eos:
                    end = (len(gen), "stop")
                    break
                gen.append(t)
                if len(gen) >= limit:
                    end = (len(gen), "length")
                    break
            if self.s.stop_at is not None:
                hit = self.s.stop_at(gen, before)
                if hit is not None and (end is None or hit <= end[0]):
                    end = (hit, "stop")
            if end is not None:
                done.append(Done(self.row[s], gen[:end[0]], end[1]))
                self.free(s)
        return done

    def free(self, s: int) -> None:
        self.row[s], self.gen[s] = -1, []
        # a free slot attends to its first column only: no empty softmax, no position past the model's
        self.start[s] = 0
        self.col[s] = 0
        self.pos[s] = 0
        self.col_host[s] = 0


def devices_of(model: Any) -> int:
    """The devices a loaded copy's weights are on (accelerate's device map: GPUs, cpu for offloaded)."""
    return max(1, len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}))
