"""A job's console holds hpcgpu's lines, not the libraries' warnings: the ones we can avoid are avoided
(the slot engine passes an attention mask), the others (peft asking transformers a deprecated name,
a user library's FutureWarning) land once each in the rank's log file."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EVAL_TEXT, REPO, job_env, only_run_dir, submit_all, train_spec, write_spec_file

pytestmark = pytest.mark.slow
NOISY_LIB = Path(__file__).resolve().parents[1] / "noisy_lib.py"  # a library that warns at every call


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """lora: a LoRA run with gradient checkpointing on a saved base, merged at the end (peft loads the
    adapter on the base again); infer: the slot engine on that base, whose pad token starts its cache;
    noisy: a callable whose library warns twice."""
    base = tmp_path_factory.mktemp("quiet")
    model = base / "model"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(model)], check=True,
                   capture_output=True, timeout=120, env=job_env())
    prompts = base / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "def f{i}():"}}\n' for i in range(6)))
    (base / "noisy_lib.py").write_text(NOISY_LIB.read_text())
    one_rank = {"gpus": 1, "cpus_per_gpu": 1}
    specs = {
        "lora": train_spec("lora", resources=one_rank, model={"config": None, "name_or_path": str(model)},
                           data={"train": str(EVAL_TEXT), "seq_len": 32},
                           train={"max_steps": 2, "global_batch_size": 2, "micro_batch_size": 2, "merge": True,
                                  "gradient_checkpointing": True, "lora": {"r": 2, "alpha": 4}}),
        "infer": {"name": "infer", "task": "infer", "resources": one_rank, "model": {"name_or_path": str(model)},
                  "infer": {"input": str(prompts), "max_new_tokens": 4, "batch_size": 4, "engine": "slots"}},
        "noisy": {"name": "noisy", "task": "callable", "entry": "noisy_lib:main", "resources": one_rank,
                  "env": {"PYTHONPATH": str(base)}},
    }
    specs["lora"]["model"].pop("config")
    folders = {key: tmp_path_factory.mktemp(key) for key in specs}
    paths = {key: (write_spec_file(folders[key], spec), ()) for key, spec in specs.items()}
    results = submit_all(paths, timeout=240)
    for key, proc in results.items():
        assert proc.returncode == 0, (key, proc.stdout[-2000:], proc.stderr[-2000:])
    return {key: (results[key], only_run_dir(folders[key] / "runs", key)) for key in specs}


def console(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("key", ["lora", "infer", "noisy"])
def test_a_jobs_console_shows_no_library_warning(jobs: dict, key: str) -> None:
    text = console(jobs[key][0])
    assert "Warning" not in text and "warnings.warn" not in text, text
    assert "attention_mask" not in text, text


def test_the_slot_engine_passes_its_attention_mask(jobs: dict) -> None:
    proc, run_dir = jobs["infer"]
    assert "attention_mask" not in (run_dir / "logs" / "rank-0.log").read_text()


def test_a_library_warning_raised_twice_is_in_the_rank_log_once(jobs: dict) -> None:
    _, run_dir = jobs["noisy"]
    log = (run_dir / "logs" / "rank-0.log").read_text()
    lines = [line for line in log.splitlines() if "noisy_call is deprecated" in line]
    assert len(lines) == 1, log
    assert "noisy_lib.py:" in lines[0] and "FutureWarning" in lines[0], lines
    assert "warnings.warn(" not in log, log  # one line a warning, without its source line
