"""`task: infer`: batch generation or scoring over an input file, data-parallel, preemptible.

One rank is one replica: a whole copy of the model on its GPU (or a CPU rank). Every replica reads the
whole input, tokenizes it, sorts the rows by (token length, input position) and cuts them into the same
chunks: a batch of the run plan's batch size (engine batches) or a quarter of its slots (engine slots,
runtime/slots.py). The chunks, longest first, are a queue that the replicas take from one at a time
(WorkQueue: an atomic counter in the process group's store), so a replica that runs faster takes more
of them and all end close together. No output depends on the replica count or on which replica runs
which row (sampling is seeded per batch on the batch engine, per row on the slot engine): 1 and 2
replicas give the same outputs.jsonl, bit for bit on CPU.

Each replica appends its finished rows to outputs/replica-N.jsonl (hpcgpu/infer_outputs.py; the slot
engine every STORE_EVERY_S, the batch engine a batch at a time) and adds its rows and tokens to counters
in the same store; rank 0's progress line reads them. A replica that gets the stop signal posts it
in the same store (the replicas' side of the one stop agreement, runtime/agree.py) and takes no further
chunk; the others see it and stop too: the batch engine after its current batch, the slot engine after
its current decode call, dropping the rows still in its slots. On a stop (the preemption signal,
SIGTERM, Ctrl-C) the run's one stop follows (runtime/run.py): rank 0 requeues and every rank exits 75,
as train does after its checkpoint; the rows written are the checkpoint. A run where every row was written is
finished, a signal during the last rows or not. A resumed job skips every row some replica wrote (any
replica count: all the replica files are read) and runs the rest, a chunk only partly written (a kill
-9) included: never a duplicate, never a dropped row. At the end rank 0 merges the replica files into
outputs.jsonl, in input order, and marks the run FINISHED.

Records (one JSON object a line):
    generate  {"id", "index", "text", "prompt_tokens", "completion_tokens", "finish_reason"}
              finish_reason: "stop" (an end-of-sequence token or a stop string; neither is in the
              text), "length" (max_new_tokens reached); completion_tokens: what the model generated
              for the row, up to its end (the end-of-sequence token not counted)
    score     {"id", "index", "log_likelihood", "tokens", "perplexity"}: the sum of log p(t_i | t_<i)
              over the text's tokens after the first (as the tokenizer encodes the text, special
              tokens included: a BOS makes every text token scored), their number, exp(-ll / tokens)
              (null for a text of fewer than 2 tokens)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from hpcgpu.contract import ENV_GPU_MEMORY, RunPaths, compile_cache, is_finished
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.estimate import (MaxMemory, compute_bytes, config_weight_bytes, fewest_gpus_per_replica, fmt_bytes,
                                 infer_dims, parse_max_memory, row_bytes_per_gpu, rows_room, why_batches)
from hpcgpu.infer_inputs import Row, read_rows, rows_fit_problem
from hpcgpu import infer_outputs as outputs
from hpcgpu.runtime import slots as slot_engine
from hpcgpu.runtime.context import Context, init
from hpcgpu.runtime.data import ByteTokenizer
from hpcgpu.runtime.dist import agreed_min, coordination_barrier, coordination_group
from hpcgpu.runtime.metrics import MetricsWriter
from hpcgpu.runtime.requeue import mark_finished
from hpcgpu.runtime.stop import StopNote, inject_signal
from hpcgpu.runtime.track import open_tracking
from hpcgpu.runtime.watchdog import beat
from hpcgpu.runtime.model import load_for_inference, model_config, not_in_cache, placement
from hpcgpu.runtime.plan import (DTYPE_OF_PRECISION, RunPlan, check_recorded, chunk_rows, gpu_memory_reading,
                                 infer_precision, plan_infer, recorded_plan, with_replicas)
from hpcgpu.runtime.tasks.train import quiet_libraries, record_plan
from hpcgpu.spec import Spec

log = logging.getLogger("hpcgpu")

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOG_EVERY_S = 10.0  # rank 0's progress line and metrics record, at most this often (and the first and last)
STORE_EVERY_S = 0.25  # the slot engine: the shared counters and the stop agreement, read and written this often


# ---------------------------------------------------------------- tokenizer and rows

def load_infer_tokenizer(spec: Spec) -> Any:
    """The byte tokenizer for model.config (and a model dir saved with it); else the model dir's own
    tokenizer, or one clear error: inference without its tokenizer would be noise."""
    path = spec.model.name_or_path
    if not path or Path(path, "hpcgpu_tokenizer.json").exists():
        return ByteTokenizer()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        first = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
        raise HpcgpuError(not_in_cache(path) or f"model.name_or_path: no usable tokenizer in {path!r} ({first}); "
                          "save the model's tokenizer there (tokenizer.save_pretrained)") from None
    if not getattr(tokenizer, "vocab_size", 0):
        # transformers 5 builds an empty tokenizer of the model's class where a folder has no tokenizer files
        raise HpcgpuError(f"model.name_or_path: no usable tokenizer in {path!r} (it has no vocabulary); save "
                          "the model's tokenizer there (tokenizer.save_pretrained)")
    return tokenizer


class Codec:
    """Text <-> token ids for the byte tokenizer and Hugging Face tokenizers alike."""

    def __init__(self, tokenizer: Any, model_ref: str):
        self.tok = tokenizer
        self.bytes = isinstance(tokenizer, ByteTokenizer)
        self.model_ref = model_ref

    def encode_many(self, texts: list[str], special: bool = True) -> list[list[int]]:
        if not texts:
            return []
        if self.bytes:
            return [self.tok.encode(t) for t in texts]
        return [list(ids) for ids in self.tok(texts, add_special_tokens=special)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        if self.bytes:
            return self.tok.decode(list(ids))
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, row: Row, source: str) -> str:
        if self.bytes or not getattr(self.tok, "chat_template", None):
            raise HpcgpuError(f"{source}:{row.line}: \"messages\" need the tokenizer's chat template, and the "
                              f"tokenizer of {self.model_ref} has none; give a \"prompt\" instead")
        try:
            return self.tok.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja's own errors (a template that wants other roles, ...)
            first = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
            raise HpcgpuError(f"{source}:{row.line}: the chat template of {self.model_ref} refused the "
                              f"messages: {first}") from None

    def special_id(self, name: str) -> int | None:
        value = getattr(self.tok, name, None)
        return int(value) if isinstance(value, int) else None


def encode_rows(rows: Sequence[Row], codec: Codec, mode: str, source: str) -> list[list[int]]:
    """Each row's token ids: score, the text; generate, the prompt (or the messages through the chat
    template, whose text carries its own special tokens). An empty prompt starts from BOS (else EOS)."""
    ids: list[list[int]] = [[] for _ in rows]
    plain = [i for i, r in enumerate(rows) if r.messages is None]
    texts = [(rows[i].text if mode == "score" else rows[i].prompt) or "" for i in plain]
    for i, row_ids in zip(plain, codec.encode_many(texts, special=True)):
        ids[i] = row_ids
    chats = [i for i, r in enumerate(rows) if r.messages is not None]
    for i, row_ids in zip(chats, codec.encode_many([codec.chat(rows[i], source) for i in chats], special=False)):
        ids[i] = row_ids
    if mode == "generate":
        start = codec.special_id("bos_token_id")
        start = start if start is not None else codec.special_id("eos_token_id")
        for i, row_ids in enumerate(ids):
            if not row_ids:
                if start is None:
                    raise HpcgpuError(f"{source}:{rows[i].line}: the prompt is empty and the tokenizer has no "
                                      "BOS or EOS token to start from; give a prompt")
                ids[i] = [start]
    return ids


def check_rows_fit(rows: Sequence[Row], ids: Sequence[list[int]], config: Any, mode: str, max_new_tokens: int,
                   source: str, model_ref: str) -> None:
    """Every token id inside the model's vocabulary, every row inside its positions: one clear error
    naming the row, before the weights load."""
    vocab = getattr(config, "vocab_size", None)
    top = max((max(r) for r in ids if r), default=-1)
    if vocab is not None and top >= vocab:
        raise HpcgpuError(f"model vocab_size {vocab} is too small for the tokenizer (token id {top}) of "
                          f"{model_ref}; use vocab_size >= 256 for the byte-level tokenizer")
    problem = rows_fit_problem(list(rows), [len(r) for r in ids], getattr(config, "max_position_embeddings", None),
                               mode, max_new_tokens, source)
    if problem:
        raise HpcgpuError(problem)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Row indices sorted by (token length, input position), cut into batches: the same batches for
    any replica count (the replicas take them from a WorkQueue)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def batch_seed(seed: int, batch: int) -> int:
    """The torch seed of one batch's sampling: from (infer.seed, batch number) only."""
    return (seed * 1_000_003 + batch) % (2 ** 63 - 1)


# ---------------------------------------------------------------- the model

def row_bytes(config: Any, mode: str, max_tokens: int, precision: str, gpus: int | None = None) -> int | None:
    """GPU memory one row of `max_tokens` tokens needs on one GPU of this replica (of `gpus`, default
    the GPUs this process sees: the replica's group), by gpu/estimate.py's model, the one `hpcgpu
    estimate` shows; None for a config it cannot read (the batch is then the CPU one)."""
    try:
        d = infer_dims(config)
    except (HpcgpuError, TypeError, ValueError):
        return None
    gpus = gpus or torch.cuda.device_count() or 1
    return row_bytes_per_gpu(d, mode, max_tokens, compute_bytes(DTYPE_OF_PRECISION[precision]), gpus)


def memory_budget(model: torch.nn.Module, device: torch.device, cap: int | None) -> int | None:
    """GPU memory the rows of a batch may use on one GPU of this replica: the least over its GPUs of
    what each has free beside its weights less headroom, within infer.max_memory's cap per GPU
    (gpu/estimate.py rows_room; every GPU of a split holds the whole batch's activations); None on
    CPU ranks. HPCGPU_GPU_MEMORY stands for each card's memory (as for train), on CPU ranks too."""
    if os.environ.get(ENV_GPU_MEMORY):
        gpus = torch.cuda.device_count() if device.type == "cuda" else 1
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        held = [-(-weights // max(1, gpus))] * max(1, gpus)
        free = [(gpu_memory_reading(device) or 0) - h for h in held]
    elif device.type == "cuda":
        gpus = range(torch.cuda.device_count())  # the replica's group only (bound before CUDA started)
        free = [int(torch.cuda.mem_get_info(i)[0]) for i in gpus]
        held = [int(torch.cuda.memory_allocated(i)) for i in gpus]
    else:
        return None
    return min(rows_room(f, None if cap is None else cap - h) for f, h in zip(free, held))


def check_replica_fits(spec: Spec, config: Any, precision: str, device: torch.device, cap: MaxMemory) -> None:
    """Weights that cannot fit this replica's GPUs (and CPU offload) at all: one line naming the
    setting that would, before anything loads (instead of an out-of-memory error minutes later)."""
    if device.type != "cuda":
        return
    fmt = spec.model.quantization if spec.model.quantization != "none" else DTYPE_OF_PRECISION[precision]
    try:
        weights = config_weight_bytes(config, fmt)
    except (HpcgpuError, TypeError, ValueError):
        return  # a config the analytic count does not know
    g = torch.cuda.device_count()
    each = min(int(torch.cuda.mem_get_info(i)[0]) for i in range(g))
    if cap.gpu is not None:
        each = min(each, cap.gpu)
    if weights <= g * each + cap.cpu:
        return
    # by what the GPUs have free now, not their size: another process may hold part of them
    need = fewest_gpus_per_replica(weights, each, spec.resources.gpus, cap.cpu)
    fix = (f"set infer.gpus_per_replica: {need}" if need else
           "use model.quantization int8 or int4, or offload to CPU (infer.max_memory: 'auto,cpu=SIZE')")
    raise HpcgpuError(f"infer.gpus_per_replica: {fmt_bytes(weights)} of {fmt} weights do not fit on this model "
                      f"copy's {g} GPU(s) ({fmt_bytes(each)} free each); {fix} (hpcgpu estimate shows the options)")


# ---------------------------------------------------------------- generation and scoring

def stop_window(stops: Sequence[str]) -> int:
    """Tokens at the end of a completion that hold any stop string whole."""
    return 4 * max(len(s) for s in stops) + 4


def stop_finder(stops: Sequence[str], codec: Codec) -> Callable[[list[int], int], int | None]:
    """For the slot engine: the first count of tokens (after `before`) whose last stop_window tokens
    hold a stop string, as _stop_criteria would have stopped generate there; None if none does."""
    window = stop_window(stops)

    def first_stop(tokens: list[int], before: int) -> int | None:
        if not any(s in codec.decode(tokens[max(0, before + 1 - window):]) for s in stops):
            return None
        return next((m for m in range(before + 1, len(tokens) + 1)
                     if any(s in codec.decode(tokens[max(0, m - window):m]) for s in stops)), None)

    return first_stop


def _stop_criteria(stops: Sequence[str], codec: Codec, prompt_len: int) -> Any:
    from transformers import StoppingCriteria

    window = stop_window(stops)

    class StopStrings(StoppingCriteria):
        """A row is done once its completion holds a stop string (the rest of the batch goes on)."""

        def __init__(self) -> None:
            self.done_at: dict[int, int] = {}  # row -> tokens generated when a stop string appeared

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            gen = input_ids[:, prompt_len:]
            n = gen.shape[1]
            done = torch.zeros(gen.shape[0], dtype=torch.bool, device=input_ids.device)
            for r, tail in enumerate(gen[:, max(0, n - window):].tolist()):
                if r not in self.done_at and any(s in codec.decode(tail) for s in stops):
                    self.done_at[r] = n
                if r in self.done_at:
                    done[r] = True
            return done

    return StopStrings()


@dataclass
class BatchResult:
    records: list[dict[str, Any]]
    prompt_tokens: int
    completion_tokens: int


def end_tokens(model: Any, codec: Codec) -> tuple[list[int], int]:
    """(the ids that end a completion, the padding id): the tokenizer's and the model's EOS inside the
    vocabulary (GPT-2's default 50256 in a byte-level model is no end of anything), pad or else EOS."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = getattr(config, "vocab_size", None) or 1 << 62
    eos = [codec.special_id("eos_token_id")]
    model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos += model_eos if isinstance(model_eos, list) else [model_eos]
    ends = sorted({int(e) for e in eos if isinstance(e, int) and 0 <= e < vocab})
    pad = codec.special_id("pad_token_id")
    return ends, pad if pad is not None and 0 <= pad < vocab else (ends[0] if ends else 0)


def completion_record(row: Row, index: int, prompt_tokens: int, tokens: Sequence[int], reason: str,
                      stops: Sequence[str], codec: Codec) -> dict[str, Any]:
    """A generate record from a row's completion cut at its end: the text cut before a stop string."""
    text = codec.decode(tokens)
    cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
    if cut >= 0:
        text, reason = text[:cut], "stop"
    return {"id": row.id, "index": index, "text": text, "prompt_tokens": prompt_tokens,
            "completion_tokens": len(tokens), "finish_reason": reason}


@dataclass
class Chunk:
    """Rows the queue hands a replica: their batch number, all its rows, those not written yet."""

    number: int
    rows: list[int]
    missing: list[int]


class BatchRunner:
    """The batch engine: one batch of rows at a time through model.generate (or one forward: score),
    for what the slot engine does not take (runtime/slots.py refusal) and for score mode."""

    def __init__(self, spec: Spec, model: Any, codec: Codec, ids: list[list[int]], rows: Sequence[Row],
                 device: torch.device, why: str | None = None):
        self.spec, self.model, self.codec, self.ids, self.rows, self.device = spec, model, codec, ids, rows, device
        self.why = why
        self.store_every_s = 0.0  # a stop raised by another replica is seen before the next batch
        if device.type == "cuda":
            # SDPA's cuDNN backend builds an execution plan for every new sequence length (tens of ms
            # each): batches sorted by length meet hundreds of them, the padded batches of an unsorted
            # loop few (benchmarks/infer_throughput.py measures both)
            torch.backends.cuda.enable_cudnn_sdp(False)
        inf = spec.infer
        self.eos, self.pad = end_tokens(model, codec)
        if inf.mode == "generate":
            from transformers import GenerationConfig

            # every setting explicit: what the model's own generation_config says (a temperature, a
            # repetition penalty) would otherwise fill in the ones left unset
            # (min_p, typical_p, epsilon/eta cutoffs off: the spec's temperature, top_p and top_k alone)
            sampling = dict(do_sample=True, temperature=inf.temperature, top_p=inf.top_p, top_k=inf.top_k,
                            min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0) \
                if inf.temperature > 0 else dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)
            # kv_cache static: transformers preallocates the cache (and may compile its decode step)
            cache = dict(cache_implementation="static") if inf.kv_cache == "static" else {}
            self.gen_config = GenerationConfig(
                **cache, max_new_tokens=inf.max_new_tokens, min_new_tokens=0, num_beams=1, num_return_sequences=1,
                repetition_penalty=1.0, no_repeat_ngram_size=0, pad_token_id=self.pad,
                eos_token_id=self.eos or None, **sampling)

    def describe(self) -> dict[str, Any]:
        return {"engine": "batches", "why": self.why}

    def loop(self, take: Callable[[], Chunk | None], emit: Callable[[BatchResult], None],
             stop: Callable[[], bool]) -> int:
        """Runs the batches `take` hands out until there are none or `stop` says so; 0 rows held at the end."""
        while not stop():
            chunk = take()
            if chunk is None:
                break
            emit(self.run(chunk.number, chunk.rows))
        return 0

    def run(self, number: int, batch: list[int]) -> BatchResult:
        with torch.inference_mode():
            if self.spec.infer.mode == "score":
                return self.score(batch)
            return self.generate(number, batch)

    def generate(self, number: int, batch: list[int]) -> BatchResult:
        inf = self.spec.infer
        seqs = [self.ids[i] for i in batch]
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):  # left padding: every row's next token is in the last column
            input_ids[r, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[r, width - len(s):] = 1
        stop = _stop_criteria(inf.stop, self.codec, width) if inf.stop else None
        if inf.temperature > 0:
            torch.manual_seed(batch_seed(inf.seed, number))  # the same draws whichever replica runs it
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=self.gen_config,
                                  stopping_criteria=[stop] if stop is not None else None)
        generated = out[:, width:].tolist()
        records, completion = [], 0
        for r, (i, tokens) in enumerate(zip(batch, generated)):
            end = next((k for k, t in enumerate(tokens) if t in self.eos), None)
            reason = "stop" if end is not None else "length"
            n = len(tokens) if end is None else end
            if stop is not None and r in stop.done_at and stop.done_at[r] <= n:
                n, reason = stop.done_at[r], "stop"
            completion += n
            records.append(completion_record(self.rows[i], i, len(seqs[r]), tokens[:n], reason, inf.stop, self.codec))
        return BatchResult(records, sum(len(s) for s in seqs), completion)

    def score(self, batch: list[int]) -> BatchResult:
        seqs = [self.ids[i] for i in batch]
        scored = [r for r, s in enumerate(seqs) if len(s) >= 2]
        ll = [0.0] * len(seqs)
        if scored:
            width = max(len(seqs[r]) for r in scored)
            input_ids = torch.full((len(scored), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(scored), width), dtype=torch.long)
            for k, r in enumerate(scored):  # right padding: positions count from each row's first token
                input_ids[k, :len(seqs[r])] = torch.tensor(seqs[r], dtype=torch.long)
                mask[k, :len(seqs[r])] = 1
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            sums = (logp.double() * mask[:, 1:]).sum(dim=1).tolist()
            for k, r in enumerate(scored):
                ll[r] = sums[k]
        records = []
        for r, i in enumerate(batch):
            n = max(0, len(seqs[r]) - 1)
            records.append({"id": self.rows[i].id, "index": i, "log_likelihood": ll[r], "tokens": n,
                            "perplexity": math.exp(-ll[r] / n) if n else None})
        return BatchResult(records, sum(len(s) for s in seqs), 0)


class SlotRunner:
    """The slot engine (runtime/slots.py) behind the replica loop's interface: rows from the queue's
    chunks into free slots, a record for each row as it ends."""

    def __init__(self, spec: Spec, model: Any, codec: Codec, ids: list[list[int]], rows: Sequence[Row],
                 device: torch.device, slots: int):
        inf = spec.infer
        self.codec, self.ids, self.rows, self.stops = codec, ids, rows, list(inf.stop)
        self.store_every_s = STORE_EVERY_S
        eos, pad = end_tokens(model, codec)
        settings = slot_engine.EngineSettings(
            slots=slots, width=slot_engine.cache_width(ids, inf.max_new_tokens), max_new_tokens=inf.max_new_tokens,
            eos=eos, pad=pad, sampler=slot_engine.Sampler(inf.temperature, inf.top_k, inf.top_p), seed=inf.seed,
            stop_at=stop_finder(inf.stop, codec) if inf.stop else None, refill=inf.refill,
            compile=device.type == "cuda", attention=inf.attention)
        self.engine = slot_engine.SlotEngine(model, device, ids, settings)

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {"engine": "slots", "slots": e.s.slots, "width": e.s.width, "graphs": bool(e.graphs),
                "views": sorted(e.graphs), "capture_s": round(e.capture_s, 3), "why": e.graphs_off_why,
                "attention": e.attention}

    def loop(self, take: Callable[[], Chunk | None], emit: Callable[[BatchResult], None],
             stop: Callable[[], bool]) -> int:
        def take_rows() -> list[int] | None:
            chunk = take()
            return None if chunk is None else chunk.missing

        def emit_done(done: list[slot_engine.Done]) -> None:
            if done:
                emit(BatchResult([completion_record(self.rows[d.index], d.index, len(self.ids[d.index]), d.tokens,
                                                    d.reason, self.stops, self.codec) for d in done],
                                 sum(len(self.ids[d.index]) for d in done), sum(len(d.tokens) for d in done)))

        with torch.inference_mode():
            return self.engine.run(take_rows, emit_done, stop)


def settle_engine(plan: RunPlan, why: str | None) -> str | None:
    """A resumed sampled run keeps the engine it started with (each draws its own way: a switch would
    mix two runs' samples); a greedy one takes this start's choice (the same tokens either way)."""
    p = plan.inference
    if not p.sampling or (p.engine == "slots") == (why is None):
        return why
    if p.engine == "batches":
        return "the sampled run started on the batch engine"
    raise HpcgpuError(f"infer.engine: this sampled run started on the slot engine, which this start cannot take "
                      f"({why}); resume it as it started, or start a fresh run (submit --new)")


def make_engine(spec: Spec, model: Any, codec: Codec, ids: list[list[int]], rows: Sequence[Row],
                device: torch.device, batch: int, why: str | None) -> "BatchRunner | SlotRunner":
    if why is not None:
        log.info(f"engine: batches of {batch} ({why})")
        return BatchRunner(spec, model, codec, ids, rows, device, why)
    runner = SlotRunner(spec, model, codec, ids, rows, device, batch)
    e = runner.engine
    e.prepare()
    made = "compiled and captured" if e.compile_off_why is None else "captured"
    graphs = (f"decode steps as CUDA graphs of {e.steps} at {len(e.graphs)} view width(s), {made} in "
              f"{e.capture_s:.1f}s" if e.graphs else f"decode steps uncaptured ({e.graphs_off_why})")
    log.info(f"engine: slots: {batch} slots of {e.s.width} tokens (the longest row, rounded up), {graphs}, "
             f"attention: {e.attention}, refill {'on' if e.s.refill else 'off'}")
    return runner


def pick_engine(spec: Spec, model: Any, ids: list[list[int]]) -> str | None:
    """Why this run takes the batch engine (None: the slot engine), as one clause for the log."""
    inf = spec.infer
    width = slot_engine.cache_width(ids, inf.max_new_tokens)
    return why_batches(inf.mode, inf.engine, model.config, spec.model.quantization, width,
                       slot_engine.devices_of(model))


# ---------------------------------------------------------------- plan

def settle_infer_plan(ctx: Context, spec: Spec, paths: RunPaths, digest: str) -> RunPlan | None:
    """The recorded plan of this run, checked and fitted to this job's replica count; None when there
    is none (a fresh plan is decided once the model is loaded)."""
    recorded = recorded_plan(paths)
    if recorded is None:
        return None
    plan, source = recorded
    check_recorded(plan, source, spec, ctx.world_size)
    if plan.inference.input_digest and plan.inference.input_digest != digest:
        raise HpcgpuError(f"infer.input: {spec.infer.input} changed since this run started (the recorded plan "
                          f"{source} has another sha256); restore it, or start a fresh run (submit --new)")
    log.info(f"reusing the recorded plan from {source}: {plan.summary()} (decided at the first start: {plan.reason})")
    if plan.world_size != ctx.world_size:
        log.info(f"the run started with {plan.world_size} replica(s) and goes on with {ctx.world_size}: the "
                 f"batches stay the same (batch i runs on replica i % {ctx.world_size}); rows any replica "
                 "wrote are skipped")
    return with_replicas(plan, ctx.world_size)


def fresh_plan(ctx: Context, spec: Spec, model: Any, config: Any, precision: str, ids: Sequence[list[int]],
               digest: str, cap: MaxMemory, engine: str) -> RunPlan:
    inf = spec.infer
    max_tokens = max(len(s) for s in ids) + (inf.max_new_tokens if inf.mode == "generate" else 0)
    budget, per_row = None, None
    if inf.batch_size == "auto":
        budget = memory_budget(model, ctx.device, cap.gpu)
        if budget is not None:  # the same on every rank: the device kind and the environment are
            budget = agreed_min(budget, ctx.device)  # the smallest card decides
            per_row = row_bytes(config, inf.mode, max_tokens, precision)
    plan = plan_infer(spec, ctx.world_size, device_type=ctx.device.type, precision=precision, rows=len(ids),
                      max_tokens=max_tokens, input_digest=digest, budget_bytes=budget, bytes_per_row=per_row,
                      engine=engine)
    (log.warning if plan.inference.fits is False else log.info)(f"run plan: {plan.summary()}; {plan.reason}")
    return plan


# ---------------------------------------------------------------- the loop

def all_sum(values: list[float], group: Any) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


class WorkQueue:
    """The batches left, handed to whichever replica asks next, and the numbers the replicas share
    while they run: rows and tokens written, each replica's peak GPU memory (the stop agreement uses
    the same store: runtime/agree.py). All live in the process group's store (torch.distributed's
    TCPStore of the rendezvous; an in-memory HashStore for one replica): `add` is atomic there, so
    each batch is taken exactly once."""

    KEY = "hpcgpu/infer/"
    TOTALS = ("rows", "prompt_tokens", "completion_tokens")

    def __init__(self, store: Any, size: int, replicas: int, rank: int):
        self.store, self.size, self.replicas, self.rank = store, size, replicas, rank
        self._peak = 0

    @classmethod
    def for_job(cls, size: int, replicas: int, rank: int) -> "WorkQueue":
        store = dist.distributed_c10d._get_default_store() if replicas > 1 else dist.HashStore()
        return cls(store, size, replicas, rank)

    def _add(self, key: str, n: int) -> int:
        return int(self.store.add(self.KEY + key, n))

    def take(self) -> int | None:
        """The next batch (its position in the queue), or None when every one is taken."""
        k = self._add("next", 1) - 1
        return k if k < self.size else None

    def taken(self) -> int:
        return min(self._add("next", 0), self.size)

    def drop(self, rows: int) -> None:
        self._add("dropped", rows)

    def dropped(self) -> int:
        return self._add("dropped", 0)

    def record(self, rows: int, prompt_tokens: int, completion_tokens: int, peak_bytes: int) -> None:
        for key, n in zip(self.TOTALS, (rows, prompt_tokens, completion_tokens)):
            if n:
                self._add(key, n)
        if peak_bytes > self._peak:  # kept as the sum of this replica's increases: the store has no max
            self._add(f"peak/{self.rank}", peak_bytes - self._peak)
            self._peak = peak_bytes

    def totals(self) -> tuple[list[int], list[int]]:
        """(rows, prompt tokens, generated tokens) written by every replica, and each one's peak memory."""
        return ([self._add(key, 0) for key in self.TOTALS],
                [self._add(f"peak/{r}", 0) for r in range(self.replicas)])


class InferProgress:
    """Rank 0's progress line (done/total, rows/s, tokens/s, ETA) and the metrics "infer" records."""

    def __init__(self, ctx: Context, metrics: MetricsWriter, total: int, done: int):
        self.ctx, self.metrics, self.total, self.start_done = ctx, metrics, total, done
        self.score = ctx.spec is not None and ctx.spec.infer.mode == "score"
        self.done, self.prompt_tokens, self.completion_tokens, self.peak_gib = done, 0, 0, None
        self.t0 = self.last = time.perf_counter()

    def update(self, totals: tuple[list[int], list[int]]) -> None:
        """From WorkQueue.totals(): what every replica wrote in this start so far."""
        (rows, prompt, completion), peaks = totals
        self.done = self.start_done + rows
        self.prompt_tokens, self.completion_tokens = prompt, completion
        if any(p > 0 for p in peaks):
            self.peak_gib = max(peaks) / 2 ** 30

    def maybe_log(self, first: bool, last: bool) -> None:
        now = time.perf_counter()
        if not self.ctx.is_main or not (first or last or now - self.last >= LOG_EVERY_S):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        rows_s = (self.done - self.start_done) / dt
        tok_s, prompt_s = self.completion_tokens / dt, self.prompt_tokens / dt
        eta = (self.total - self.done) / rows_s if rows_s > 0 else None
        self.metrics.write("infer", rows=self.done, rows_total=self.total, rows_per_s=rows_s, tokens_per_s=tok_s,
                           prompt_tokens_per_s=prompt_s, tokens=self.completion_tokens, elapsed_s=dt,
                           peak_mem_gib=self.peak_gib)
        mem = f" | peak {self.peak_gib:.1f} GiB" if self.peak_gib is not None else ""
        tokens = (f"{prompt_s:10,.0f} tok/s scored" if self.score else
                  f"{tok_s:10,.0f} gen tok/s | {prompt_s:10,.0f} prompt tok/s")
        log.info(f"rows {self.done:>{len(str(self.total))}}/{self.total} ({100 * self.done / self.total:5.1f}%) | "
                 f"{rows_s:8.2f} rows/s | {tokens} | ETA {fmt_eta(eta)}{mem}")


def fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def stop_infer(ctx: Context, rows_done: int, how: str) -> int:
    """After an agreed stop: the run's one stop (runtime/run.py), with the rows written (nothing to
    save: the rows are the checkpoint)."""
    return ctx.run.stop(StopNote({"rows": rows_done}, f"stopped with {rows_done} rows written {how}"))


@dataclass
class ReplicaTimes:
    """Where one replica's loop time went: running its chunks (batches, or the slot engine's rows; the
    first, cold one also on its own), writing them, and waiting at the end for the replicas still
    running their last rows."""

    batches_s: float = 0.0
    first_batch_s: float = 0.0
    write_s: float = 0.0
    wait_s: float = 0.0
    loop_s: float = 0.0
    started: float = 0.0  # perf_counter at the loop's start
    FIELDS = ("loop_s", "batches_s", "first_batch_s", "write_s", "wait_s")

    @contextlib.contextmanager
    def timing(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, what, getattr(self, what) + time.perf_counter() - t0)

    def every_replica(self, ctx: Context) -> dict[str, list[float]]:
        """Each field as every replica's value, in rank order (collective: one all-reduce)."""
        n = ctx.world_size
        slots = [0.0] * (n * len(self.FIELDS))
        for k, name in enumerate(self.FIELDS):
            slots[k * n + ctx.rank] = getattr(self, name)
        summed = all_sum(slots, coordination_group(ctx.device))
        return {f"replica_{name}": [round(v, 3) for v in summed[k * n:(k + 1) * n]]
                for k, name in enumerate(self.FIELDS)}


def describe_times(times: dict[str, list[float]]) -> str:
    def span(key: str) -> str:
        v = times[f"replica_{key}"]
        return f"{min(v):.1f}" if min(v) == max(v) else f"{min(v):.1f}-{max(v):.1f}"

    return (f"replica loops {span('loop_s')} s: batches {span('batches_s')} s (the first {span('first_batch_s')} "
            f"s), writing {span('write_s')} s, waiting for the others {span('wait_s')} s")


def infer_loop(ctx: Context, paths: RunPaths, engine: Any, batches: list[list[int]],
               metrics: MetricsWriter, rows: Sequence[Row],
               times: ReplicaTimes | None = None) -> tuple[str, InferProgress]:
    """This replica's share of the rows: the engine (BatchRunner or SlotRunner) takes chunks from the
    queue until it is empty or a stop is raised; returns ('finished' | 'stopped', progress).
    Collective: a barrier before the first chunk and one after the last. `times` gets where this
    replica's loop time went."""
    times = times if times is not None else ReplicaTimes()
    with times.timing("loop_s"):
        return _replica_loop(ctx, paths, engine, batches, metrics, rows, times)


class Feed:
    """The engine's side of the queue: the next chunk (whether to stop is the run's agreement among
    replicas, ctx.agreement.replica_poll)."""

    def __init__(self, ctx: Context, queue: WorkQueue, todo: list[tuple[int, list[int]]], done: set[int]):
        self.ctx, self.queue, self.todo, self.done = ctx, queue, todo, done
        self.fresh, self.taken = not done, 0

    def take(self) -> Chunk | None:
        k = self.queue.take()
        if k is None:
            return None
        self.taken += 1
        inject_signal(self.ctx.spec, self.ctx.rank, self.taken, armed=self.fresh)  # a resumed start goes on
        number, batch = self.todo[k]
        return Chunk(number, batch, [i for i in batch if i not in self.done])


class Sink:
    """Where finished rows go: the replica file (rows already written skipped), the shared counters and
    rank 0's progress line; written at once, or gathered for `every_s` (the slot engine ends rows
    many times a second: one fsync and a few store round trips for all of them)."""

    def __init__(self, ctx: Context, queue: WorkQueue, writer: outputs.ReplicaWriter, progress: InferProgress,
                 done: set[int], times: ReplicaTimes, every_s: float):
        self.ctx, self.queue, self.writer, self.progress, self.done = ctx, queue, writer, progress, done
        self.times, self.every = times, every_s
        self.records: list[dict[str, Any]] = []
        self.prompt = self.completion = self.emitted = 0
        self.flushed_at = time.perf_counter()

    def emit(self, result: BatchResult) -> None:
        beat()
        if self.emitted == 0:
            self.times.first_batch_s = time.perf_counter() - self.times.started - self.times.write_s
        self.emitted += 1
        # a batch partly written before (a kill -9 mid-write) is redone whole: only its missing rows are written
        self.records += [r for r in result.records if r["index"] not in self.done]
        self.prompt += result.prompt_tokens
        self.completion += result.completion_tokens
        if time.perf_counter() - self.flushed_at >= self.every or self.emitted == 1:
            self.flush()

    def flush(self) -> None:
        with self.times.timing("write_s"):
            self.writer.write(self.records)
            self.queue.record(len(self.records), self.prompt, self.completion, peak_memory(self.ctx.device))
            self.records, self.prompt, self.completion = [], 0, 0
            if self.ctx.is_main:
                self.progress.update(self.queue.totals())
                self.progress.maybe_log(self.emitted == 1, False)
        self.flushed_at = time.perf_counter()


def _replica_loop(ctx: Context, paths: RunPaths, engine: Any, batches: list[list[int]],
                  metrics: MetricsWriter, rows: Sequence[Row], times: ReplicaTimes) -> tuple[str, InferProgress]:
    done, todo = rows_to_do(ctx, paths, batches, metrics, rows)
    progress = InferProgress(ctx, metrics, len(rows), len(done))
    queue = WorkQueue.for_job(len(todo), ctx.world_size, ctx.rank)
    feed = Feed(ctx, queue, todo, done)
    # replicas run unequal numbers of chunks: they agree through the store, never a collective per poll
    ctx.agreement.among_replicas(queue.store, engine.store_every_s)
    with outputs.ReplicaWriter(paths.replica_outputs(ctx.rank)) as writer:
        sink = Sink(ctx, queue, writer, progress, done, times, engine.store_every_s)
        times.started = time.perf_counter()
        held = engine.loop(feed.take, sink.emit, ctx.agreement.replica_poll)
        sink.flush()
        times.batches_s = time.perf_counter() - times.started - times.write_s
    if held:
        queue.drop(held)  # rows a stop left unfinished: the run is not complete even if every chunk was taken
    with times.timing("wait_s"):
        coordination_barrier(ctx.device)  # every replica is past its last chunk
    progress.update(queue.totals())
    progress.maybe_log(False, True)
    # every chunk taken ran to its end: a signal during the last ones stops nothing
    return ("finished" if queue.taken() == len(todo) and queue.dropped() == 0 else "stopped"), progress


def rows_to_do(ctx: Context, paths: RunPaths, batches: list[list[int]], metrics: MetricsWriter,
               rows: Sequence[Row]) -> tuple[set[int], list[tuple[int, list[int]]]]:
    """The rows written before and the batches (number, rows) still to run. Collective: a barrier."""
    # every replica reads every replica file (after rank 0's repair and a barrier)
    done = outputs.done_rows(paths, rows)
    # the longest batches first: an out-of-memory shows at once, a static KV cache sized by the
    # first batch serves every later one, and the short batches at the end even out the replicas
    todo = [(b, batch) for b, batch in reversed(list(enumerate(batches))) if any(i not in done for i in batch)]
    written = len(done)
    coordination_barrier(ctx.device)  # no replica writes before every one has read: the same queue on each
    if written and ctx.is_main:
        metrics.write("resume", rows=written, rows_total=len(rows), restart_count=ctx.env.restart_count)
        log.info(f"resuming: {written} of {len(rows)} rows already written; {len(rows) - written} to go")
    return done, todo


def peak_memory(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


# ---------------------------------------------------------------- the task

def run_infer(spec: Spec, paths: RunPaths) -> int:
    with init(spec, paths, alone_group=False) as ctx:
        if is_finished(ctx.run_dir):
            log.info(f"{ctx.run_dir} finished earlier; nothing to do")
            return 0
        quiet_libraries(ctx)
        # rank 0's TensorBoard / W&B, fed by metrics; opened once the run plan is written; closed with the run
        metrics = ctx.run.open_metrics(open_tracking(spec, paths, ctx.is_main))
        return _run(ctx, spec, paths, metrics)


def _run(ctx: Context, spec: Spec, paths: RunPaths, metrics: MetricsWriter) -> int:
    inf = spec.infer
    source = str(inf.input)
    model_ref = spec.model.name_or_path or "model.config"
    cap = parse_max_memory(inf.max_memory)  # a bad one fails now, not after the weights loaded
    rows = read_rows(source, inf.mode)
    digest = file_digest(source)
    codec = Codec(load_infer_tokenizer(spec), model_ref)
    ids = encode_rows(rows, codec, inf.mode, source)
    config = model_config(spec)
    check_rows_fit(rows, ids, config, inf.mode, inf.max_new_tokens, source, model_ref)
    plan = settle_infer_plan(ctx, spec, paths, digest)
    precision = plan.precision if plan is not None else infer_precision(
        spec.model.dtype, ctx.device.type, ctx.device.type == "cuda" and torch.cuda.is_bf16_supported())
    check_replica_fits(spec, config, precision, ctx.device, cap)
    model = load_model(ctx, spec, precision, cap, f"{len(rows)} rows from {source}")
    why = pick_engine(spec, model, ids)
    if plan is None:
        plan = fresh_plan(ctx, spec, model, config, precision, ids, digest, cap, "batches" if why else "slots")
    why = settle_engine(plan, why)
    ctx.plan = plan
    record_plan(ctx, plan, paths)  # a barrier first: every rank has read the recorded plan (or none)
    if ctx.should_stop():
        return stop_infer(ctx, len(outputs.done_rows(paths, rows)), "(stopped while starting)")
    batches = make_batches([len(s) for s in ids], chunk_rows(plan.inference.batch_size, "batches" if why else "slots"))
    if ctx.is_main:
        outputs.repair_all(paths)
    ctx.barrier()  # no replica reads the replica files before they are whole
    if why is None and ctx.device.type == "cuda":  # the slot engine's compiled decode step: cached for the runs folder
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache(spec.runs_dir)))
    engine = make_engine(spec, model, codec, ids, rows, ctx.device, plan.inference.batch_size, why)
    tracking = metrics.tracking
    if tracking is not None:
        tracking.start()  # plan.json is written; opened before the clock of rows/s starts
    with ctx.run.monitor(ctx.device.type == "cuda",
                         on_sample=tracking.gpu_sample if tracking is not None and tracking.active else None):
        times = ReplicaTimes()
        outcome, progress = infer_loop(ctx, paths, engine, batches, metrics, rows, times)
    metrics.write("engine", **engine.describe())
    if outcome == "stopped":
        return stop_infer(ctx, progress.done, "(the next start goes on from there)")
    finish(ctx, paths, rows, metrics, progress, times.every_replica(ctx))  # collective: every replica's rows are on disk
    return 0


def load_model(ctx: Context, spec: Spec, precision: str, cap: MaxMemory, what: str) -> Any:
    """The replica's model, loaded and described (size, dtype, where, how long; each GPU's layers)."""
    model_ref = spec.model.name_or_path or "model.config"
    t0 = time.perf_counter()
    model = load_for_inference(spec, ctx.device, TORCH_DTYPES[precision], cap)
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{spec.gpus_per_task} GPUs" if ctx.device.type == "cuda" and spec.gpus_per_task > 1 else f"{ctx.device}"
    quant = f" ({spec.model.quantization} weights)" if spec.model.quantization != "none" else ""
    log.info(f"model {model_ref}: {n_params / 1e6:.2f}M params, {precision}{quant}, on {where} x {ctx.world_size} "
             f"replica(s), loaded in {time.perf_counter() - t0:.1f}s; {what}")
    for line in placement(model):
        log.info(f"placement: {line}")
    return model


def finish(ctx: Context, paths: RunPaths, rows: Sequence[Row], metrics: MetricsWriter, progress: InferProgress,
           replica_times: dict[str, list[float]]) -> None:
    """Rank 0 merges the replica files into the output, marks the run finished and writes "end"."""
    if not ctx.is_main:
        return
    log.info(describe_times(replica_times))
    out = outputs.merge(paths, rows)
    mark_finished(ctx.run_dir, ctx.env)
    elapsed = time.perf_counter() - progress.t0
    metrics.write("end", rows=len(rows), rows_this_start=progress.done - progress.start_done,
                  tokens=progress.completion_tokens, elapsed_s=elapsed, **replica_times)
    log.info(f"wrote {out} ({len(rows)} rows)")
