"""Training data: a prepared dataset (hpcgpu/data) memory-mapped by every rank, cut into seq_len
blocks and split across ranks. A raw .txt/.jsonl/parquet file is prepared once through the cache.

The order of blocks depends only on (seed, epoch): every global batch is the same sequences whatever
the number of ranks, so changing the GPU count changes neither the data nor the loss curve.

data.format chat and prompt_completion: ExampleBlocks, blocks of whole examples (packed or one a
block) whose batches carry labels (-100 where the loss mask is 0 and on padding) and an attention mask.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from hpcgpu.data import PreparedData, open_training_data
from hpcgpu.data.sources import iter_documents, open_source
from hpcgpu.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from hpcgpu.data.trainable import manifest_note
from hpcgpu.errors import HpcgpuError

__all__ = ["Batch", "BatchSchedule", "Blocks", "ByteTokenizer", "DataPosition", "ExampleBlocks", "TokenBlocks",
           "Tokenizer", "causal_lm_loss", "causal_lm_loss_sum", "eval_batches", "load_blocks", "load_tokenizer",
           "pack_examples", "read_texts", "tokenize"]

log = logging.getLogger("hpcgpu")
IGNORE = -100  # the label Hugging Face's (and torch's) cross entropy leaves out


def read_texts(path: str, text_field: str = "text") -> list[str]:
    """Every document of a raw file, in memory (small files and tests; training maps prepared data)."""
    return [text for text, _ in iter_documents(open_source(path), text_field) if text is not None]


def tokenize(texts: list[str], tokenizer: Any) -> np.ndarray:
    """The reference token stream: each text's ids, then eos when there are several texts.
    Prepared datasets hold exactly this stream (tests compare them)."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for text in texts:
        ids.extend(tokenizer.encode(text))
        if eos is not None and len(texts) > 1:
            ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


class TokenBlocks:
    """seq_len-token blocks over a memory-mapped token file: a view, so start-up time and memory do not
    grow with the data; rows are read when a batch asks for them. The tail short of a block is dropped."""

    dtype = torch.int64  # of the batches it gives (the file holds uint16/uint32)

    def __init__(self, data: PreparedData, seq_len: int, source: str):
        n = data.num_tokens // seq_len
        if n == 0:
            raise HpcgpuError(f"{source}: {data.num_tokens} tokens is less than one sequence of seq_len={seq_len}")
        self.rows = data.tokens[: n * seq_len].reshape(n, seq_len)
        self.seq_len = seq_len
        self.max_token_id: Optional[int] = data.max_token_id
        self.path = data.path

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.rows), self.seq_len)

    @property
    def int64_bytes(self) -> int:
        return len(self.rows) * self.seq_len * 8

    def take(self, idx: Union[torch.Tensor, np.ndarray, list[int]]) -> torch.Tensor:
        """The blocks at `idx` (in that order) as an int64 tensor. Rows are read in file order (sorted),
        which turns random reads of a large file into a forward sweep."""
        idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1)
        order = np.argsort(idx, kind="stable")
        out = np.empty((len(idx), self.seq_len), dtype=np.int64)
        out[order] = self.rows[idx[order]]
        return torch.from_numpy(out)

    def __getitem__(self, key: Union[slice, torch.Tensor, np.ndarray, list[int]]) -> torch.Tensor:
        if isinstance(key, slice):
            return torch.from_numpy(np.asarray(self.rows[key], dtype=np.int64))
        return self.take(key)

    def tensor(self) -> torch.Tensor:
        """Every block as one int64 tensor: for small sets only (kept on the GPU, tests)."""
        return self[:]

    def flatten(self) -> torch.Tensor:
        return self.tensor().flatten()


def pack_examples(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Greedy packing in input order: the index of each block's first example, then len(lengths).

    An example goes into the current block if it fits in what is left of it, else it starts the next
    one; no example is split (each is at most seq_len long: truncated before)."""
    firsts, used = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > seq_len:
            firsts.append(i)
            used = 0
        used += n
    firsts.append(len(lengths))
    return np.asarray(firsts, dtype=np.int64)


class ExampleBlocks:
    """seq_len blocks of whole chat/prompt_completion examples over a memory-mapped prepared dataset.

    Which examples make a block is worked out at load from docs.npy alone (example lengths), so it is
    cheap, deterministic and the same on every rank; tokens are read when a batch asks for them.
    packing: each block holds as many whole examples as fit, in input order; else one example a block.
    An example longer than seq_len is cut to its first seq_len tokens. The log line at load counts the
    rows without a trainable token (the manifest's count) and those the cut leaves none; data where no
    example keeps one is refused. A batch is a dict of int64
    tensors: input_ids (padding: eos, or 0 without one), labels (the token where the loss mask is 1,
    else -100; also -100 on padding and on each example's first token, which has nothing of its own
    before it to be predicted from) and attention_mask (0 on padding)."""

    def __init__(self, data: PreparedData, seq_len: int, source: str, packing: bool = True):
        if data.mask is None:
            raise ValueError(f"{source}: a text dataset has no loss mask")
        docs = np.asarray(data.documents(), dtype=np.int64)
        starts, lengths = docs[:-1], np.diff(docs)
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        if len(lengths) == 0:
            raise HpcgpuError(f"{source}: no examples")
        cut = int((lengths > seq_len).sum())
        untrained = untrained_note(data, starts, lengths, seq_len, source)
        lengths = np.minimum(lengths, seq_len)
        self.starts, self.lengths = starts, lengths
        self.firsts = pack_examples(lengths, seq_len) if packing else np.arange(len(lengths) + 1, dtype=np.int64)
        self.tokens, self.mask = data.tokens, data.mask
        self.seq_len, self.path = seq_len, data.path
        self.max_token_id: Optional[int] = data.max_token_id
        self.pad_id = int(data.eos_id) if data.eos_id is not None else 0
        (log.warning if untrained else log.info)(
            f"{source}: {len(lengths):,} {data.data_format} examples in {len(self):,} blocks of {seq_len} tokens "
            f"({'packed' if packing else 'one a block'}); {cut:,} longer than seq_len cut to it{untrained}")

    def __len__(self) -> int:
        return len(self.firsts) - 1

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.seq_len)

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Block b's ids and labels (seq_len each, padded) and how many positions hold tokens."""
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE, dtype=np.int64)
        at = 0
        for e in range(int(self.firsts[b]), int(self.firsts[b + 1])):
            start, n = int(self.starts[e]), int(self.lengths[e])
            ids[at: at + n] = self.tokens[start: start + n]
            counts = self.mask[start: start + n].astype(bool)  # a copy: the map is read-only
            counts[0] = False
            labels[at: at + n] = np.where(counts, ids[at: at + n], IGNORE)
            at += n
        return ids, labels, at

    def take(self, idx: Union[torch.Tensor, np.ndarray, list[int]]) -> dict[str, torch.Tensor]:
        """The blocks at `idx` (in that order) as a batch."""
        idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64).reshape(-1)
        ids = np.empty((len(idx), self.seq_len), dtype=np.int64)
        labels = np.empty_like(ids)
        attention = np.zeros_like(ids)
        for row, b in enumerate(idx.tolist()):
            ids[row], labels[row], filled = self.block(b)
            attention[row, :filled] = 1
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "attention_mask": torch.from_numpy(attention)}

    def __getitem__(self, key: Union[slice, torch.Tensor, np.ndarray, list[int]]) -> dict[str, torch.Tensor]:
        if isinstance(key, slice):
            return self.take(list(range(len(self))[key]))  # a range slices without a list of every block
        return self.take(key)


CHUNK_EXAMPLES = 4096  # examples whose loss mask is read at a time until one that trains is found


def trains(mask: np.ndarray, start: int, end: int) -> bool:
    """Whether the loss mask has a one in [start, end): reads that span only (the mask is memory-mapped)."""
    return end > start and bool(mask[start:end].any())


def some_example_trains(mask: np.ndarray, starts: np.ndarray, kept: np.ndarray) -> bool:
    """Whether an example has a trainable token in its kept part (its first token is never a target):
    the mask read a chunk of examples at a time, stopping at the first that trains (at once, for any
    usable data), so a rank's start reads all of it only for data it refuses."""
    for first in range(0, len(starts), CHUNK_EXAMPLES):
        begins, kept_here = starts[first:first + CHUNK_EXAMPLES], kept[first:first + CHUNK_EXAMPLES]
        base = int(begins[0])
        chunk = np.asarray(mask[base:int(begins[-1] + kept_here[-1])])
        if any(chunk[b + 1:b + k].any() for b, k in zip((begins - base).tolist(), kept_here.tolist())):
            return True
    return False


def untrained_note(data: PreparedData, starts: np.ndarray, lengths: np.ndarray, seq_len: int, source: str) -> str:
    """The log line's words on examples that train nothing: the rows without a trainable token (the
    manifest's count, trainable.py's rule) and those whose trainable tokens all lie past seq_len (only the
    examples longer than seq_len are read for it). No example keeping one is an error: every loss would
    be 0."""
    assert data.mask is not None
    if not some_example_trains(data.mask, starts, np.minimum(lengths, seq_len)):
        raise HpcgpuError(f"{source}: no example has a trainable token in its first seq_len={seq_len} tokens, so "
                          "every step's loss would be 0; raise data.seq_len or give rows whose trained part "
                          "comes sooner")
    long = lengths > seq_len
    lost = sum(1 for s, n in zip(starts[long].tolist(), lengths[long].tolist())
               if not trains(data.mask, s + 1, s + seq_len) and trains(data.mask, s + seq_len, s + n))
    note = manifest_note(data.manifest)
    words = [note] if note else []
    if lost:
        words.append(f"{lost:,} lose every trainable token to the seq_len={seq_len} cut")
    return "".join(f"; {w}" for w in words)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the labels that are not -100, as Hugging Face's causal LM
    loss computes it (float32 logits), except that a batch without one such label gives 0, not NaN."""
    total, count = causal_lm_loss_sum(logits, labels)
    return total / count.clamp(min=1)


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token cross entropy and the number of labels it counts (those not -100)."""
    # each position's target is the next label, the last position's none: the labels move, not the
    # logits (a [tokens x vocab] copy where this runs uncompiled)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE).reshape(-1).to(logits.device)
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets, ignore_index=IGNORE,
                            reduction="sum")
    return total, (targets != IGNORE).sum()


Blocks = Union[TokenBlocks, ExampleBlocks]
# text: the ids (which are the labels too); chat/prompt_completion: input_ids, labels, attention_mask
Batch = Union[torch.Tensor, dict[str, torch.Tensor]]


def load_blocks(path: str, tokenizer: Any, seq_len: int, text_field: str = "text",
                cache_dir: Optional[str] = None, data_format: str = "text",
                packing: bool = True) -> Blocks:
    """The seq_len blocks of data.train/data.eval: a prepared folder, or a raw file prepared (once,
    through the cache) with `tokenizer`. Text: a flat token stream cut into blocks; chat and
    prompt_completion: blocks of whole examples."""
    data = open_training_data(path, tokenizer, text_field, cache_dir, data_format)
    if data_format == "text":
        return TokenBlocks(data, seq_len, path)
    return ExampleBlocks(data, seq_len, path, packing)


@dataclass
class DataPosition:
    epoch: int = 0
    offset: int = 0  # blocks of this epoch's order already consumed


class BatchSchedule:
    """Global batches of block indices in a seeded per-epoch order; each rank takes its slice.

    The split (sequences per rank, micro batch) is the run plan's: nothing is divided here."""

    def __init__(self, num_blocks: int, seed: int, rank: int, *, global_batch: int, per_rank: int, micro: int):
        if num_blocks < global_batch:
            raise HpcgpuError(f"the data has {num_blocks} sequences, fewer than one global batch "
                              f"({global_batch}); use more text, a smaller seq_len or global_batch_size")
        if (rank + 1) * per_rank > global_batch:
            raise ValueError(f"rank {rank} x {per_rank} sequences lies outside the global batch of {global_batch}")
        self.num_blocks, self.global_batch, self.seed = num_blocks, global_batch, seed
        self.rank, self.per_rank, self.micro = rank, per_rank, micro
        self.pos = DataPosition()
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.num_blocks, generator=g)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def next_global(self) -> torch.Tensor:
        if self.pos.offset + self.global_batch > self.num_blocks:
            self.pos = DataPosition(self.pos.epoch + 1, 0)  # the remainder of an epoch is skipped
        order = self._epoch_order(self.pos.epoch)
        batch = order[self.pos.offset: self.pos.offset + self.global_batch]
        self.pos = DataPosition(self.pos.epoch, self.pos.offset + self.global_batch)
        return batch

    def next_micro_batches(self) -> list[torch.Tensor]:
        """This rank's micro batches (index tensors) of the next global batch."""
        mine = self.next_global()[self.rank * self.per_rank: (self.rank + 1) * self.per_rank]
        return list(mine.split(self.micro))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.pos.epoch, "offset": self.pos.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = DataPosition(int(state["epoch"]), int(state["offset"]))


def eval_batches(blocks: Union[TokenBlocks, ExampleBlocks, torch.Tensor], micro: int, sequences: int,
                 rank: int, world: int) -> Iterator[Union[torch.Tensor, dict[str, torch.Tensor]]]:
    """This rank's share of the eval set's first `sequences` blocks, in micro batches (the last may be
    smaller): the same blocks at every rank count and micro batch, so eval losses compare. Every rank
    gets as many blocks and batches (ZeRO-3 gathers parameters in each forward, all ranks together);
    an eval set of fewer blocks is cut to a multiple of the rank count."""
    per_rank = min(len(blocks), sequences) // world
    first = rank * per_rank
    for i in range(first, first + per_rank, micro):
        yield blocks[i: min(i + micro, first + per_rank)]
