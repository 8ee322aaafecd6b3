"""Checks before a job is made (hpcgpu/launch/checks.py): what the job would fail on after its wait in
the queue is found by validate, sbatch and submit (SLURM and local) as one line and exit 2, with
nothing written; runs_dir that cannot hold run dirs; env_passthrough variables missing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import CONFIGS, REPO
from hpcgpu.gpu import model_types
from hpcgpu.launch import checks
from hpcgpu.spec import load_spec

EVAL_TEXT = str(CONFIGS / "data" / "pydocs-eval.txt")
TINY = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256}

# every command that makes (or would make) a job; SLURM submit checks before it asks sinfo,
# so these cases need no cluster
COMMANDS = {
    "validate": ["validate"],
    "sbatch": ["sbatch"],
    "submit-slurm": ["submit"],
    "submit-local": ["submit", "--executor", "local"],
}


def hpcgpu(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("HPCGPU_DEBUG", "HF_TOKEN", "SBATCH_EXPORT")}
    environ.update({"CUDA_VISIBLE_DEVICES": "", "HPCGPU_REGISTRY": str(cwd / "jobs.db"), **env})
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True, cwd=cwd,
                          env=environ, timeout=120)


def train_doc(tmp_path: Path, **over) -> dict:
    doc = {"name": "chk", "task": "train", "resources": {"gpus": 1, "cpus_per_gpu": 1},
           "model": {"config": dict(TINY)}, "data": {"train": EVAL_TEXT, "seq_len": 32},
           "train": {"global_batch_size": 2, "max_steps": 1}, "runs_dir": str(tmp_path / "runs")}
    doc.update(over)
    return doc


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "exp" / "s.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def one_error_line(done: subprocess.CompletedProcess, *words: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcgpu: error:"), done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def all_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*")) if folder.exists() else []


# --- defect 5: inputs and model type --------------------------------------------------------------

MISSING = {
    "data.train": ({"data": {"train": "nope/train.txt", "seq_len": 32}}, "nope/train.txt"),
    "data.eval": ({"data": {"train": EVAL_TEXT, "eval": "eval.txt", "seq_len": 32}}, "eval.txt"),
    "deepspeed.config": ({"distributed": {"deepspeed": {"config": "ds.json"}}}, "ds.json"),
    "model.name_or_path": ({"model": {"name_or_path": "./my-model"}}, "my-model"),
    "model.name_or_path-nested": ({"model": {"name_or_path": "models/llama/7b"}}, "models/llama/7b"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(MISSING))
def test_a_missing_input_is_one_line_and_exit_2(tmp_path, case, command):
    over, shown = MISSING[case]
    spec = write(tmp_path, train_doc(tmp_path, **over))
    key = case.removesuffix("-nested").replace("deepspeed.config", "distributed.deepspeed.config")
    line = one_error_line(hpcgpu(*COMMANDS[command], str(spec), cwd=tmp_path), key, shown)
    assert str(tmp_path / "exp") in line  # the path as the job would look for it: from the spec's folder
    assert not (tmp_path / "runs").exists()


def test_a_hub_id_is_not_a_path_and_an_existing_input_passes(tmp_path):
    (tmp_path / "exp" / "ds.json").parent.mkdir()
    (tmp_path / "exp" / "ds.json").write_text("{}")
    for name in ("gpt2", "openai-community/gpt2"):
        # in the Hugging Face cache, where jobs load hub ids from (a missing one: the test at the end)
        (tmp_path / "hf" / "hub" / f"models--{name.replace('/', '--')}" / "snapshots" / "c0ffee").mkdir(parents=True)
        spec = write(tmp_path, train_doc(tmp_path, model={"name_or_path": name},
                                          distributed={"deepspeed": {"config": "ds.json"}}))
        done = hpcgpu("validate", str(spec), cwd=tmp_path, HF_HOME=str(tmp_path / "hf"))
        assert done.returncode == 0, done.stderr
        assert load_spec(spec).model.name_or_path == name


def test_a_folder_for_the_deepspeed_file_is_refused(tmp_path):
    (tmp_path / "exp" / "ds").mkdir(parents=True)
    spec = write(tmp_path, train_doc(tmp_path, distributed={"deepspeed": {"config": "ds"}}))
    one_error_line(hpcgpu("validate", str(spec), cwd=tmp_path), "distributed.deepspeed.config", "folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_input_is_refused(tmp_path):
    data = tmp_path / "exp" / "secret.txt"
    data.parent.mkdir()
    data.write_text("x")
    data.chmod(0)
    spec = write(tmp_path, train_doc(tmp_path, data={"train": "secret.txt"}))
    one_error_line(hpcgpu("validate", str(spec), cwd=tmp_path), "data.train", "permission denied")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unknown_model_type_is_one_short_line_with_close_matches(tmp_path, command):
    spec = write(tmp_path, train_doc(tmp_path, model={"config": {**TINY, "model_type": "gtp2"}}))
    line = one_error_line(hpcgpu(*COMMANDS[command], str(spec), cwd=tmp_path), "model.config.model_type",
                          "'gtp2'", "gpt2")
    assert len(line) < 200  # a hint, not transformers' list of hundreds of model types
    assert not (tmp_path / "runs").exists()


def test_model_types_come_from_a_subprocess_cached_per_transformers_version(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model_types.known_model_types.cache_clear()
    version = model_types.transformers_version()
    assert version, "transformers is installed in the test environment"
    known = model_types.known_model_types(version)
    assert known and {"gpt2", "llama"} <= known
    cached = tmp_path / "cache" / "hpcgpu" / f"model-types-transformers-{version}.json"
    assert set(json.loads(cached.read_text())) == known
    # the next command reads the file and starts no interpreter
    model_types.known_model_types.cache_clear()

    def no_subprocess(*args, **kwargs):
        raise AssertionError("asked transformers again although the cache holds the answer")

    monkeypatch.setattr(model_types.subprocess, "run", no_subprocess)
    assert model_types.known_model_types(version) == known
    # another transformers version is asked again, into a file of its own
    model_types.known_model_types.cache_clear()
    asked = []
    monkeypatch.setattr(model_types.subprocess, "run", lambda *a, **k: asked.append(a) or subprocess.CompletedProcess(
        a, 0, '\n["only_this"]\n', ""))
    assert model_types.known_model_types("0.0.1") == {"only_this"}
    assert len(asked) == 1 and (cached.parent / "model-types-transformers-0.0.1.json").exists()
    model_types.known_model_types.cache_clear()


def test_without_transformers_the_model_type_is_not_checked(tmp_path, monkeypatch):
    import importlib.metadata

    spec = load_spec(write(tmp_path, train_doc(tmp_path, model={"config": {**TINY, "model_type": "gtp2"}})))
    with pytest.raises(Exception, match="gtp2"):
        checks.check_host(spec)

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    checks.check_host(spec)  # no transformers on this login node: nothing to ask, no error


def test_every_sweep_task_is_checked(tmp_path):
    spec = write(tmp_path, train_doc(tmp_path, sweep={"model.config.model_type": ["gpt2", "lama"]}))
    one_error_line(hpcgpu("submit", str(spec), "--executor", "local", cwd=tmp_path), "model_type", "'lama'", "llama")
    assert not (tmp_path / "runs").exists()


# --- defect 4: runs_dir that cannot hold run dirs -------------------------------------------------

def blocked_runs_dir(tmp_path: Path, case: str) -> str:
    if case == "file-in-the-way":
        (tmp_path / "runs").write_text("a file")
        return str(tmp_path / "runs")
    if case == "file-at-name":
        (tmp_path / "runs").mkdir()
        (tmp_path / "runs" / "cmd").write_text("a file where runs/<name>/ goes")
        return str(tmp_path / "runs")
    if case == "under-a-file":
        (tmp_path / "runs").write_text("a file")
        return str(tmp_path / "runs" / "deeper")
    if case == "proc":
        return "/proc/hpcgpu-runs"
    assert case == "read-only"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs").chmod(0o555)
    return str(tmp_path / "runs")


RUNS_DIR_CASES = ["file-in-the-way", "file-at-name", "under-a-file", "proc",
                  pytest.param("read-only", marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes anyway"))]


@pytest.mark.parametrize("command", ["validate", "sbatch", "submit-local", "submit-slurm"])
@pytest.mark.parametrize("case", RUNS_DIR_CASES)
def test_an_unwritable_runs_dir_is_one_line_naming_key_and_path(tmp_path, case, command):
    runs_dir = blocked_runs_dir(tmp_path, case)
    before = all_files(tmp_path)
    spec = tmp_path / "cmd.yaml"
    spec.write_text(f"name: cmd\ntask: command\ncommand: [echo, hi]\nresources: {{gpus: 1}}\nruns_dir: {runs_dir}\n")
    extra = ["-o", str(tmp_path / "job.sbatch")] if command == "sbatch" else []
    done = hpcgpu(*COMMANDS[command], str(spec), *extra, cwd=tmp_path)
    if command == "submit-slurm" and case == "proc" and done.returncode == 3:
        pytest.skip("no SLURM here: sinfo is asked before the run dir is made")
    one_error_line(done, "runs_dir", runs_dir)
    left = set(all_files(tmp_path)) - set(before) - {spec}
    assert not {p for p in left if not p.name.startswith("jobs.db")}, left  # nothing half-written


def test_make_run_dir_removes_what_it_made_when_spec_yaml_cannot_be_written(tmp_path, monkeypatch):
    from hpcgpu.errors import SpecError
    from hpcgpu.launch import rundir

    spec = load_spec(CONFIGS / "hello-command.yaml", [f"runs_dir={tmp_path / 'a' / 'runs'}"])

    def disk_full(path, text, mode=None):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(rundir, "write_atomic", disk_full)
    with pytest.raises(SpecError, match="runs_dir.*No space left"):
        rundir.make_run_dir(spec)
    assert list(tmp_path.iterdir()) == []  # not even the runs/<name>/ folders it made on the way


def test_an_unfinished_infer_or_train_run_is_the_same_run_at_another_width(tmp_path):
    from hpcgpu.launch import rundir

    runs = f"runs_dir={tmp_path / 'runs'}"
    for config, other in (("tiny-infer.yaml", "infer.max_new_tokens=3"), ("tiny-gpt2.yaml", "train.lr=0.5")):
        spec = load_spec(CONFIGS / config, [runs, "resources.gpus=2"])
        made = rundir.make_run_dir(spec)
        fewer = load_spec(CONFIGS / config, [runs, "resources.gpus=1"])
        assert rundir.find_unfinished_run(fewer) == made.resolve(), config  # the job's plan goes on at the new width
        assert rundir.find_unfinished_run(load_spec(CONFIGS / config, [runs, "resources.gpus=1", other])) is None


# --- env_passthrough ------------------------------------------------------------------------------

PASS = "name: cmd\ntask: command\ncommand: [echo, hi]\nenv_passthrough: [HF_TOKEN, WANDB_API_KEY]\n"


@pytest.mark.parametrize("command", ["submit-slurm", "submit-local"])
def test_submit_refuses_when_a_passthrough_variable_is_not_set(tmp_path, command):
    spec = tmp_path / "cmd.yaml"
    spec.write_text(PASS + f"runs_dir: {tmp_path / 'runs'}\n")
    line = one_error_line(hpcgpu(*COMMANDS[command], str(spec), cwd=tmp_path, WANDB_API_KEY="w"),
                          "env_passthrough", "HF_TOKEN", "not set")
    assert "WANDB_API_KEY" not in line  # only the one that is missing
    assert not (tmp_path / "runs").exists()


def test_sbatch_warns_about_an_unset_passthrough_variable_and_writes_the_script(tmp_path):
    spec = tmp_path / "cmd.yaml"
    spec.write_text(PASS + f"runs_dir: {tmp_path / 'runs'}\n")
    done = hpcgpu("sbatch", str(spec), cwd=tmp_path, HF_TOKEN="x")
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("hpcgpu: warning: env_passthrough: WANDB_API_KEY is not set")
    assert "HF_TOKEN" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert len(list((tmp_path / "runs" / "cmd").glob("*/job.sbatch"))) == 1
    quiet = hpcgpu("sbatch", str(spec), cwd=tmp_path, HF_TOKEN="x", WANDB_API_KEY="y")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_an_sbatch_export_that_drops_passthrough_variables_is_refused(tmp_path):
    spec = tmp_path / "cmd.yaml"
    spec.write_text(PASS + f"runs_dir: {tmp_path / 'runs'}\n")
    env = {"HF_TOKEN": "x", "WANDB_API_KEY": "y"}
    one_error_line(hpcgpu("submit", str(spec), cwd=tmp_path, SBATCH_EXPORT="NONE", **env),
                   "SBATCH_EXPORT=NONE", "HF_TOKEN")
    one_error_line(hpcgpu("submit", str(spec), cwd=tmp_path, SBATCH_EXPORT="PATH,HF_TOKEN", **env),
                   "WANDB_API_KEY")
    # the local executor does not go through sbatch
    assert hpcgpu("submit", str(spec), "--executor", "local", "--dry-run", cwd=tmp_path,
                  SBATCH_EXPORT="NONE", **env).returncode == 0
    assert not (tmp_path / "runs").exists()


# --- task: infer: the input rows and the model folder ---------------------------------------------

GOOD_ROWS = '{"id": "a", "prompt": "hello"}\n{"id": "b", "messages": [{"role": "user", "content": "hi"}]}\n'


def model_dir(tmp_path: Path, *files: str) -> Path:
    """A folder shaped like one save_pretrained() wrote: the checks look for files, not inside them."""
    folder = tmp_path / "exp" / "model"
    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        (folder / name).write_text("{}")
    return folder


def infer_doc(tmp_path: Path, rows: str | None = GOOD_ROWS, input_name: str = "prompts.jsonl", **infer) -> dict:
    (tmp_path / "exp").mkdir(exist_ok=True)
    if rows is not None:
        (tmp_path / "exp" / input_name).write_text(rows)
    if not (tmp_path / "exp" / "model").exists():
        model_dir(tmp_path, "config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
                  "chat_template.jinja")
    return {"name": "inf", "task": "infer", "resources": {"gpus": 2, "cpus_per_gpu": 1},
            "model": {"name_or_path": "./model"}, "infer": {"input": input_name, **infer},
            "runs_dir": str(tmp_path / "runs")}


def test_a_good_infer_spec_passes_every_command(tmp_path):
    spec = write(tmp_path, infer_doc(tmp_path))
    done = hpcgpu("validate", str(spec), cwd=tmp_path)
    assert done.returncode == 0 and "task      infer" in done.stdout, done.stderr
    done = hpcgpu("submit", str(spec), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # a .txt input: one prompt a line; score mode reads "text"
    (tmp_path / "exp" / "texts.txt").write_text("one\ntwo\n")
    (tmp_path / "exp" / "scored.jsonl").write_text('{"id": 1, "text": "x"}\n')
    for over in ({"input": "texts.txt"}, {"input": "scored.jsonl", "mode": "score"}):
        doc = infer_doc(tmp_path, rows=None)
        doc["infer"].update(over)
        assert hpcgpu("validate", str(write(tmp_path, doc)), cwd=tmp_path).returncode == 0


def test_the_byte_tokenizer_of_a_trained_model_counts_as_a_tokenizer(tmp_path):
    doc = infer_doc(tmp_path, rows='{"id": "a", "prompt": "hello"}\n')
    model_dir(tmp_path / "t", "config.json", "hpcgpu_tokenizer.json")  # what hpcgpu's trainer saves
    doc["model"]["name_or_path"] = str(tmp_path / "t" / "exp" / "model")
    checks.check_host(load_spec(write(tmp_path, doc)))


@pytest.mark.parametrize("case", ["byte-tokenizer", "model-config", "no-template", "template-in-config"])
def test_chat_rows_need_a_tokenizer_with_a_chat_template(tmp_path, case):
    doc = infer_doc(tmp_path)  # line 2 of its input has "messages"
    if case == "model-config":
        doc["model"] = {"config": dict(TINY)}
    elif case == "byte-tokenizer":
        doc["model"]["name_or_path"] = str(model_dir(tmp_path / "t", "config.json", "hpcgpu_tokenizer.json"))
    else:
        folder = model_dir(tmp_path / "t", "config.json", "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": "{{ messages[0]['content'] }}"} if case == "template-in-config" else {}))
        doc["model"]["name_or_path"] = str(folder)
    spec = write(tmp_path, doc)
    done = hpcgpu("validate", str(spec), cwd=tmp_path)
    if case == "template-in-config":  # where transformers before 4.47 saved it
        assert done.returncode == 0, done.stderr
        return
    one_error_line(done, f"{tmp_path / 'exp' / 'prompts.jsonl'}:2:", "\"messages\" need the tokenizer's chat template",
                   "give a \"prompt\" instead")


# (the infer section, the file, the words the line must hold); {input} is the input file's path
BAD_INFER = {
    "input-missing": ({"input": "nope.jsonl"}, None, ["infer.input: file not found:", "nope.jsonl"]),
    "input-a-folder": ({"input": "."}, None, ["infer.input:", "is a folder"]),
    "malformed-line": ({}, GOOD_ROWS + '{"id": "c", "prompt": \n', ["{input}:3:", "not a JSON object"]),
    "not-an-object": ({}, GOOD_ROWS + '["c", "x"]\n', ["{input}:3:", "expected a JSON object"]),
    "no-prompt": ({}, '\n{"id": "a", "prompt": "x"}\n{"id": "b", "promt": "x"}\n', ["{input}:3:", "\"prompt\""]),
    "no-text-in-score-mode": ({"mode": "score"}, '{"id": "a", "prompt": "x"}\n', ["{input}:1:", "\"text\""]),
    "repeated-id": ({}, GOOD_ROWS + '{"id": "a", "prompt": "again"}\n', ["{input}:3:", "'a' is repeated",
                                                                        "line 1"]),
    "no-rows": ({}, "\n\n", ["infer.input:", "has no rows"]),
    "not-utf8": ({}, None, ["{input}:2:", "not UTF-8"]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(BAD_INFER))
def test_a_bad_infer_input_is_one_line_naming_file_and_line(tmp_path, case, command):
    over, rows, words = BAD_INFER[case]
    doc = infer_doc(tmp_path, rows=rows, **over)
    if case == "not-utf8":
        (tmp_path / "exp" / "prompts.jsonl").write_bytes(b'{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "\xff"}\n')
    spec = write(tmp_path, doc)
    shown = str(tmp_path / "exp" / "prompts.jsonl")  # the path the job would read: from the spec's folder
    one_error_line(hpcgpu(*COMMANDS[command], str(spec), cwd=tmp_path), *(w.format(input=shown) for w in words))
    assert not (tmp_path / "runs").exists()


BAD_MODEL = {
    "missing": ((), ["model.name_or_path: file not found:", "missing-model"]),
    "no-tokenizer": (("config.json", "model.safetensors", "generation_config.json"),
                     ["model.name_or_path:", "has no tokenizer", "tokenizer.json"]),
    "no-config": (("tokenizer.json", "model.safetensors"), ["model.name_or_path:", "has no config.json"]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(BAD_MODEL))
def test_a_model_folder_without_config_or_tokenizer_is_one_line(tmp_path, case, command):
    files, words = BAD_MODEL[case]
    doc = infer_doc(tmp_path)
    if case == "missing":
        doc["model"]["name_or_path"] = "./missing-model"
    else:
        bare = model_dir(tmp_path / "b", *files)
        doc["model"]["name_or_path"] = str(bare)
    spec = write(tmp_path, doc)
    one_error_line(hpcgpu(*COMMANDS[command], str(spec), cwd=tmp_path), *words)
    assert not (tmp_path / "runs").exists()


def test_a_training_model_folder_needs_no_tokenizer(tmp_path):
    """Training falls back to the byte-level tokenizer; only task: infer needs the model's own."""
    bare = model_dir(tmp_path / "b", "config.json", "model.safetensors")
    checks.check_host(load_spec(write(tmp_path, train_doc(tmp_path, model={"name_or_path": str(bare)}))))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_gpus_that_a_model_copy_cannot_divide_are_refused_by_every_command(tmp_path, command):
    doc = infer_doc(tmp_path, gpus_per_replica=4)  # resources.gpus 2
    one_error_line(hpcgpu(*COMMANDS[command], str(write(tmp_path, doc)), cwd=tmp_path), "infer.gpus_per_replica",
                   "4 does not divide the 2 GPUs per node")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_quantization_without_bitsandbytes_is_refused_by_every_command(tmp_path, command):
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    doc = infer_doc(tmp_path)
    doc["model"]["quantization"] = "int8"
    one_error_line(hpcgpu(*COMMANDS[command], str(write(tmp_path, doc)), cwd=tmp_path),
                   "model.quantization: int8 needs bitsandbytes", "pip install 'hpcgpu[quant]'")
    assert not (tmp_path / "runs").exists()


def lora_doc(tmp_path: Path, targets: list[str], **model: Any) -> dict:
    return train_doc(tmp_path, model=model or {"config": dict(TINY)},
                     train={"global_batch_size": 2, "max_steps": 1, "lora": {"target_modules": targets}})


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_lora_target_the_model_lacks_is_the_job_s_line_before_any_job(tmp_path: Path, command: str) -> None:
    """The job refused it after the queue wait; the config tells the names here (runtime/lora.py's line)."""
    done = hpcgpu(*COMMANDS[command], str(write(tmp_path, lora_doc(tmp_path, ["q_proj"]))), cwd=tmp_path)
    assert one_error_line(done) == ("hpcgpu: error: train.lora.target_modules: q_proj is not a linear layer of "
                                    "this gpt2 model (did you mean c_proj?); its linear layers: c_attn, c_fc, c_proj, "
                                    "lm_head")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "jobs.db").exists()


def test_lora_targets_the_model_has_pass_without_torch_and_the_rest_is_left_to_the_job(tmp_path: Path) -> None:
    """Login nodes stay fast (the names come from the config, no torch); refused only where certain."""
    probe = ("import sys\nfrom hpcgpu.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
             "    code = exc.code\nprint('HEAVY=' + ','.join(m for m in ('torch', 'transformers') if m in sys.modules),"
             " 'CODE=' + str(code), file=sys.stderr)\n")
    spec = write(tmp_path, lora_doc(tmp_path, ["attn.c_attn", "c_proj", "h.0.mlp.c_fc"]))  # peft takes a path's end
    done = subprocess.run([sys.executable, "-c", probe, "validate", str(spec)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert "HEAVY= CODE=0" in done.stderr, done.stderr
    # a local folder's config.json is read as model.config is
    folder = model_dir(tmp_path / "m", "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**TINY, "model_type": "llama"}))
    with pytest.raises(Exception, match=r"^train\.lora\.target_modules: c_attn is not a linear layer of this llama "
                                        r"model; its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj"):
        checks.check_host(load_spec(write(tmp_path, lora_doc(tmp_path, ["c_attn"], name_or_path=str(folder)))))
    # a family whose layer names the host does not know, a multimodal config, a hub id: the job decides
    remote = {**TINY, "model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling.Mine"}}
    for model in ({"config": {**TINY, "model_type": "falcon"}}, {"config": {**TINY, "text_config": dict(TINY)}},
                  {"config": remote},
                  {"name_or_path": "gpt2"}):
        assert checks.lora_targets_problem(load_spec(write(tmp_path, lora_doc(tmp_path, ["nope"], **model)))) is None


def test_quantization_on_the_local_executor_without_a_gpu_is_refused(tmp_path):
    """bitsandbytes importable (a stand-in package) but no GPU here: the local executor refuses before
    anything loads; SLURM's nodes have GPUs, so sbatch renders the script."""
    fake = tmp_path / "site" / "bitsandbytes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    doc = infer_doc(tmp_path)
    doc["model"]["quantization"] = "int4"
    spec = write(tmp_path, doc)
    site = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    one_error_line(hpcgpu("submit", str(spec), "--executor", "local", cwd=tmp_path, **site),
                   "model.quantization: int4 runs on a GPU only", "submit to SLURM")
    assert not (tmp_path / "runs").exists()
    assert hpcgpu("sbatch", str(spec), cwd=tmp_path, **site).returncode == 0


def test_a_max_memory_the_job_cannot_read_is_refused(tmp_path):
    for bad in ("lots", "70GiB,gpu=3G", "70GiB,cpu"):
        one_error_line(hpcgpu("validate", str(write(tmp_path, infer_doc(tmp_path, max_memory=bad))), cwd=tmp_path),
                       f"infer.max_memory: {bad!r} is not auto or a size like 70GiB", "',cpu=SIZE'")
    for good in ("70GiB", "70GiB,cpu=200GiB", "auto,cpu=64G"):
        assert hpcgpu("validate", str(write(tmp_path, infer_doc(tmp_path, max_memory=good))),
                      cwd=tmp_path).returncode == 0


def test_every_sweep_task_s_input_is_read(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "bad.jsonl").write_text('{"id": 1, "prompt": "x"}\n{"id": 1, "prompt": "y"}\n')
    doc = infer_doc(tmp_path)
    doc["sweep"] = {"infer.input": [str(tmp_path / "exp" / "prompts.jsonl"), str(tmp_path / "exp" / "bad.jsonl")]}
    one_error_line(hpcgpu("submit", str(write(tmp_path, doc)), "--executor", "local", cwd=tmp_path),
                   f"{tmp_path / 'exp' / 'bad.jsonl'}:2:", "repeated")
    assert not (tmp_path / "runs").exists()


def test_the_shipped_example_passes_with_the_model_the_script_makes(tmp_path):
    """scripts/make_tiny_model.py writes a folder configs/tiny-infer.yaml can use (no hub): a config,
    seeded random weights, a BPE tokenizer with end-of-text, padding and a chat template."""
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert made.returncode == 0 and made.stderr == "", made.stderr
    assert "BPE vocabulary 512" in made.stdout
    assert checks.has_chat_template(tmp_path / "m")
    done = hpcgpu("validate", str(CONFIGS / "tiny-infer.yaml"), "--set", f"model.name_or_path={tmp_path / 'm'}",
                  cwd=tmp_path)
    assert done.returncode == 0 and "task      infer" in done.stdout, done.stderr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    assert (tok.eos_token, tok.pad_token, len(tok)) == ("<|endoftext|>", "<|pad|>", 512)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False) == "user: hi\nassistant:"
    again = subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(tmp_path / "m2")],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):  # seeded: the same folder every time
        assert (tmp_path / "m" / name).read_bytes() == (tmp_path / "m2" / name).read_bytes(), name


def test_infer_checks_import_no_torch(tmp_path):
    """The rows and the model folder are read without torch or transformers (login nodes stay fast)."""
    spec = write(tmp_path, infer_doc(tmp_path, max_memory="70GiB"))
    probe = ("import sys\nfrom hpcgpu.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
             "    code = exc.code\nprint('HEAVY=' + ','.join(m for m in ('torch', 'transformers') if m in sys.modules),"
             " 'CODE=' + str(code), file=sys.stderr)\n")
    for args in (["validate", str(spec)], ["sbatch", str(spec)]):
        done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=tmp_path,
                              timeout=60)
        assert "HEAVY= CODE=0" in done.stderr, (args, done.stderr)


# --- a hub id that is not in the Hugging Face cache -----------------------------------------------

def test_a_hub_id_missing_from_the_cache_is_one_line_here_and_in_the_job(tmp_path):
    """Jobs load hub ids from the cache only: validate says so before submitting, and a job that meets
    one anyway (another node's cache) fails at once with the same cause, not a minute of retries."""
    hf_home = tmp_path / "hf"
    (tmp_path / "exp").mkdir()
    spec = str(tmp_path / "exp" / "infer.yaml")  # a folder of its own: `hpcgpu run` makes it the run dir
    (tmp_path / "exp" / "infer.yaml").write_text((CONFIGS / "tiny-infer.yaml").read_text())
    hub_id = ["--set", "model.name_or_path=nothere/xx", "--set", f"infer.input={CONFIGS / 'data' / 'prompts.jsonl'}"]
    one_error_line(hpcgpu("validate", spec, *hub_id, cwd=tmp_path, HF_HOME=str(hf_home)),
                   "'nothere/xx'", "not in the Hugging Face cache", str(hf_home / "hub"))
    (hf_home / "hub" / "models--nothere--xx" / "snapshots" / "abc").mkdir(parents=True)  # as if downloaded
    done = hpcgpu("validate", spec, *hub_id, cwd=tmp_path, HF_HOME=str(hf_home))
    assert "not in the Hugging Face cache" not in done.stderr

    job = hpcgpu("run", spec, *hub_id, cwd=tmp_path, HF_HOME=str(tmp_path / "other-node"))
    assert job.returncode == 2, job.stderr
    assert "hpcgpu: error: model.name_or_path: 'nothere/xx' is not a folder, and as a hub id it is not in this " \
           "node's Hugging Face cache" in job.stderr
    assert "Retrying" not in job.stderr + job.stdout and "Traceback" not in job.stderr


def test_trackers_on_a_command_task_are_a_warning_not_silence(tmp_path):
    done = hpcgpu("validate", str(CONFIGS / "hello-command.yaml"), "--set", "track.tensorboard=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("hpcgpu: warning: track: task: command has no trackers (your program logs its own); "
                           "it is ignored\n")
    assert hpcgpu("validate", str(CONFIGS / "hello-command.yaml"), cwd=tmp_path).stderr == ""


# --- attention sizes, incomplete data folders, max_new_tokens past the model's positions ----------

def tiny_gpt2(tmp_path: Path, *sets: str):
    return load_spec(CONFIGS / "tiny-gpt2.yaml", [f"runs_dir={tmp_path / 'runs'}", *sets])


LLAMA = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 96, "intermediate_size": 64,
         "num_attention_heads": 8, "vocab_size": 256}
BAD_HEADS = {  # (model.config, or a local folder's config.json), the words of the line
    "gpt2": ({**TINY, "n_head": 3}, "n_embd 32 is not divisible by n_head 3; make n_embd a multiple of n_head"),
    "llama": ({**LLAMA, "num_attention_heads": 5}, "hidden_size 96 is not divisible by num_attention_heads 5"),
    "kv-heads": ({**LLAMA, "num_key_value_heads": 3},
                 "num_attention_heads 8 is not divisible by num_key_value_heads 3"),
}


def test_the_attention_sizes_of_model_config_are_checked_by_validate(tmp_path):
    """validate said ok here, and the job died in transformers' config (a ValueError)."""
    done = hpcgpu("validate", str(CONFIGS / "tiny-gpt2.yaml"), "--set", "model.config.n_head=3",
                  "--set", f"runs_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert one_error_line(done) == ("hpcgpu: error: model.config: n_embd 128 is not divisible by n_head 3; "
                                    "make n_embd a multiple of n_head")
    checks.check_host(tiny_gpt2(tmp_path, "model.config.n_head=8"))


@pytest.mark.parametrize("source", ["model.config", "folder"])
@pytest.mark.parametrize("case", list(BAD_HEADS))
def test_attention_sizes_that_cannot_work_are_one_line(tmp_path, case, source):
    from hpcgpu.errors import SpecError

    config, words = BAD_HEADS[case]
    if source == "folder":
        folder = model_dir(tmp_path, "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config))
        model, where = {"name_or_path": str(folder)}, f"model.name_or_path: {folder / 'config.json'}: "
    else:
        model, where = {"config": config}, "model.config: "
    spec = load_spec(write(tmp_path, train_doc(tmp_path, model=model)))
    with pytest.raises(SpecError) as err:
        checks.check_host(spec)
    assert str(err.value).startswith(where + words), str(err.value)


def test_attention_sizes_that_divide_pass_and_a_text_config_is_what_counts(tmp_path):
    for config in ({**LLAMA, "num_key_value_heads": 2}, {**LLAMA, "num_attention_heads": 5, "head_dim": 32},
                   {**LLAMA, "text_config": {"hidden_size": 64, "num_attention_heads": 4}}):
        checks.check_host(load_spec(write(tmp_path, train_doc(tmp_path, model={"config": config}))))
    # a model type whose attention takes a hidden size the heads do not divide builds and runs: passes
    checks.check_host(load_spec(write(tmp_path, train_doc(tmp_path, model={"config": {
        **LLAMA, "model_type": "qwen2", "num_attention_heads": 5, "num_key_value_heads": 5}}))))
    # a multimodal config: its text part is what the job's model uses
    spec = load_spec(write(tmp_path, train_doc(tmp_path, model={"config": {
        **LLAMA, "text_config": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 3}}})))
    with pytest.raises(Exception, match=r"model\.config: text_config\.hidden_size 64 is not divisible by "
                                        r"text_config\.num_attention_heads 3"):
        checks.check_host(spec)


@pytest.mark.parametrize("key", ["data.train", "data.eval"])
@pytest.mark.parametrize("case", ["no-manifest", "empty"])
def test_a_data_folder_the_job_cannot_read_is_one_line(tmp_path, case, key):
    folder = tmp_path / "prepared"
    folder.mkdir()
    if case == "no-manifest":  # an interrupted copy of a prepared dataset: the manifest is written last
        (folder / "tokens.bin").write_bytes(b"\0\0")
        (folder / "docs.npy").write_bytes(b"")
        words = f"{key}: {folder}: not a complete prepared dataset (no manifest.json); run hpcgpu data prepare again"
    else:
        words = f"{key}: {folder}: a folder with no .parquet or .arrow files"
    over = {"train": str(folder)} if key == "data.train" else {"train": EVAL_TEXT, "eval": str(folder)}
    spec = write(tmp_path, train_doc(tmp_path, data={**over, "seq_len": 32}))
    assert one_error_line(hpcgpu("validate", str(spec), cwd=tmp_path)).startswith(f"hpcgpu: error: {words}")
    # what the job reads from a folder passes: a prepared one (its manifest), parquet files, save_to_disk
    (folder / "manifest.json").write_text(json.dumps({"format": "hpcgpu-prepared"}))
    checks.check_host(load_spec(spec))
    for name in ("part-0.parquet", "state.json"):
        for made in folder.iterdir():
            made.unlink()
        (folder / name).write_text("{}")
        checks.check_host(load_spec(spec))


def infer_model(tmp_path: Path, config: dict) -> Path:
    folder = model_dir(tmp_path / "m", "tokenizer.json", "chat_template.jinja", "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("command", ["validate", "submit-local"])
def test_max_new_tokens_past_the_model_s_positions_is_one_line(tmp_path, command):
    folder = infer_model(tmp_path, {**TINY, "n_positions": 512})
    sets = ["--set", f"model.name_or_path={folder}", "--set", f"runs_dir={tmp_path / 'runs'}"]
    done = hpcgpu(*COMMANDS[command], str(CONFIGS / "tiny-infer.yaml"), *sets, "--set", "infer.max_new_tokens=600",
                  cwd=tmp_path)
    one_error_line(done, "infer.max_new_tokens: 600 leaves no room for a prompt in the model's 512 positions",
                   f"(n_positions, model.name_or_path: {folder / 'config.json'})")
    assert not (tmp_path / "runs").exists()


def test_max_new_tokens_below_the_positions_or_scoring_passes(tmp_path):
    from hpcgpu.errors import SpecError

    folder = infer_model(tmp_path, {**LLAMA, "max_position_embeddings": 512})
    base = [f"runs_dir={tmp_path / 'runs'}", f"model.name_or_path={folder}"]
    with pytest.raises(SpecError, match=r"max_new_tokens: 512 .* 512 positions \(max_position_embeddings, "):
        checks.check_host(load_spec(CONFIGS / "tiny-infer.yaml", [*base, "infer.max_new_tokens=512"]))
    checks.check_host(load_spec(CONFIGS / "tiny-infer.yaml", [*base, "infer.max_new_tokens=511"]))
    (tmp_path / "texts.jsonl").write_text('{"id": 1, "text": "x"}\n')
    checks.check_host(load_spec(CONFIGS / "tiny-infer.yaml", [*base, "infer.max_new_tokens=600", "infer.mode=score",
                                                              f"infer.input={tmp_path / 'texts.jsonl'}"]))
    # model.config: the byte-level tokenizer has no chat template, so a "prompt" input
    (tmp_path / "prompts.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    doc = infer_doc(tmp_path, rows=None, input_name=str(tmp_path / "prompts.jsonl"), max_new_tokens=64)
    doc["model"] = {"config": dict(TINY)}  # n_positions 64
    with pytest.raises(SpecError, match=r"max_new_tokens: 64 .* 64 positions \(n_positions, model.config\)"):
        checks.check_host(load_spec(write(tmp_path, doc)))
