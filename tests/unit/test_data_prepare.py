"""Prepared datasets (hpcgpu/data, `hpcgpu data prepare`): the token stream equals what training
tokenized in memory, the dtype fits the vocabulary, a crash leaves nothing complete-looking, the cache
rebuilds what is stale and builds each entry once, bad inputs are one HpcgpuError line, and a run on
a prepared folder trains exactly as on the raw file."""
from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import EVAL_TEXT, REPO, only_run_dir, submit_all, train_records, train_spec, wait_for, write_spec_file
from hpcgpu.cli import main
from hpcgpu.data import PreparedData, cache_entry, is_prepared, open_training_data, prepare, prepared_for
from hpcgpu.data import format as fmt
from hpcgpu.data import pipeline, sources
from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime.data import ByteTokenizer, load_blocks, load_tokenizer, read_texts, tokenize

DOCS = [f"document {i}: héllo wörld — {'more text ' * (i % 7)}\nnew line {i}" for i in range(200)]


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer with an eos token, trained in memory as scripts/make_tiny_model.py does."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path_factory.mktemp("bpe")
    module.train_tokenizer(EVAL_TEXT, 300).save_pretrained(folder)
    return folder


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def logged(caplog: pytest.LogCaptureFixture, word: str) -> int:
    return sum(1 for r in caplog.records if r.name == "hpcgpu" and r.getMessage().startswith(word))


class BigVocab:
    """A stand-in tokenizer with 70,000 ids: too many for uint16."""

    eos_token_id = 69_999
    name_or_path = None

    def __len__(self) -> int:
        return 70_000

    def encode(self, text: str) -> list[int]:
        return [65_000 + len(word) for word in text.split()]

    def get_vocab(self) -> dict[str, int]:
        return {"w": 0}


# ---------------------------------------------------------------- the token stream

@pytest.mark.parametrize("kind", ["txt", "jsonl"])
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_prepared_tokens_equal_the_in_memory_stream(tmp_path: Path, bpe_dir: Path, kind: str,
                                                    tokenizer: str) -> None:
    source = tmp_path / "in.txt"
    if kind == "txt":
        source.write_text("\n\n".join(DOCS), encoding="utf-8")
    else:
        source = write_jsonl(tmp_path / "in.jsonl", DOCS)
    tok = ByteTokenizer() if tokenizer == "bytes" else load_tokenizer(str(bpe_dir))
    done = prepare(source, tok, tmp_path / "out")
    data = PreparedData(done.path)
    expected = tokenize(read_texts(str(source)), tok)  # training's stream before prepared data
    assert np.array_equal(np.asarray(data.tokens, dtype=np.int64), expected)
    assert data.tokens.dtype == np.dtype("<u2") and isinstance(data.tokens, np.memmap)
    docs = data.documents()
    assert len(docs) == data.num_documents + 1 == (1 if kind == "txt" else len(DOCS)) + 1
    assert docs[0] == 0 and docs[-1] == data.num_tokens and np.all(np.diff(docs) > 0)
    m = data.manifest
    assert m["max_token_id"] == int(expected.max())
    assert m["sources"][0]["sha256"] == sources.file_sha256(source) and m["sources"][0]["path"] == str(source)
    if tokenizer == "bytes":
        assert m["tokenizer"]["sha256"] == "bytes" and m["eos_id"] is None
    else:
        assert m["tokenizer"]["path"] == str(bpe_dir) and m["tokenizer"]["vocab_size"] == 300
        assert m["eos_id"] == tok.eos_token_id
        if kind == "jsonl":  # eos after every document, the last one too
            assert (np.asarray(data.tokens)[docs[1:] - 1] == tok.eos_token_id).all()


def test_worker_processes_write_chunks_in_input_order(tmp_path: Path, bpe_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "CHUNK_DOCS", 7)  # many small chunks over 2 workers
    monkeypatch.setattr(pipeline, "CHUNK_CHARS", 100)
    source = write_jsonl(tmp_path / "in.jsonl", DOCS)
    tok = load_tokenizer(str(bpe_dir))
    done = prepare(source, tok, tmp_path / "out", workers=2)
    assert np.array_equal(PreparedData(done.path).tokens, tokenize(read_texts(str(source)), tok))


def test_progress_off_a_terminal_is_a_log_line_with_tokens_per_s_and_eta(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hpcgpu")
    monkeypatch.setattr(pipeline, "LOG_EVERY_S", 0.0)
    monkeypatch.setattr(sources, "CHUNK_DOCS", 50)
    prepare(write_jsonl(tmp_path / "in.jsonl", DOCS), None, tmp_path / "out")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizing in.jsonl: ")]
    assert len(lines) == 4 and all("tokens/s, ETA " in line for line in lines), lines
    assert lines[-1].startswith("tokenizing in.jsonl: 100%, ")


def test_dtype_is_uint16_when_the_vocabulary_fits_else_uint32(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ["a bb ccc", "dddd"])
    data = PreparedData(prepare(source, BigVocab(), tmp_path / "big").path)
    assert data.manifest["dtype"] == "uint32" and data.tokens.dtype.itemsize == 4
    assert data.tokens.tolist() == [65_001, 65_002, 65_003, 69_999, 65_004, 69_999]
    assert (tmp_path / "big" / fmt.TOKENS).stat().st_size == 6 * 4
    assert PreparedData(prepare(source, None, tmp_path / "bytes").path).manifest["dtype"] == "uint16"
    with pytest.raises(HpcgpuError, match="vocabulary of 70000 ids does not fit uint16"):
        prepare(source, BigVocab(), tmp_path / "forced", dtype="uint16")
    assert not (tmp_path / "forced").exists()


# ---------------------------------------------------------------- crashes and the cache

def test_interrupted_prepare_leaves_nothing_complete_and_a_rerun_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "CHUNK_DOCS", 10)
    source = write_jsonl(tmp_path / "in.jsonl", DOCS)
    real_write = fmt.TokenWriter.write_chunk
    calls = []

    def crash_on_third(self: Any, ids: Any, lengths: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk gone")
        real_write(self, ids, lengths)

    monkeypatch.setattr(fmt.TokenWriter, "write_chunk", crash_on_third)
    entry = cache_entry(source, None, cache_dir=tmp_path / "cache")
    with pytest.raises(RuntimeError, match="disk gone"):
        prepared_for(source, None, cache_dir=tmp_path / "cache")
    calls.clear()
    with pytest.raises(RuntimeError, match="disk gone"):
        prepare(source, None, tmp_path / "out")
    for dest in (entry, tmp_path / "out"):
        assert not dest.exists() and not fmt.partial_dir(dest).exists()
    monkeypatch.setattr(fmt.TokenWriter, "write_chunk", real_write)
    # a writer killed outright leaves its partial folder (no manifest): never taken for a dataset
    partial = fmt.partial_dir(entry)
    partial.mkdir()
    (partial / fmt.TOKENS).write_bytes(b"\0" * 64)
    assert not is_prepared(partial)
    with pytest.raises(HpcgpuError, match="not a complete prepared dataset"):
        load_blocks(str(partial), ByteTokenizer(), 8)
    assert prepared_for(source, None, cache_dir=tmp_path / "cache") == entry
    assert not partial.exists()
    expected = tokenize(read_texts(str(source)), ByteTokenizer())
    assert np.array_equal(PreparedData(entry).tokens, expected)


def test_cache_reuses_an_entry_and_rebuilds_a_changed_source(tmp_path: Path, bpe_dir: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hpcgpu")
    source = write_jsonl(tmp_path / "in.jsonl", DOCS[:20])
    cache = tmp_path / "cache"
    first = prepared_for(source, None, cache_dir=cache)
    assert prepared_for(source, None, cache_dir=cache) == first
    assert logged(caplog, "preparing") == 1 and logged(caplog, "reusing") == 1
    write_jsonl(source, DOCS[20:40])  # the source changes: another entry, built afresh
    second = prepared_for(source, None, cache_dir=cache)
    assert second != first and logged(caplog, "preparing") == 2
    assert np.array_equal(PreparedData(second).tokens, tokenize(DOCS[20:40], ByteTokenizer()))
    other_tokenizer = prepared_for(source, str(bpe_dir), cache_dir=cache)  # another tokenizer: another entry
    assert other_tokenizer not in (first, second) and logged(caplog, "preparing") == 3
    assert PreparedData(other_tokenizer).manifest["tokenizer"]["class"] != "ByteTokenizer"


def test_cache_dir_defaults_to_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", DOCS[:5])
    monkeypatch.setenv("HPCGPU_DATA_CACHE", str(tmp_path / "env-cache"))
    assert prepared_for(source, None).parent == tmp_path / "env-cache"
    monkeypatch.delenv("HPCGPU_DATA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert prepared_for(source, None).parent == tmp_path / "xdg" / "hpcgpu" / "data"


RACER = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from hpcgpu.data import prepared_for
print("DIR", prepared_for(sys.argv[1], None, cache_dir=sys.argv[2]), flush=True)
"""


def test_two_processes_on_one_entry_build_it_once(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", DOCS)
    cache = tmp_path / "cache"
    entry = cache_entry(source, None, cache_dir=cache)
    cache.mkdir()
    outs = [tmp_path / f"racer{i}.out" for i in range(2)]
    with open(fmt.lock_path(entry), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # both racers start while the entry is locked: they must wait
        procs = [subprocess.Popen([sys.executable, "-c", RACER, str(source), str(cache)], stdout=open(out, "w"),
                                  stderr=subprocess.STDOUT) for out in outs]
        deadline = time.monotonic() + 60
        while not all("waiting for another process" in out.read_text() for out in outs):
            assert time.monotonic() < deadline, [out.read_text() for out in outs]
            time.sleep(0.05)
        fcntl.flock(held, fcntl.LOCK_UN)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    texts = [out.read_text() for out in outs]
    assert sum(t.count("preparing ") for t in texts) == 1, texts
    assert sum(t.count("reusing prepared data") for t in texts) == 1, texts
    assert all(f"DIR {entry}\n" in t for t in texts)
    assert is_prepared(entry)


# ---------------------------------------------------------------- parquet and arrow

def test_parquet_file_and_folder_through_datasets(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"body": DOCS[:50], "n": list(range(50))}), folder / "part-0.parquet")
    pq.write_table(pa.table({"body": DOCS[50:], "n": list(range(150))}), folder / "part-1.parquet")
    one = PreparedData(prepare(folder / "part-0.parquet", None, tmp_path / "one", text_field="body").path)
    assert np.array_equal(one.tokens, tokenize(DOCS[:50], ByteTokenizer()))
    both = PreparedData(prepare(folder, None, tmp_path / "both", text_field="body").path)
    assert np.array_equal(both.tokens, tokenize(DOCS, ByteTokenizer()))
    assert [s["path"] for s in both.manifest["sources"]] == [str(folder / "part-0.parquet"),
                                                             str(folder / "part-1.parquet")]
    with pytest.raises(HpcgpuError, match=r'part-0.parquet: no column "text" \(columns: body, n\)'):
        prepare(folder / "part-0.parquet", None, tmp_path / "nocol")


@pytest.mark.parametrize("name", ["bad.parquet", "bad.arrow"])
def test_a_file_that_is_not_parquet_or_arrow_is_one_line(tmp_path: Path, name: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / name
    bad.write_text("not parquet\n")
    assert run_cli("data", "prepare", "--input", str(bad), "--output", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert f"hpcgpu: error: {bad}: cannot be read as {bad.suffix[1:]}" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(HpcgpuError, match=f"{bad}: cannot be read as"):  # the job's way in: data.train
        open_training_data(str(bad), ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    assert [f.name for f in (tmp_path / "cache").iterdir() if not f.name.endswith(".lock")] == []


# ---------------------------------------------------------------- bad input

def test_bad_inputs_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HpcgpuError, match="data file not found"):
        prepare(tmp_path / "missing.jsonl", None, tmp_path / "o")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "fine"}\n{"text": "no body"}\n')
    with pytest.raises(HpcgpuError, match=rf'{bad}:2: expected a JSON object with a "body" field'):
        prepare(bad, None, tmp_path / "o", text_field="body")
    with pytest.raises(HpcgpuError, match="tokenizer folder not found"):
        prepare(bad, str(tmp_path / "no-tokenizer"), tmp_path / "o")
    broken = tmp_path / "broken-tok"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(HpcgpuError, match=f"tokenizer {broken} does not load"):
        prepare(bad, str(broken), tmp_path / "o")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(HpcgpuError, match="exists and is not a prepared dataset"):
        prepare(bad, None, tmp_path / "taken", text_field="body")
    assert not (tmp_path / "o").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(HpcgpuError, match=f"{empty}: no text in it"):
        prepare(empty, None, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_an_output_holding_a_prepared_dataset_is_replaced_whole(tmp_path: Path) -> None:
    out = tmp_path / "prep" / "x"
    prepare(write_jsonl(tmp_path / "a.jsonl", DOCS), None, out)
    first = PreparedData(out).num_tokens
    prepare(write_jsonl(tmp_path / "b.jsonl", DOCS[:2]), None, out)
    assert PreparedData(out).num_tokens < first
    assert sorted(p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")) == ["x"]  # no old copy


def test_prepared_folder_made_with_another_tokenizer_is_refused(tmp_path: Path, bpe_dir: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", DOCS)
    bpe = load_tokenizer(str(bpe_dir))
    out = prepare(source, bpe, tmp_path / "out").path
    blocks = load_blocks(str(out), load_tokenizer(str(bpe_dir)), 16)
    expected = tokenize(DOCS, bpe)
    assert len(blocks) == len(expected) // 16 and blocks.max_token_id == int(expected.max())
    picked = blocks.take([3, 0, 3])
    assert picked.dtype == torch.int64 and picked.tolist() == [
        expected[48:64].tolist(), expected[0:16].tolist(), expected[48:64].tolist()]
    with pytest.raises(HpcgpuError, match="was prepared with .* but the model's tokenizer is the byte-level"):
        load_blocks(str(out), ByteTokenizer(), 16)


# ---------------------------------------------------------------- the command

def run_cli(*args: str) -> int:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return int(exc.value.code or 0)


def test_cli_prepares_an_input_file_and_exits_2_on_a_bad_line(tmp_path: Path, bpe_dir: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", DOCS, field="content")
    out = tmp_path / "prepared"
    assert run_cli("data", "prepare", "--input", str(source), "--tokenizer", str(bpe_dir), "--output", str(out),
                   "--text-field", "content", "--workers", "1") == 0
    printed = capsys.readouterr().out
    data = PreparedData(out)
    assert f"prepared: {out}" in printed
    assert f"{data.num_tokens:,} tokens, {len(DOCS)} documents, uint16" in printed and "tokens/s" in printed
    assert np.array_equal(data.tokens, tokenize(DOCS, load_tokenizer(str(bpe_dir))))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    assert run_cli("data", "prepare", "--input", str(bad), "--output", str(tmp_path / "x")) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("hpcgpu: error:")]
    assert errors == [f"hpcgpu: error: {bad}:2: not a JSON object (Expecting value at column 1); a .jsonl holds one object a "
                      "line"]
    assert "Traceback" not in err
    for row, hint in [({"body": "x"}, "set data.text_field (--text-field) to the field that holds the text"),
                      ({"prompt": "a", "completion": "b"}, "set data.format: prompt_completion (--format "
                                                          "prompt_completion)"),
                      ({"messages": []}, "set data.format: chat (--format chat)")]:
        bad.write_text(json.dumps(row) + "\n")
        assert run_cli("data", "prepare", "--input", str(bad), "--output", str(tmp_path / "x")) == 2
        err = capsys.readouterr().err
        assert f'{bad}:1: expected a JSON object with a "text" field (a string); ' in err and hint in err, err


def test_cli_prepares_a_specs_train_and_eval(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_jsonl(tmp_path / "train.jsonl", DOCS)
    (tmp_path / "eval.txt").write_text(DOCS[0])
    spec = tmp_path / "exp.yaml"
    spec.write_text("name: exp\ntask: train\nmodel: {config: {model_type: gpt2}}\n"
                    "data: {train: train.jsonl, eval: eval.txt, seq_len: 16}\n")
    cache = tmp_path / "cache"
    assert run_cli("data", "prepare", str(spec), "--set", f"data.cache_dir={cache}") == 0
    first = capsys.readouterr().out
    entries = sorted(p for p in cache.iterdir() if not p.name.startswith("."))
    assert len(entries) == 2 and all(f": {p}" in first for p in entries)
    assert run_cli("data", "prepare", str(spec), "--set", f"data.cache_dir={cache}") == 0
    assert first.count("tokens/s") == 2 and capsys.readouterr().out.count("reused from the cache") == 2
    assert run_cli("data", "prepare", str(spec), "--output", str(tmp_path / "out")) == 0
    assert is_prepared(tmp_path / "out" / "train") and is_prepared(tmp_path / "out" / "eval")
    # the job on the prepared folders reads the same tokens the cache holds
    train = load_blocks(str(tmp_path / "out" / "train"), ByteTokenizer(), 16)
    raw = load_blocks(str(tmp_path / "train.jsonl"), ByteTokenizer(), 16, cache_dir=str(cache))
    assert train.tensor().equal(raw.tensor())


def test_the_prepare_job_goes_through_the_resolve_steps_host_checks(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--submit makes its job's spec through launch/resolve.py: what the host checks refuse (here an
    env_passthrough variable this shell lacks) is refused as `hpcgpu submit` refuses it, one line, exit 2,
    before anything reaches SLURM or the registry."""
    monkeypatch.delenv("HPCGPU_TEST_NEVER_SET", raising=False)
    monkeypatch.setenv("HPCGPU_REGISTRY", str(tmp_path / "jobs.db"))
    write_jsonl(tmp_path / "train.jsonl", DOCS)
    spec = tmp_path / "exp.yaml"
    spec.write_text(f"name: exp\ntask: train\nmodel: {{config: {{model_type: gpt2}}}}\nruns_dir: {tmp_path / 'runs'}\n"
                    f"data: {{train: {tmp_path / 'train.jsonl'}, seq_len: 16}}\nenv_passthrough: [HPCGPU_TEST_NEVER_SET]\n")
    assert run_cli("data", "prepare", str(spec), "--submit") == 2
    refused = capsys.readouterr().err
    assert run_cli("submit", str(spec)) == 2
    assert refused == capsys.readouterr().err and refused.count("\n") == 1
    assert refused.startswith("hpcgpu: error: env_passthrough: HPCGPU_TEST_NEVER_SET is not set")
    assert not (tmp_path / "jobs.db").exists() and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- training on it

def test_one_rank_run_on_a_prepared_folder_follows_the_raw_files_loss_curve(tmp_path: Path) -> None:
    prepared = prepare(EVAL_TEXT, None, tmp_path / "prepared").path
    runs = {key: train_spec(key, resources={"gpus": 1}, train={"max_steps": 3},
                            data={"train": str(data), "seq_len": 64})
            for key, data in (("raw", EVAL_TEXT), ("prepared", prepared))}
    paths = {key: (write_spec_file(tmp_path / key, spec), ()) for key, spec in runs.items()}
    results = submit_all(paths, timeout=240)
    curves = {}
    for key, proc in results.items():
        assert proc.returncode == 0, f"{key}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        curves[key] = [r["loss"] for r in train_records(only_run_dir(tmp_path / key / "runs", key))]
    assert len(curves["raw"]) == 3 and curves["prepared"] == curves["raw"]



def test_two_prepares_of_one_output_build_it_once_and_say_they_wait(tmp_path: Path) -> None:
    """`data prepare` twice at once into one folder: the second says it waits, then keeps what the
    first made from the same source and tokenizer instead of tokenizing it all again."""
    source = write_jsonl(tmp_path / "in.jsonl", DOCS)
    out = tmp_path / "out"
    logs = [tmp_path / f"prep{i}.log" for i in range(2)]
    cmd = [sys.executable, "-m", "hpcgpu", "data", "prepare", "--input", str(source), "--output", str(out)]
    with open(fmt.lock_path(out), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # both start while the folder is being written: they must wait
        procs = [subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT) for log in logs]
        deadline = time.monotonic() + 60
        while not all("another `data prepare` writes" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.05)
        fcntl.flock(held, fcntl.LOCK_UN)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    texts = [log.read_text() for log in logs]
    assert sum(t.count("preparing ") for t in texts) == 1, texts
    assert sum(t.count("reusing prepared data") for t in texts) == 1, texts
    assert is_prepared(out)


def test_a_prepare_killed_outright_takes_its_workers_along_quietly(tmp_path: Path) -> None:
    """kill -9 of `data prepare --workers 2`: its tokenizer workers die with it, no BrokenPipeError
    traceback from each of them."""
    import os
    import signal

    source = write_jsonl(tmp_path / "big.jsonl", [f"{i} " + "words of text " * 40 for i in range(60000)])
    log = tmp_path / "prep.log"
    proc = subprocess.Popen([sys.executable, "-m", "hpcgpu", "data", "prepare", "--input", str(source), "--output",
                             str(tmp_path / "out"), "--workers", "2"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "preparing " not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.05)

    def both_workers() -> list[int] | None:
        found = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                text=True).stdout.split()]
        return found if len(found) >= 2 else None

    workers = wait_for(both_workers, timeout=30)
    assert workers, "no worker processes to check"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{w}") and "Z" not in open(f"/proc/{w}/stat").read().split()[2]
              for w in workers):
        assert time.monotonic() < deadline, "a worker outlived its killed prepare"
        time.sleep(0.1)
    # every worker has exited: whatever it wrote is in the log
    assert "BrokenPipeError" not in log.read_text() and "Traceback" not in log.read_text(), log.read_text()[-2000:]
