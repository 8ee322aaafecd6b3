"""The one resolve step on the host (hpcgpu/launch/resolve.py): validate, sbatch, submit --executor local
and queue resolve a spec alike, and a host check's error names its key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcgpu.cli import main
from hpcgpu.cli.queue import read_entries
from hpcgpu.errors import SpecError
from hpcgpu.launch.checks import check_host
from hpcgpu.spec import dump_spec, load_spec

# a Llama-3-8B-shaped config: 15 GiB of bfloat16 weights, two GPUs of 12 GiB per copy
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


def infer_spec(tmp_path: Path) -> Path:
    (tmp_path / "p.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    (model / "tokenizer.json").write_text("{}")
    doc = {"name": "big", "task": "infer", "model": {"name_or_path": str(model)},
           "resources": {"gpus": 4, "cpus_per_gpu": 3},
           "infer": {"input": "p.jsonl", "max_memory": "12GiB", "gpus_per_replica": "auto"},
           "runs_dir": str(tmp_path / "runs")}
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(doc))
    return path


def cli(capsys: pytest.CaptureFixture, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr().out
    assert not exc.value.code, out
    return out


def test_validate_sbatch_submit_and_queue_resolve_the_same_spec(tmp_path: Path, capsys: pytest.CaptureFixture
                                                                ) -> None:
    spec = infer_spec(tmp_path)
    sets = ("--set", "infer.max_new_tokens=7")
    validated = cli(capsys, "validate", str(spec), *sets, "--full").split("---\n", 1)[1]
    cli(capsys, "sbatch", str(spec), *sets)
    [run_dir] = (tmp_path / "runs" / "big").iterdir()
    local = cli(capsys, "submit", str(spec), *sets, "--executor", "local", "--dry-run").split("\n# would run")[0]
    (tmp_path / "jobs.queue").write_text(f"spec.yaml {' '.join(sets)}\n")
    [entry] = read_entries(tmp_path / "jobs.queue")
    assert entry.spec is not None
    queued = dump_spec(entry.spec)
    assert "gpus_per_replica: 2" in validated  # auto decided once, on the host
    assert validated == (run_dir / "spec.yaml").read_text() == local + "\n" == queued


def test_a_host_check_error_names_its_key(tmp_path: Path) -> None:
    spec = infer_spec(tmp_path)
    (tmp_path / "llama" / "tokenizer.json").unlink()
    with pytest.raises(SpecError) as err:
        check_host(load_spec(spec))
    assert err.value.path == "model.name_or_path" and str(err.value).startswith("model.name_or_path: ")
    (tmp_path / "p.jsonl").unlink()
    with pytest.raises(SpecError) as err:
        check_host(load_spec(spec))
    assert err.value.path == "infer.input" and str(err.value).startswith("infer.input: file not found: ")
