"""Training data: the batch order is a function of (seed, epoch) only, whatever the number of ranks;
resuming continues the same sequence; text/JSONL reading fails with one line naming the file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime.data import BatchSchedule, ByteTokenizer, eval_batches, load_blocks, load_tokenizer, read_texts
from hpcgpu.spec.derive import batch_split

NUM_BLOCKS, GLOBAL, SEED = 50, 8, 3  # 6 global batches per epoch, 2 blocks left over each epoch


def schedule(seed: int, rank: int, world: int, micro: int, num_blocks: int = NUM_BLOCKS,
             global_batch: int = GLOBAL) -> BatchSchedule:
    """The schedule of one rank, split as the run plan splits it (spec/derive.py batch_split)."""
    per_rank, _ = batch_split(global_batch, world, micro)
    return BatchSchedule(num_blocks, seed, rank, global_batch=global_batch, per_rank=per_rank, micro=micro)


def globals_of(schedule: BatchSchedule, steps: int) -> list[list[int]]:
    return [schedule.next_global().tolist() for _ in range(steps)]


def union_of_ranks(world: int, micro: int, steps: int, seed: int = SEED,
                   state: dict | None = None) -> list[list[int]]:
    """Per step, the concatenation (rank order) of every rank's micro batches."""
    schedules = [schedule(seed, rank, world, micro) for rank in range(world)]
    if state is not None:
        for s in schedules:
            s.load_state_dict(state)
    out = []
    for _ in range(steps):
        step: list[int] = []
        for s in schedules:
            micro_batches = s.next_micro_batches()
            assert len(micro_batches) == GLOBAL // world // micro
            assert all(len(mb) == micro for mb in micro_batches)
            step += torch.cat(micro_batches).tolist()
        out.append(step)
    return out


@pytest.mark.parametrize("world,micro", [(1, 8), (1, 2), (2, 1), (2, 4), (4, 2), (4, 1)])
def test_ranks_together_see_the_one_rank_global_batch(world: int, micro: int) -> None:
    steps = 14  # past two epoch boundaries
    reference = globals_of(schedule(SEED, 0, 1, GLOBAL), steps)
    assert union_of_ranks(world, micro, steps) == reference


def test_epochs_cover_the_data_without_repeats_and_roll_over() -> None:
    batches = globals_of(schedule(SEED, 0, 1, 2), 12)
    epoch0 = [i for b in batches[:6] for i in b]
    epoch1 = [i for b in batches[6:] for i in b]
    for epoch in (epoch0, epoch1):
        assert len(set(epoch)) == len(epoch) == 48  # no block twice within an epoch
        assert all(0 <= i < NUM_BLOCKS for i in epoch)
    assert epoch0 != epoch1  # a fresh order each epoch


def test_order_is_reproducible_and_depends_on_the_seed() -> None:
    a = globals_of(schedule(SEED, 0, 1, 2), 10)
    b = globals_of(schedule(SEED, 0, 1, 2), 10)
    c = globals_of(schedule(SEED + 1, 0, 1, 2), 10)
    assert a == b
    assert a != c


def test_state_dict_resumes_the_same_sequence() -> None:
    first = schedule(SEED, 0, 1, 2)
    globals_of(first, 9)  # into the second epoch
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    uninterrupted = globals_of(first, 8)
    resumed = schedule(SEED, 0, 1, 2)
    resumed.load_state_dict(state)
    assert globals_of(resumed, 8) == uninterrupted


def test_resume_on_a_different_number_of_ranks_continues_the_same_batches() -> None:
    one = schedule(SEED, 0, 1, 8)
    globals_of(one, 5)
    state = one.state_dict()
    assert union_of_ranks(4, 1, 6, state=state) == globals_of(one, 6)


def test_fewer_sequences_than_one_global_batch_is_an_error() -> None:
    with pytest.raises(HpcgpuError, match="fewer than one global batch"):
        schedule(0, 0, 1, 1, num_blocks=5, global_batch=8)


def test_eval_batches_are_fixed_and_disjoint_across_ranks() -> None:
    blocks = torch.arange(40).reshape(20, 2)
    per_rank = [[b.tolist() for b in eval_batches(blocks, 2, 12, rank, 2)] for rank in range(2)]
    again = [[b.tolist() for b in eval_batches(blocks, 2, 12, rank, 2)] for rank in range(2)]
    assert per_rank == again
    assert all(len(batches) == 3 for batches in per_rank)
    rows = [tuple(r) for batches in per_rank for b in batches for r in b]
    assert len(rows) == len(set(rows)) == 12


@pytest.mark.parametrize("micro, world", [(4, 1), (2, 2), (3, 2), (1, 4), (5, 3)])
def test_eval_reads_the_same_blocks_at_every_rank_count_and_micro_batch(micro: int, world: int) -> None:
    blocks = torch.arange(50).reshape(25, 2)
    shares = [list(eval_batches(blocks, micro, 12, rank, world)) for rank in range(world)]
    rows = sorted(r for share in shares for b in share for r in b[:, 0].tolist())
    assert rows == list(range(0, 24, 2))  # the first 12 blocks, each once
    assert len({len(share) for share in shares}) == 1  # as many forwards on every rank (ZeRO-3)


def test_an_eval_set_shorter_than_asked_is_cut_to_a_multiple_of_the_ranks() -> None:
    blocks = torch.arange(14).reshape(7, 2)
    shares = [[b.shape[0] for b in eval_batches(blocks, 2, 12, rank, 2)] for rank in range(2)]
    assert shares == [[2, 1], [2, 1]]


def test_byte_tokenizer_round_trip_with_non_ascii() -> None:
    tok = ByteTokenizer()
    text = "naïve café — 日本語 🚀\ttabs\nand newlines"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text


def test_byte_tokenizer_is_what_a_saved_run_reloads(tmp_path: Path) -> None:
    ByteTokenizer().save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_text_file_packs_into_seq_len_blocks(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    text = "héllo wörld " * 10  # 140 bytes
    path.write_text(text, encoding="utf-8")
    blocks = load_blocks(str(path), ByteTokenizer(), 16)
    assert blocks.shape == (140 // 16, 16) and blocks.dtype == torch.int64
    assert bytes(blocks.flatten().tolist()) == text.encode()[: 8 * 16]  # the tail that does not fill a block is dropped


def test_jsonl_reads_the_text_field(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"text": "first document", "id": 1}, {"text": "zweites Dokument ü"}, {"text": "third"}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    assert read_texts(str(path)) == [r["text"] for r in rows]
    blocks = load_blocks(str(path), ByteTokenizer(), 8)
    joined = "".join(r["text"] for r in rows).encode()
    assert blocks.flatten().tolist() == list(joined[: len(joined) // 8 * 8])


@pytest.mark.parametrize("bad_line, says", [('{"content": "no text field"}', 'expected a JSON object with a "text" field'),
                                             ("not json at all", "not a JSON object"),
                                             ('["a", "list"]', 'expected a JSON object with a "text" field')])
def test_jsonl_line_without_text_names_file_and_line(tmp_path: Path, bad_line: str, says: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + bad_line + "\n" + '{"text": "fine"}\n')
    with pytest.raises(HpcgpuError, match=rf"{path}:2: {says}"):
        load_blocks(str(path), ByteTokenizer(), 8)


def test_jsonl_text_that_is_not_a_string_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 5}\n')
    with pytest.raises(HpcgpuError, match=rf"{path}:2"):
        load_blocks(str(path), ByteTokenizer(), 2)


def test_text_file_that_is_not_utf8_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café ".encode("latin-1") * 40)
    with pytest.raises(HpcgpuError, match=str(path)):
        load_blocks(str(path), ByteTokenizer(), 8)


def test_text_shorter_than_one_sequence_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("only thirty bytes of text here")
    with pytest.raises(HpcgpuError, match=rf"{path}: 30 tokens is less than one sequence of seq_len=64"):
        load_blocks(str(path), ByteTokenizer(), 64)


def test_missing_data_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(HpcgpuError, match="data file not found"):
        load_blocks(str(tmp_path / "nope.txt"), ByteTokenizer(), 8)
