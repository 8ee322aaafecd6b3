"""data.format chat and prompt_completion: loss masks, packing, the prepared format, bad inputs and a
real fine-tune of configs/tiny-chat.yaml on 1 and 2 CPU ranks.

The tokenizer is the one scripts/make_tiny_model.py makes (byte-level BPE, eos <|endoftext|>, chat
template "ROLE: CONTENT\\n" with the generation prompt "assistant:"), made once in-process.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from conftest import CONFIGS, REPO, only_run_dir, submit_all, train_records, write_spec_file

CHAT_DATA = CONFIGS / "data" / "chat.jsonl"
EOS = "<|endoftext|>"


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path_factory.mktemp("tiny-model")
    module.make(folder)
    return folder


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def write_rows(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def blocks_of(tmp_path: Path, tok: Any, rows: list[dict], data_format: str, seq_len: int, packing: bool) -> Any:
    from hpcgpu.data import prepare
    from hpcgpu.runtime.data import load_blocks

    source = write_rows(tmp_path / f"{data_format}.jsonl", rows)
    done = prepare(source, tok, tmp_path / f"prepared-{data_format}", data_format=data_format)
    return load_blocks(str(done.path), tok, seq_len, data_format=data_format, packing=packing)


def counted(tok: Any, batch: dict, row: int = 0) -> str:
    """The text of the tokens one row of a batch counts in the loss."""
    labels = batch["labels"][row].numpy()
    return tok.decode(labels[labels != -100].tolist())


# ---------------------------------------------------------------- prompt_completion

PC_ROWS = [{"prompt": "What is 3 plus 4?", "completion": " 7."},
           {"prompt": "Say hi", "completion": " hi there"},
           {"prompt": "Spell cat.", "completion": " C-A-T"}]


def test_prompt_completion_labels_are_minus_100_exactly_on_prompt_and_padding(tmp_path: Path, tok: Any) -> None:
    blocks = blocks_of(tmp_path, tok, PC_ROWS, "prompt_completion", 32, packing=False)
    assert len(blocks) == len(PC_ROWS)
    batch = blocks.take(list(range(len(PC_ROWS))))
    for row, ex in enumerate(PC_ROWS):
        prompt, completion = tok.encode(ex["prompt"]), tok.encode(ex["completion"], add_special_tokens=False)
        real = prompt + completion + [tok.eos_token_id]
        pad = 32 - len(real)
        assert batch["input_ids"][row].tolist() == real + [tok.eos_token_id] * pad  # pad id = eos
        assert batch["labels"][row].tolist() == [-100] * len(prompt) + completion + [tok.eos_token_id] + [-100] * pad
        assert batch["attention_mask"][row].tolist() == [1] * len(real) + [0] * pad
        assert counted(tok, batch, row) == ex["completion"] + EOS


def test_packed_prompt_completion_keeps_each_example_s_labels(tmp_path: Path, tok: Any) -> None:
    blocks = blocks_of(tmp_path, tok, PC_ROWS, "prompt_completion", 64, packing=True)
    assert len(blocks) == 1  # all three fit in 64 tokens
    batch = blocks.take([0])
    assert counted(tok, batch) == "".join(ex["completion"] + EOS for ex in PC_ROWS)
    n = sum(len(tok.encode(ex["prompt"] + ex["completion"])) + 1 for ex in PC_ROWS)
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (64 - n)


# ---------------------------------------------------------------- chat

CHAT_ROWS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 4?"},
                  {"role": "assistant", "content": "7."}, {"role": "user", "content": "And 1 plus 1?"},
                  {"role": "assistant", "content": "2."}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "bye"}]},  # ends with the user: its eos does not count
    {"messages": [{"role": "user", "content": "no answer here"}]},
]


def test_chat_labels_count_only_assistant_tokens(tmp_path: Path, tok: Any) -> None:
    blocks = blocks_of(tmp_path, tok, CHAT_ROWS, "chat", 96, packing=False)
    batch = blocks.take([0, 1, 2])
    assert counted(tok, batch, 0) == " 7.\n 2.\n" + EOS
    assert counted(tok, batch, 1) == " hello\n"
    assert counted(tok, batch, 2) == ""
    for row, ex in enumerate(CHAT_ROWS):  # the ids are the template's rendering, then eos
        text = tok.apply_chat_template(ex["messages"], tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert batch["input_ids"][row, : len(ids)].tolist() == ids
        assert int(batch["attention_mask"][row].sum()) == len(ids)


# ---------------------------------------------------------------- packing and padding

def varied_rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    return [{"prompt": " ".join(rng.choice(words, int(rng.integers(1, 12)))),
             "completion": " " + " ".join(rng.choice(words, int(rng.integers(1, 8))))} for _ in range(n)]


def test_packing_never_splits_an_example_and_fills_blocks(tmp_path: Path, tok: Any,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from hpcgpu.data import PreparedData

    seq_len = 24
    with caplog.at_level(logging.INFO, logger="hpcgpu"):
        blocks = blocks_of(tmp_path, tok, varied_rows(60), "prompt_completion", seq_len, packing=True)
    data = PreparedData(blocks.path)
    docs = np.asarray(data.documents())
    lengths = np.diff(docs)
    cut = int((lengths > seq_len).sum())
    assert cut > 0, "the test wants some examples longer than seq_len"
    assert f"60 prompt_completion examples in {len(blocks)} blocks of {seq_len} tokens (packed); " \
           f"{cut} longer than seq_len cut to it" in caplog.text
    kept = np.minimum(lengths, seq_len)
    firsts = blocks.firsts
    assert firsts[0] == 0 and firsts[-1] == 60 and np.all(np.diff(firsts) >= 1)  # in order, each example once
    batch = blocks.take(list(range(len(blocks))))
    for b in range(len(blocks)):
        members = range(int(firsts[b]), int(firsts[b + 1]))
        used = int(kept[list(members)].sum())
        assert used <= seq_len
        if b + 1 < len(blocks):  # full: the next example did not fit in what was left
            assert used + kept[firsts[b + 1]] > seq_len
        want = np.concatenate([np.asarray(data.tokens[docs[e]: docs[e] + kept[e]], dtype=np.int64) for e in members])
        assert batch["input_ids"][b, :used].tolist() == want.tolist()  # whole examples, in order
        assert int(batch["attention_mask"][b].sum()) == used
        assert batch["labels"][b, used:].eq(-100).all()
        mask = np.concatenate([np.asarray(data.mask[docs[e]: docs[e] + kept[e]]) for e in members]).astype(bool)
        starts = np.cumsum([0] + [int(kept[e]) for e in members])[:-1]
        mask[starts] = False  # an example's first token is never a target (nothing of its own before it)
        assert batch["labels"][b, :used].tolist() == np.where(mask, want, -100).tolist()


def test_padding_puts_one_example_in_each_block(tmp_path: Path, tok: Any) -> None:
    rows = varied_rows(20, seed=1)
    blocks = blocks_of(tmp_path, tok, rows, "prompt_completion", 24, packing=False)
    assert len(blocks) == 20
    batch = blocks[0:20]
    for b, ex in enumerate(rows):
        n = min(len(tok.encode(ex["prompt"] + ex["completion"])) + 1, 24)
        assert int(batch["attention_mask"][b].sum()) == n
        assert batch["input_ids"][b, n:].eq(tok.eos_token_id).all()


def test_masked_loss_is_hf_loss_and_zero_without_labels() -> None:
    import torch
    from hpcgpu.runtime.data import causal_lm_loss
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    ids = torch.randint(0, 50, (2, 12))
    labels = ids.clone()
    labels[:, :5] = -100
    out = model(input_ids=ids, labels=labels)
    assert causal_lm_loss(out.logits, labels).item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert causal_lm_loss(out.logits, torch.full_like(ids, -100)).item() == 0.0


# ---------------------------------------------------------------- prepared data and the cache

def test_manifest_mask_and_cache_keys(tmp_path: Path, tok: Any) -> None:
    from hpcgpu.data import PreparedData, cache_entry, ensure_prepared, prepare
    from hpcgpu.data.cache import cache_key
    from hpcgpu.data.format import VERSION
    from hpcgpu.data.sources import fingerprint, open_source
    from hpcgpu.data.tokenizer import tokenizer_identity

    source = write_rows(tmp_path / "pc.jsonl", PC_ROWS)
    data = PreparedData(prepare(source, tok, tmp_path / "out", data_format="prompt_completion").path)
    assert data.manifest["data_format"] == "prompt_completion"
    assert (data.path / "mask.bin").stat().st_size == data.num_tokens
    text = write_rows(tmp_path / "t.jsonl", [{"text": "a b"}, {"text": "c"}])
    plain = PreparedData(prepare(text, tok, tmp_path / "text").path)
    assert plain.data_format == "text" and plain.mask is None and not (plain.path / "mask.bin").exists()
    # a text entry keeps the key it had before data.format existed; the formats get keys of their own
    identity = tokenizer_identity(tok)
    before = {"sources": fingerprint(open_source(source)), "version": VERSION, "text_field": "text",
              "tokenizer": {k: identity[k] for k in ("class", "vocab_size", "sha256")}}
    old = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert cache_key(open_source(source), identity, "text") == old
    entries = {f: cache_entry(source, tok, cache_dir=tmp_path / "c", data_format=f)
               for f in ("text", "chat", "prompt_completion")}
    assert len(set(entries.values())) == 3
    built = ensure_prepared(source, tok, cache_dir=tmp_path / "c", data_format="prompt_completion")
    again = ensure_prepared(source, tok, cache_dir=tmp_path / "c", data_format="prompt_completion")
    assert built.built and not again.built and again.path == entries["prompt_completion"]


# ---------------------------------------------------------------- bad inputs

BAD_ROWS = [
    ("chat", {"text": "no messages"}, "data.format chat needs \"messages\""),
    ("chat", {"messages": [{"content": "hi"}]}, "message 1 has no \"role\""),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, "message 2 has no \"content\""),
    ("prompt_completion", {"prompt": "no completion"}, "needs a \"completion\" field"),
    ("prompt_completion", {"completion": "no prompt"}, "needs a \"prompt\" field"),
]


@pytest.mark.parametrize("data_format,row,needle", BAD_ROWS, ids=[n for _, _, n in BAD_ROWS])
def test_a_bad_row_is_an_error_naming_file_and_line_in_the_job(tmp_path: Path, tok: Any, data_format: str,
                                                              row: dict, needle: str) -> None:
    from hpcgpu.data import prepare
    from hpcgpu.errors import HpcgpuError

    good = CHAT_ROWS[0] if data_format == "chat" else PC_ROWS[0]
    source = write_rows(tmp_path / "bad.jsonl", [good, "", row])
    with pytest.raises(HpcgpuError) as err:
        prepare(source, tok, tmp_path / "out", data_format=data_format)
    assert str(err.value).startswith(f"{source}:3: ") and needle in str(err.value)
    assert not (tmp_path / "out").exists()


def test_chat_without_a_template_and_a_prepared_folder_of_another_format_in_the_job(tmp_path: Path, tok: Any) -> None:
    from hpcgpu.data import ByteTokenizer, open_training_data, prepare
    from hpcgpu.errors import HpcgpuError

    source = write_rows(tmp_path / "chat.jsonl", CHAT_ROWS)
    with pytest.raises(HpcgpuError, match="data.format: chat needs a tokenizer with a chat template, and the "
                                          "byte-level tokenizer has none"):
        prepare(source, ByteTokenizer(), tmp_path / "out", data_format="chat")
    done = prepare(source, tok, tmp_path / "chat", data_format="chat")
    with pytest.raises(HpcgpuError, match="was prepared as data.format chat, the spec says text"):
        open_training_data(str(done.path), tok)


def hpcgpu_validate(spec_path: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "hpcgpu", "validate", str(spec_path), *args], capture_output=True,
                          text=True, timeout=60, cwd=spec_path.parent)


def host_check_error(spec_path: Path, *sets: str) -> str:
    """The line `hpcgpu validate/sbatch/submit` would print: check_host's error (in-process, no start-up)."""
    from hpcgpu.errors import HpcgpuError
    from hpcgpu.launch.checks import check_host
    from hpcgpu.spec import load_spec

    with pytest.raises(HpcgpuError) as err:
        check_host(load_spec(spec_path, sets))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_inputs_are_one_line_exit_2_before_the_job(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    """validate, sbatch and submit read the first rows of a raw input, the template and a manifest."""
    from hpcgpu.data import prepare
    from hpcgpu.launch.checks import check_host
    from hpcgpu.spec import load_spec

    spec = chat_spec(tmp_path, model_dir)
    check_host(load_spec(spec))  # the shipped example passes
    for k, (data_format, row, needle) in enumerate(BAD_ROWS):
        bad = write_rows(tmp_path / f"bad{k}.jsonl", [CHAT_ROWS[0] if data_format == "chat" else PC_ROWS[0], row])
        error = host_check_error(spec, f"data.train={bad}", f"data.format={data_format}")
        assert error.startswith(f"data.train: {bad}:2: ") and needle in error
    error = host_check_error(spec, f"data.train={CONFIGS / 'data' / 'pydocs.txt'}")
    assert error.startswith("data.train: data.format chat reads a .jsonl file") and "not pydocs.txt" in error
    error = host_check_error(spec, "model.name_or_path=null", "model.config.model_type=gpt2")
    assert "data.format: chat needs the tokenizer's chat template, and the byte-level tokenizer of model.config" \
        in error
    (tmp_path / "no-template").mkdir()
    (tmp_path / "no-template" / "tokenizer.json").write_text("{}")
    error = host_check_error(spec, f"model.name_or_path={tmp_path / 'no-template'}")
    assert "data.format: chat needs the tokenizer's chat template, and the tokenizer in " \
        f"{tmp_path / 'no-template'} has none" in error
    prepared = prepare(CHAT_DATA, tok, tmp_path / "prepared", data_format="chat").path
    error = host_check_error(spec, f"data.train={prepared}", "data.format=prompt_completion")
    assert f"data.format: {prepared} was prepared as data.format chat, the spec says prompt_completion" in error
    # and through the command line: that one line, exit 2
    proc = hpcgpu_validate(spec, f"data.train={tmp_path / 'bad3.jsonl'}", "data.format=prompt_completion")
    out = proc.stdout + proc.stderr
    want = (f"hpcgpu: error: data.train: {tmp_path / 'bad3.jsonl'}:2: data.format prompt_completion needs a \"completion\" "
            "field (a string) in every row: {\"prompt\": ..., \"completion\": ...}")
    assert proc.returncode == 2 and out.strip().splitlines() == [want], out


# ---------------------------------------------------------------- a real fine-tune: configs/tiny-chat.yaml

STEPS = 8


def chat_spec(folder: Path, model_dir: Path, **train: Any) -> Path:
    """configs/tiny-chat.yaml with absolute paths, the model made here and a few steps."""
    doc = yaml.safe_load((CONFIGS / "tiny-chat.yaml").read_text())
    doc["model"]["name_or_path"] = str(model_dir)
    doc["data"]["train"] = str(CHAT_DATA)
    doc["train"].update({"max_steps": STEPS, "log_every": 1, **train})
    doc["checkpoint"] = {"every_steps": 1000, "keep": 1}
    return write_spec_file(folder, doc)


@pytest.mark.slow
def test_tiny_chat_learns_and_one_and_two_ranks_follow_the_same_loss_curve(
        tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> None:
    folders = {key: tmp_path_factory.mktemp(f"chat-{key}") for key in ("two", "one")}
    extra = {"eval_batches": 2}
    paths = {key: chat_spec(folders[key], model_dir, **extra) for key in folders}
    evals = ("--set", f"data.eval={CHAT_DATA}")
    results = submit_all({"two": (paths["two"], evals), "one": (paths["one"], ("--gpus", "1", *evals))}, timeout=240)
    curves, final_eval = {}, {}
    for key, proc in results.items():
        assert proc.returncode == 0, f"{key}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        run = only_run_dir(folders[key] / "runs", "tiny-chat")
        curves[key] = [r["loss"] for r in train_records(run)]
        log = (run / "logs" / "rank-0.log").read_text()
        assert "400 chat examples in" in log and "(packed); 0 longer than seq_len cut to it" in log
        assert (run / "model" / "model.safetensors").exists()
        evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
        assert evals and all(np.isfinite(e["loss"]) for e in evals)
        final_eval[key] = evals[-1]["loss"]
    two, one = curves["two"], curves["one"]
    # the same eval sequences, weighted by labelled tokens, whatever the ranks and micro batch
    assert final_eval["one"] == pytest.approx(final_eval["two"], rel=5e-4), final_eval
    assert len(two) == len(one) == STEPS
    assert two[0] == pytest.approx(np.log(512), abs=0.3)  # a random model over 512 tokens
    assert two[-1] < two[0] - 0.7, f"loss {two[0]:.3f} -> {two[-1]:.3f}: not learning"
    for step, (x, y) in enumerate(zip(two, one), 1):
        assert y == pytest.approx(x, rel=1e-4), f"step {step}: 2 ranks {x} vs 1 rank {y}"


def test_data_prepare_takes_the_format_from_the_spec_and_from_format(tmp_path: Path, model_dir: Path) -> None:
    source = write_rows(tmp_path / "pc.jsonl", PC_ROWS * 4)
    spec = write_spec_file(tmp_path, {"name": "pc", "model": {"name_or_path": str(model_dir)},
                                      "data": {"train": str(source), "format": "prompt_completion", "seq_len": 32}})

    def prepare(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hpcgpu", "data", "prepare", *args],
                              capture_output=True, text=True, timeout=120)

    by_spec = prepare(str(spec), "-o", str(tmp_path / "by-spec"))
    assert by_spec.returncode == 0, by_spec.stderr
    by_flag = prepare("--input", str(source), "--tokenizer", str(model_dir), "--format", "prompt_completion",
                      "-o", str(tmp_path / "by-flag"))
    assert by_flag.returncode == 0, by_flag.stderr
    for folder in (tmp_path / "by-spec" / "train", tmp_path / "by-flag"):
        assert json.loads((folder / "manifest.json").read_text())["data_format"] == "prompt_completion"
        assert (folder / "mask.bin").read_bytes() == (tmp_path / "by-flag" / "mask.bin").read_bytes()
    both = prepare(str(spec), "--format", "chat")
    assert both.returncode == 2 and "--format goes with --input" in both.stderr
