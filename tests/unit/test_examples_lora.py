"""The LoRA example (issue #45, point 9): configs/tiny-lora-chat.yaml fine-tunes the model/ of a
configs/tiny-chat.yaml run, chained with --after, on the reverse-a-word chats examples/reverse_chat.py
writes. Here both shipped specs run as docs/fine-tuning.md says, with fewer steps (the minute-long run
with its losses and sample output is in the docs, not in the suite)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from conftest import CONFIGS, REPO, job_env, only_run_dir, step_losses, write_spec_file
from test_data_formats import model_dir  # noqa: F401  (the fixture: scripts/make_tiny_model.py's model)


def test_the_shipped_reverse_chat_data_is_what_its_generator_writes() -> None:
    from examples import reverse_chat

    assert (CONFIGS / "data" / "reverse-chat.jsonl").read_text() == reverse_chat.jsonl(reverse_chat.rows())
    assert (CONFIGS / "data" / "reverse-prompts.jsonl").read_text() == reverse_chat.jsonl(reverse_chat.prompts())
    answers = {row["messages"][0]["content"]: row["messages"][1]["content"] for row in reverse_chat.rows()}
    assert answers["Reverse candle."] == "eldnac" and len(answers) == 48


def shipped(name: str, folder: Path, **changes: dict) -> Path:
    """configs/NAME.yaml with its data paths absolute, runs under `folder`, and `changes` merged in."""
    doc = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    doc["data"]["train"] = str(CONFIGS / doc["data"]["train"])
    for key, value in changes.items():
        doc[key] = {**doc.get(key, {}), **value}
    return write_spec_file(folder, doc)


def test_the_lora_example_fine_tunes_the_model_a_tiny_chat_run_trained(tmp_path: Path, model_dir: Path) -> None:
    env = job_env(HPCGPU_REGISTRY=str(tmp_path / "jobs.db"))
    base = shipped("tiny-chat", tmp_path, model={"name_or_path": str(model_dir)}, resources={"gpus": 1},
                   train={"max_steps": 30})
    lora = shipped("tiny-lora-chat", tmp_path, resources={"gpus": 1}, train={"max_steps": 12, "log_every": 1})

    def submit(spec: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", *args],
                              capture_output=True, text=True, timeout=240, env=env, cwd=REPO)

    first = submit(base)
    assert first.returncode == 0 and "job local-1 completed" in first.stderr, first.stderr[-3000:]
    second = submit(lora, "--after", "local-1")
    assert second.returncode == 0, second.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs", "tiny-lora-chat")
    spec = yaml.safe_load((run_dir / "spec.yaml").read_text())
    assert spec["model"]["name_or_path"] == str(only_run_dir(tmp_path / "runs", "tiny-chat") / "model")
    curve = step_losses(run_dir)
    assert curve[12] < curve[1] - 0.2, curve
    assert (run_dir / "model" / "adapter_config.json").is_file() and (run_dir / "merged" / "config.json").is_file()
