"""One surface: click's usage errors come out as ours do (one `hpcgpu: error:` line naming the flag,
exit 2), a flag has one name across commands (the old spelling still works), and a spec key another
tool names differently gets a did-you-mean."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS, job_env
from hpcgpu.cli import main

SPEC = str(CONFIGS / "tiny-gpt2.yaml")
RECORDED = Path(__file__).parent / "fixtures" / "nvml_h100x8_shared.json"  # 8 x H100, GPUs 0, 1, 4, 7 busy


def error_of(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """The command's one stderr line, checked: exit 2, nothing else printed."""
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    out, err = capsys.readouterr()
    assert done.value.code == 2, (done.value.code, err)
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("hpcgpu: error: "), err
    return err.strip().removeprefix("hpcgpu: error: ")


@pytest.mark.parametrize("argv, line", [
    (("submit", SPEC, "--executor", "loc"), "--executor: 'loc' is not one of 'slurm', 'local'"),
    (("submit", SPEC, "--gpus", "two"), "--gpus: 'two' is not a valid integer range"),
    (("submit",), "missing SPEC (usage: hpcgpu submit [OPTIONS] SPEC)"),
    (("submit", SPEC, "--gpu", "2"), "no such option --gpu (did you mean --gpus?)"),
    (("status", "--verbose"), "no such option --verbose (see hpcgpu status --help)"),
    (("estimate", SPEC, "--gpu-memory"), "option '--gpu-memory' requires an argument"),
    (("submt", SPEC), "no such command 'submt' (see hpcgpu --help)"),
])
def test_a_usage_error_is_one_line_naming_the_flag_exit_2(capsys, argv, line) -> None:
    assert error_of(capsys, *argv) == line


def test_the_installed_command_prints_click_errors_as_ours() -> None:
    done = subprocess.run([sys.executable, "-m", "hpcgpu", "validate", SPEC, "--full", "--nodes", "0"],
                          capture_output=True, text=True, timeout=60, env=job_env())
    assert done.returncode == 2
    assert done.stderr == "hpcgpu: error: --nodes: 0 is not in the range x>=1\n"


def hw_json(*flags: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "hpcgpu", "hw", "--json", *flags], capture_output=True, text=True,
                          timeout=60, env=job_env(HPCGPU_NVML_RECORDED=str(RECORDED)))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["thresholds"]


@pytest.mark.parametrize("flags", [("--busy-memory-pct", "55", "--busy-util-pct", "45"),
                                   ("--busy-memory", "55", "--busy-util", "45")])
def test_hw_takes_the_busy_flags_by_their_name_and_their_former_one(flags) -> None:
    assert hw_json(*flags) == {"memory_pct": 55, "util_pct": 45, "processes": True}


@pytest.mark.parametrize("command", ["hw", "queue"])
def test_help_shows_the_current_names_only(capsys, command) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "--busy-memory-pct PCT" in text and "--busy-util-pct PCT" in text, text
    assert "--busy-memory " not in text and "--busy-util " not in text and "-pct, --busy" not in text, text
    assert "--gpus 0,1,4,7" not in text and ("--devices 0,1,4,7" in text), text


@pytest.mark.parametrize("flag", ["--devices", "--gpus"])
def test_queue_takes_its_gpus_as_devices_and_by_the_former_name(tmp_path, flag) -> None:
    (tmp_path / "job.yaml").write_text("name: job\ntask: command\ncommand: [/bin/true]\nresources: {gpus: 1}\n")
    queue = tmp_path / "jobs.queue"
    queue.write_text("job.yaml\n")
    env = job_env(HPCGPU_NVML_RECORDED=str(RECORDED), HPCGPU_REGISTRY=str(tmp_path / "jobs.db"))
    del env["CUDA_VISIBLE_DEVICES"]
    done = subprocess.run([sys.executable, "-m", "hpcgpu", "queue", str(queue), "--dry-run", flag, "3,2"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "over GPUs 3,2" in done.stderr


@pytest.mark.parametrize("key, meant", [
    ("train.learning_rate", "train.learning_rate: unknown key (did you mean 'lr'?)"),
    ("train.num_train_epochs", "(did you mean 'epochs'?)"),
    ("train.batch_size", "(did you mean 'global_batch_size' or 'micro_batch_size'?)"),
    ("train.per_device_train_batch_size", "(did you mean 'micro_batch_size'?)"),
    ("train.gradient_accumulation_steps", "(set the batch sizes: train.global_batch_size = "
                                          "train.micro_batch_size x accumulation steps x ranks)"),
    ("train.max_grad_norm", "(did you mean 'grad_clip'?)"),
    ("train.lora_r", "(did you mean 'train.lora.r'?)"),
    ("train.max_seq_length", "(did you mean 'data.seq_len'?)"),
    ("train.save_steps", "(did you mean 'max_steps' or 'checkpoint.every_steps'?)"),
    ("learning_rate", "(did you mean 'train.lr'?)"),
    ("data.max_length", "(did you mean 'seq_len'?)"),
    ("infer.max_length", "(did you mean 'max_new_tokens'?)"),
    ("model.model_name_or_path", "(did you mean 'name_or_path'?)"),
])
def test_set_of_another_tools_key_name_suggests_ours(capsys, key, meant) -> None:
    line = error_of(capsys, "validate", SPEC, "--set", f"{key}=1")
    assert line.startswith(f"--set {key}=1: {key}: unknown key") and meant in line, line


def test_a_spec_files_key_of_another_tool_gets_the_suggestion_too(capsys, tmp_path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(Path(SPEC).read_text().replace("  lr:", "  learning_rate:"))
    line = error_of(capsys, "validate", str(spec))
    assert ": train.learning_rate: unknown key (did you mean 'lr'?)" in line, line


def test_every_key_another_tools_name_means_is_a_key_of_the_spec() -> None:
    from hpcgpu.spec.jsonschema import json_schema
    from hpcgpu.spec.parse import OTHER_TOOLS_NAMES

    def properties(node: dict) -> dict:
        return node.get("properties") or next(n["properties"] for n in node["anyOf"] if "properties" in n)

    for name, keys in OTHER_TOOLS_NAMES.items():
        for key in keys:
            node = json_schema()
            for part in key.split("."):
                assert part in properties(node), (name, key)
                node = properties(node)[part]
