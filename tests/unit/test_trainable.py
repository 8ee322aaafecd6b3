"""Training data with no trainable token (issue #45, point 2): chat rows without an assistant message
with content, prompt_completion rows with an empty completion. No such row at all: `hpcgpu validate`
refuses in one line naming the first row's file:line, exit 2, and the job refuses in that same line
data the host did not read; some such rows: a note with the count, and the job's log line counts them
(with the rows whose trained tokens the seq_len cut removes). The rule is hpcgpu/data/trainable.py's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import only_run_dir, submit_all, write_spec_file
# model_dir: the fixture, made once per module
from test_data_formats import hpcgpu_validate as validate, model_dir, write_rows  # noqa: F401

USER_ONLY = {"messages": [{"role": "user", "content": "hello there"}]}
EMPTY_REPLY = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}]}
LONG_PROMPT = " ".join(f"word{i}" for i in range(40))


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                         {"role": "assistant", "content": f"{i + 1}"}]}


def spec_file(folder: Path, model_dir: Path, data: Path, data_format: str = "chat", seq_len: int = 64) -> Path:
    return write_spec_file(folder, {
        "name": "untrained", "task": "train",
        "resources": {"gpus": 1, "cpus_per_gpu": 1, "mem_per_gpu": "2G"},
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": str(data), "format": data_format, "seq_len": seq_len},
        "train": {"global_batch_size": 2, "micro_batch_size": 2, "max_steps": 2, "log_every": 1},
        "checkpoint": {"every_steps": 1000, "keep": 1}})


def test_validate_refuses_data_where_no_row_trains_in_one_line_naming_the_first_row(tmp_path: Path,
                                                                                  model_dir: Path) -> None:
    none = write_rows(tmp_path / "none.jsonl", ["", USER_ONLY, EMPTY_REPLY, USER_ONLY])
    spec = spec_file(tmp_path, model_dir, none)
    proc = validate(spec)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"hpcgpu: error: data.train: {none}:2: no row has a trainable token (none has an assistant message with "
        "content), so every step's loss would be 0; add the assistant's replies (only assistant messages count "
        "in the loss)"]
    empty = write_rows(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": ""}] * 3)
    proc = validate(spec, f"data.eval={empty}", "data.format=prompt_completion",
                    f"data.train={write_rows(tmp_path / 'ok.jsonl', [{'prompt': 'a', 'completion': 'b'}])}")
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"hpcgpu: error: data.eval: {empty}:1: no row has a trainable token (every completion is empty)"), proc.stderr


def test_validate_notes_how_many_rows_train_nothing_and_where_the_first_is(tmp_path: Path, model_dir: Path) -> None:
    some = write_rows(tmp_path / "some.jsonl", [chat(0), chat(1), USER_ONLY, chat(3), EMPTY_REPLY, chat(5)])
    proc = validate(spec_file(tmp_path, model_dir, some))
    assert proc.returncode == 0, proc.stderr
    assert (f"hpcgpu: note: data.train: 2 of 6 rows have no trainable token (no assistant message with content), "
            f"the first at {some}:3; they add nothing to the loss") in proc.stderr.splitlines(), proc.stderr


def test_the_host_reads_a_large_file_only_so_far_and_the_job_refuses_the_rest_in_the_same_line(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host counts rows up to COUNT_BYTES and looks for a trained row up to SEARCH_BYTES: past them it
    notes what it read; the job (preparing every row) refuses what the host would have refused."""
    from transformers import AutoTokenizer

    from hpcgpu.data import prepare, trainable
    from hpcgpu.errors import HpcgpuError
    from hpcgpu.launch.checks import check_host
    from hpcgpu.spec import load_spec

    none = write_rows(tmp_path / "none.jsonl", [USER_ONLY] * 50)
    spec = load_spec(spec_file(tmp_path, model_dir, none))
    with pytest.raises(HpcgpuError) as host:
        check_host(spec)
    with pytest.raises(HpcgpuError) as job:
        prepare(none, AutoTokenizer.from_pretrained(model_dir), tmp_path / "prepared", data_format="chat")
    assert str(host.value) == f"data.train: {job.value}" and str(job.value).startswith(f"{none}:1: no row has")
    assert not (tmp_path / "prepared").exists()

    monkeypatch.setattr(trainable, "SEARCH_BYTES", 200)  # a file larger than the host reads: 4 rows of 60 bytes
    notes: list[str] = []
    check_host(spec, warn=notes.append)
    assert notes == [f"note: data.train: 4 of 4 rows in its first 1 MiB (the job counts them all) have no trainable "
                     f"token (no assistant message with content), the first at {none}:1; they add nothing to the loss"]
    monkeypatch.setattr(trainable, "COUNT_BYTES", 100)  # the count stops once a trained row was seen too
    monkeypatch.setattr(trainable, "SEARCH_BYTES", 1 << 20)
    notes.clear()
    big = write_rows(tmp_path / "big.jsonl", [USER_ONLY] * 5 + [chat(i) for i in range(50)])
    check_host(load_spec(spec_file(tmp_path, model_dir, big)), warn=notes.append)
    assert len(notes) == 1 and "5 of 6 rows in its first 1 MiB (the job counts them all)" in notes[0], notes


def test_a_cpu_train_run_counts_untrained_rows_and_refuses_data_the_seq_len_cut_leaves_nothing(
        tmp_path: Path, model_dir: Path) -> None:
    """Two local-executor runs: rows without an assistant reply (and one whose reply lies past seq_len) are
    counted in the data's log line; data whose every reply lies past seq_len, which the host cannot tell
    without the tokenizer, is refused by the job in one line, exit 2."""
    cut_row = {"messages": [{"role": "user", "content": LONG_PROMPT}, {"role": "assistant", "content": "ok"}]}
    some = write_rows(tmp_path / "some.jsonl", [chat(0), USER_ONLY, cut_row] + [chat(i) for i in range(1, 12)])
    cut = write_rows(tmp_path / "cut.jsonl", [cut_row] * 6)
    folders = {key: tmp_path / key for key in ("some", "cut")}
    specs = {"some": spec_file(folders["some"], model_dir, some, seq_len=32),
             "cut": spec_file(folders["cut"], model_dir, cut, seq_len=32)}
    assert validate(specs["cut"]).returncode == 0  # the host passes it: each row has a reply
    done = submit_all({key: (path, ()) for key, path in specs.items()}, timeout=240)
    assert done["some"].returncode == 0, done["some"].stderr[-3000:]
    log = (only_run_dir(folders["some"] / "runs", "untrained") / "logs" / "rank-0.log").read_text()
    line = next(line for line in log.splitlines() if "chat examples in" in line)
    assert line.endswith(f"1 longer than seq_len cut to it; 1 of 14 rows have no trainable token (no assistant "
                         f"message with content), the first at {some}:2; they add nothing to the loss; 1 lose "
                         "every trainable token to the seq_len=32 cut"), line
    assert done["cut"].returncode == 2, done["cut"].stderr[-3000:]
    assert (f"{cut}: no example has a trainable token in its first seq_len=32 tokens, so every step's loss would be "
            "0") in done["cut"].stdout + done["cut"].stderr
