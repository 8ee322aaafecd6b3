"""Training data: text or JSONL, tokenized once, packed into seq_len blocks, split across ranks.

The order of blocks depends only on (seed, epoch): every global batch is the same sequences whatever
the number of ranks, so changing the GPU count changes neither the data nor the loss curve.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from hpcgpu.errors import HpcgpuError


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: needs no files, works for any text."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save_pretrained(self, path: str | Path) -> None:
        Path(path, "hpcgpu_tokenizer.json").write_text(json.dumps({"type": "bytes", "vocab_size": 256}) + "\n")


def load_tokenizer(name_or_path: str | None) -> Any:
    """The model's own tokenizer if its directory has one, else the byte-level tokenizer."""
    if name_or_path:
        marker = Path(name_or_path, "hpcgpu_tokenizer.json")
        if marker.exists():
            return ByteTokenizer()
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError):
            pass  # a model directory without tokenizer files
    return ByteTokenizer()


def read_texts(path: str) -> list[str]:
    p = Path(path)
    if not p.exists():
        raise HpcgpuError(f"data file not found: {path}")
    if p.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(read_utf8(p).splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                text = None
            if not isinstance(text, str):
                raise HpcgpuError(f"{path}:{n}: expected a JSON object with a \"text\" field (a string)")
            texts.append(text)
        return texts
    return [read_utf8(p)]


def read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise HpcgpuError(f"{path}: not UTF-8 text (byte {exc.start}); convert it or give a .jsonl") from None


def tokenize(texts: list[str], tokenizer: Any) -> np.ndarray:
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for text in texts:
        ids.extend(tokenizer.encode(text))
        if eos is not None and len(texts) > 1:
            ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def pack(ids: np.ndarray, seq_len: int, source: str) -> torch.Tensor:
    n = len(ids) // seq_len
    if n == 0:
        raise HpcgpuError(f"{source}: {len(ids)} tokens is less than one sequence of seq_len={seq_len}")
    return torch.from_numpy(ids[: n * seq_len].reshape(n, seq_len).copy())


def load_blocks(path: str, tokenizer: Any, seq_len: int) -> torch.Tensor:
    return pack(tokenize(read_texts(path), tokenizer), seq_len, path)


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


def eval_batches(blocks: torch.Tensor, micro: int, n_batches: int, rank: int, world: int) -> Iterator[torch.Tensor]:
    """A fixed slice of the eval set per rank: the same every time, so eval losses compare."""
    total = min(len(blocks), micro * n_batches * world)
    per_rank = total // world
    mine = blocks[rank * per_rank: (rank + 1) * per_rank]
    for i in range(0, len(mine) - micro + 1, micro):
        yield mine[i: i + micro]
