"""What the job would fail on is found by `hpcgpu validate` (and so by submit, before the queue wait),
with the job's own reader and message: in a data.train text .jsonl (the whole file) a line that is no
JSON (with its column), bad UTF-8, a row without the text field; an infer prompt longer than the
model's positions, counted by the byte-level tokenizer or a model folder's tokenizer.json."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import job_env, write_spec_file
from hpcgpu.data.sources import jsonl_text
from hpcgpu.errors import HpcgpuError

GOOD = b'{"text": "a fine document"}\n'


@pytest.mark.parametrize("bad, says", [
    (b'{"text": "cut short\n', 'not a JSON object (Invalid control character at column 20)'),
    (b'{"text": "x" "y"}\n', "not a JSON object (Expecting ',' delimiter at column 14)"),
    (b'{"text": "caf\xe9"}\n', "not UTF-8 text"),
    (b'{"body": "no text field"}\n', 'expected a JSON object with a "text" field'),
])
def test_validate_names_the_bad_line_as_the_job_would(tmp_path: Path, bad: bytes, says: str) -> None:
    data = tmp_path / "train.jsonl"
    data.write_bytes(GOOD * 5000 + bad + GOOD)  # the defect deep in the file, past the first rows
    spec = write_spec_file(tmp_path, {"name": "t", "task": "train", "data": {"train": str(data)},
                                      "model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_head": 2,
                                                           "n_embd": 16, "vocab_size": 256}}})
    out = subprocess.run([sys.executable, "-m", "hpcgpu", "validate", str(spec)], capture_output=True, text=True,
                         timeout=60, env=job_env(), cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1 and f"{data}:5001: {says}" in line, line
    with pytest.raises(HpcgpuError) as job:  # the job's reader of the same line
        jsonl_text(bad, "text", data, 5001)
    assert str(job.value) in line


def validate(tmp_path: Path, spec: dict) -> subprocess.CompletedProcess:
    path = write_spec_file(tmp_path, spec)
    return subprocess.run([sys.executable, "-m", "hpcgpu", "validate", str(path)], capture_output=True, text=True,
                          timeout=60, env=job_env(), cwd=tmp_path)


def bpe_model_dir(folder: Path) -> Path:
    """A model folder as save_pretrained leaves it: config.json and a BPE tokenizer.json (BOS added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["alpha beta gamma delta " * 20], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out = folder / "model"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text('{"model_type": "gpt2", "n_positions": 40, "vocab_size": 300}')
    return out


@pytest.mark.parametrize("tokenizer", ["bytes", "tokenizer.json"])
def test_validate_refuses_a_prompt_longer_than_the_models_positions(tmp_path: Path, tokenizer: str) -> None:
    from hpcgpu.infer_inputs import read_rows, rows_fit_problem

    rows = tmp_path / "prompts.jsonl"
    long = "alpha beta gamma delta " * 4  # 92 bytes; fewer BPE tokens
    rows.write_text('{"id": "a", "prompt": "hi"}\n' + f'{{"id": "b", "prompt": "{long}"}}\n')
    model = ({"config": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 100,
                         "vocab_size": 256}} if tokenizer == "bytes" else {"name_or_path": str(bpe_model_dir(tmp_path))})
    spec = {"name": "i", "task": "infer", "model": model, "infer": {"input": str(rows), "max_new_tokens": 30}}
    out = validate(tmp_path, spec)
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stderr.strip()
    assert f"{rows}:2: row \"b\" does not fit the model's" in line and "+ infer.max_new_tokens 30" in line, line
    if tokenizer == "bytes":
        count, limit = 92, 100
    else:  # as the job counts: transformers' tokenizer over the same tokenizer.json
        from transformers import PreTrainedTokenizerFast

        job_tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "model" / "tokenizer.json"))
        count, limit = len(job_tok([long], add_special_tokens=True)["input_ids"][0]), 40
    job = rows_fit_problem(read_rows(str(rows), "generate"), [2, count], limit, "generate", 30, str(rows))
    assert job is not None and job in line  # the job's own line
    spec["infer"]["max_new_tokens"] = 8  # now it fits
    assert validate(tmp_path, spec).returncode == 0
