"""The spec loader: typed frozen Spec, one-line errors naming key and file:line, --set, paths, schema."""
from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CONFIGS, GOLDEN
from hpcgpu.errors import SpecError
from hpcgpu.spec import Spec, dump_spec, load_spec
from hpcgpu.spec.derive import time_limit_s

COMMAND = "name: a\ntask: command\ncommand: [x]\n"
INFER = "name: a\ntask: infer\nmodel: {name_or_path: gpt2}\ninfer:\n  input: p.jsonl\n"

FULL = """\
name: full-spec_1.0
task: train
resources:
  nodes: 2
  gpus: 4
  cpus_per_gpu: 8
  mem_per_gpu: 32G
  time: "1-12:00:00"
  gpu_type: a100
  devices: "0,1,4,7"
slurm:
  partition: gpu
  account: proj
  qos: normal
  constraint: a100
  signal: B:USR1@60
  requeue: false
  max_requeues: 5
  setup: ["module load cuda/12"]
  extra: {mail-type: END, exclusive: true}
distributed:
  strategy: deepspeed
  deepspeed: {zero_stage: 3, offload_optimizer: true, offload_params: true, config: ds.json}
  nccl: {debug: WARN, socket_ifname: ib0, ib_disable: true, timeout_s: 300}
model: {name_or_path: gpt2, dtype: bfloat16}
data: {train: train.txt, eval: eval.txt, seq_len: 512}
train:
  global_batch_size: 64
  micro_batch_size: 2
  max_steps: 1000
  lr: 0.0001
  warmup_steps: 100
  seed: 7
  precision: bf16
  compile: false
  log_every: 10
  profile: {start_step: 5, steps: 2}
checkpoint: {every_steps: 500, every_minutes: 30, keep: 3, async: true}
entry: "pkg.mod:fn"
env: {WANDB_MODE: offline}
env_passthrough: [HF_TOKEN, WANDB_API_KEY]
sweep: {train.lr: [0.0001, 0.0003]}
"""


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line containing needle (so tests never hard-code line numbers)."""
    for i, line in enumerate(textwrap.dedent(text).splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in the test spec")


def load_error(path: Path, overrides=(), **kw) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides, **kw)
    msg = str(info.value)
    assert "\n" not in msg, f"error is not one line: {msg!r}"
    return msg


# --- parsing into typed, frozen objects ---------------------------------------------------------


def test_every_design_key_parses_typed(write_spec, tmp_path):
    spec = load_spec(write_spec(FULL))
    r, s, d, t = spec.resources, spec.slurm, spec.distributed, spec.train
    assert (r.nodes, r.gpus, r.cpus_per_gpu, spec.world_size) == (2, 4, 8, 8)
    assert (r.mem_per_gpu, r.time, r.gpu_type, r.devices) == ("32G", "1-12:00:00", "a100", "0,1,4,7")
    assert (s.partition, s.account, s.qos, s.constraint, s.signal) == ("gpu", "proj", "normal", "a100", "B:USR1@60")
    assert s.requeue is False and s.max_requeues == 5
    assert s.setup == ["module load cuda/12"] and s.extra == {"mail-type": "END", "exclusive": True}
    assert d.strategy == "deepspeed"
    assert (d.deepspeed.zero_stage, d.deepspeed.offload_optimizer, d.deepspeed.offload_params) == (3, True, True)
    assert d.deepspeed.config == str(tmp_path / "ds.json")
    assert (d.nccl.debug, d.nccl.socket_ifname, d.nccl.ib_disable, d.nccl.timeout_s) == ("WARN", "ib0", True, 300)
    assert (spec.model.name_or_path, spec.model.dtype) == ("gpt2", "bfloat16")
    assert spec.data.train == str(tmp_path / "train.txt") and spec.data.seq_len == 512
    assert (t.global_batch_size, t.micro_batch_size, t.max_steps, t.warmup_steps, t.seed) == (64, 2, 1000, 100, 7)
    assert isinstance(t.lr, float) and t.lr == pytest.approx(1e-4)
    assert (t.precision, t.compile, t.log_every) == ("bf16", False, 10)
    assert (t.profile.start_step, t.profile.steps) == (5, 2)
    c = spec.checkpoint
    assert (c.every_steps, c.every_minutes, c.keep, c.async_) == (500, 30.0, 3, True)
    assert isinstance(c.every_minutes, float)
    assert spec.entry == "pkg.mod:fn" and spec.env == {"WANDB_MODE": "offline"}
    assert spec.env_passthrough == ["HF_TOKEN", "WANDB_API_KEY"]
    assert spec.sweep == {"train.lr": [0.0001, 0.0003]}


def test_defaults_of_a_minimal_spec(write_spec):
    spec = load_spec(write_spec(COMMAND))
    assert (spec.resources.nodes, spec.resources.gpus, spec.world_size) == (1, 1, 1)
    assert spec.slurm.signal == "USR2@120" and spec.slurm.requeue is True
    assert spec.distributed.strategy == "auto"
    assert spec.train.micro_batch_size == "auto" and spec.train.precision == "auto"
    assert spec.env == {} and spec.sweep == {}
    assert spec.train.profile is None
    profile = load_spec(write_spec(COMMAND + "train: {profile: {}}\n")).train.profile
    assert profile is not None and (profile.start_step, profile.steps) == (10, 3)


def _sections(obj, path="spec"):
    yield path, obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value, f"{path}.{f.name}")


def test_every_section_is_frozen(write_spec):
    spec = load_spec(write_spec(FULL))
    seen = 0
    for path, section in _sections(spec):
        first = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, first, getattr(section, first))
        seen += 1
    assert seen >= 9  # spec, resources, slurm, distributed(+deepspeed, nccl), model, data, train, checkpoint


def test_model_config_mapping_needs_model_type(write_spec):
    ok = load_spec(write_spec("name: a\nmodel: {config: {model_type: gpt2, n_layer: 2}}\ndata: {train: t.txt}\n"))
    assert ok.model.config == {"model_type": "gpt2", "n_layer": 2}
    msg = load_error(write_spec("name: a\nmodel: {config: {n_layer: 2}}\ndata: {train: t.txt}\n"))
    assert "model.config" in msg and "model_type" in msg


def test_shipped_configs_load():
    tiny = load_spec(CONFIGS / "tiny-gpt2.yaml")
    assert tiny.task == "train" and tiny.world_size == 2
    assert Path(tiny.data.train).is_file() and Path(tiny.data.eval).is_file()
    hello = load_spec(CONFIGS / "hello-command.yaml")
    assert hello.task == "command" and hello.command[0] == "python3"


# --- errors: one line naming the key, the file and the line ----------------------------------------

BAD = [
    # id, spec text, dotted key (or None), words the message must hold, the text of the offending line
    ("not-yaml", "name: a\nresources: {gpus: [1\n", None, ["not valid YAML"], None),
    ("list", "- name: a\n- task: train\n", None, ["mapping"], None),
    ("unknown-top", COMMAND + "resource:\n  gpus: 2\n", "resource", ["did you mean 'resources'", "valid keys"],
     "resource:"),
    ("misspelled-nested", COMMAND + "resources:\n  nodes: 1\n  gpu: 2\n", "resources.gpu",
     ["did you mean 'gpus'", "valid keys: nodes, gpus"], "gpu: 2"),
    ("gpus-string", COMMAND + "resources:\n  gpus: two\n", "resources.gpus", ["integer", "two"], "gpus: two"),
    ("requeue-string", COMMAND + "slurm:\n  requeue: 'yes'\n", "slurm.requeue", ["true or false"], "requeue"),
    ("gpus-zero", COMMAND + "resources:\n  gpus: 0\n", "resources.gpus", [">= 1"], "gpus: 0"),
    ("nodes-negative", COMMAND + "resources:\n  nodes: -1\n", "resources.nodes", [">= 1"], "nodes: -1"),
    ("time-mm-ss", COMMAND + "resources:\n  time: '25:00'\n", "resources.time", ["HH:MM:SS"], "time"),
    ("time-short", COMMAND + "resources:\n  time: '1-2:3'\n", "resources.time", ["HH:MM:SS"], "time"),
    ("time-word", COMMAND + "resources:\n  time: abc\n", "resources.time", ["HH:MM:SS"], "time"),
    ("time-unquoted", COMMAND + "resources:\n  time: 10:00:00\n", "resources.time", ["put it in quotes"], "time"),
    ("signal-no-lead", COMMAND + "slurm:\n  signal: USR2\n", "slurm.signal", ["USR2@120"], "signal"),
    ("signal-bad-lead", COMMAND + "slurm:\n  signal: USR2@x\n", "slurm.signal", ["USR2@120"], "signal"),
    # sbatch --signal would refuse these at submission; validate does now
    ("signal-unknown-name", COMMAND + "slurm:\n  signal: NOTASIG@60\n", "slurm.signal",
     ["'NOTASIG' is not a signal name sbatch --signal takes", "USR2"], "signal"),
    ("signal-uncatchable", COMMAND + "slurm:\n  signal: B:SIGKILL@60\n", "slurm.signal",
     ["KILL cannot be caught"], "signal"),
    ("signal-lead-too-long", COMMAND + "slurm:\n  signal: USR2@65536\n", "slurm.signal",
     ["65535"], "signal"),
    ("signal-negative-lead", COMMAND + "slurm:\n  signal: USR2@-1\n", "slurm.signal", ["USR2@120"], "signal"),
    ("infer-no-input", "name: a\ntask: infer\nmodel: {name_or_path: gpt2}\n", "infer.input",
     ["task: infer needs an input file"], None),
    ("infer-no-model", "name: a\ntask: infer\ninfer: {input: p.jsonl}\n", "model",
     ["task: infer needs model.name_or_path"], None),
    # a model copy spans GPUs of one node, every GPU serving one: refused before anything is queued
    ("infer-gpus-per-replica", INFER + "  gpus_per_replica: 2\n", "infer.gpus_per_replica",
     ["2 does not divide the 1 GPUs per node"], "gpus_per_replica"),
    ("infer-quantization-no-dir", "name: a\ntask: infer\nmodel:\n  config: {model_type: gpt2}\n  quantization: int8\n"
     "infer: {input: p.jsonl}\n", "model.quantization", ["give model.name_or_path"], "quantization"),
    ("infer-gpus-per-replica-3", INFER + "  gpus_per_replica: 3\nresources: {gpus: 4}\n", "infer.gpus_per_replica",
     ["3 does not divide the 4 GPUs per node"], "gpus_per_replica"),
    ("infer-mode", INFER + "  mode: chat\n", "infer.mode", ["generate, score"], "mode: chat"),
    # "" ends a completion where it starts: every row would come back empty
    ("infer-empty-stop", INFER + "  stop: ['\\n\\n', '']\n", "infer.stop[1]",
     ["an empty stop string would end every completion at once"], "stop:"),
    # an int-or-literal union says what it takes in one list, not two messages joined
    ("infer-batch-size-zero", INFER + "  batch_size: 0\n", "infer.batch_size",
     ["must be an integer >= 1 or auto; got 0"], "batch_size: 0"),
    ("compile-word", COMMAND + "train:\n  compile: 'yes'\n", "train.compile", ["must be true, false or auto; got 'yes'"],
     "compile:"),
    ("mem-GB", COMMAND + "resources:\n  mem_per_gpu: 32GB\n", "resources.mem_per_gpu", ["32G"], "mem_per_gpu"),
    ("mem-word", COMMAND + "resources:\n  mem_per_gpu: lots\n", "resources.mem_per_gpu", ["32G"], "mem_per_gpu"),
    ("name-space", "name: my job\ntask: command\ncommand: [x]\n", "name", ["letters, digits"], "name:"),
    ("name-semicolon", "name: a;b\ntask: command\ncommand: [x]\n", "name", ["letters, digits"], "name:"),
    ("name-subshell", "name: $(x)\ntask: command\ncommand: [x]\n", "name", ["letters, digits"], "name:"),
    ("name-missing", "task: command\ncommand: [x]\n", "name", ["required"], None),
    ("section-not-mapping", COMMAND + "resources: 3\n", "resources", ["mapping"], "resources"),
    ("train-no-model", "name: a\ntask: train\ndata: {train: t.txt}\n", "model", ["name_or_path"], None),
    ("train-no-data", "name: a\ntask: train\nmodel: {name_or_path: gpt2}\n", "data.train", ["task: train"], None),
    ("command-no-command", "name: a\ntask: command\n", "command", ["task: command"], None),
    ("callable-no-entry", "name: a\ntask: callable\n", "entry", ["task: callable"], None),
    ("entry-format", "name: a\ntask: callable\nentry: just_a_name\n", "entry", ["pkg.module:function"], "entry"),
    ("batch-not-divisible", "name: a\nmodel: {name_or_path: gpt2}\ndata: {train: t.txt}\n"
     "resources: {gpus: 3}\ntrain:\n  global_batch_size: 16\n", "train.global_batch_size",
     ["not divisible", "3 ranks"], "global_batch_size"),
    ("micro-not-dividing", "name: a\nmodel: {name_or_path: gpt2}\ndata: {train: t.txt}\n"
     "train:\n  global_batch_size: 8\n  micro_batch_size: 3\n", "train.micro_batch_size", ["divide"],
     "micro_batch_size"),
    ("profile-steps-zero", COMMAND + "train:\n  profile:\n    start_step: 2\n    steps: 0\n", "train.profile.steps",
     [">= 1, got 0"], "steps: 0"),
    ("offload-needs-zero3", COMMAND + "distributed:\n  deepspeed:\n    offload_params: true\n",
     "distributed.deepspeed.offload_params", ["zero_stage: 3"], "offload_params"),
    ("strategy-choice", COMMAND + "distributed:\n  strategy: fsdp2\n", "distributed.strategy",
     ["auto, ddp, fsdp, deepspeed, none", "fsdp2"], "strategy"),
    ("env-bad-name", COMMAND + "env:\n  1BAD: x\n", "env.1BAD", ["environment variable"], "1BAD"),
    # a secret's value in env: would be written into spec.yaml and job.sbatch
    ("env-token", COMMAND + "env:\n  WANDB_MODE: offline\n  HF_TOKEN: hf_abc\n", "env.HF_TOKEN",
     ["secret", "env_passthrough"], "HF_TOKEN"),
    ("env-api-key", COMMAND + "env:\n  wandb_api_key: abc\n", "env.wandb_api_key", ["env_passthrough"], "wandb"),
    ("env-secret", COMMAND + "env:\n  AWS_SECRET: abc\n", "env.AWS_SECRET", ["env_passthrough"], "AWS_SECRET"),
    ("env-password", COMMAND + "env:\n  DB_PASSWORD_X: abc\n", "env.DB_PASSWORD_X", ["env_passthrough"], "DB_"),
    # what srun and the local executor set for every rank: a value in env: would break the job
    ("env-slurm-owned", COMMAND + "env:\n  SLURM_JOB_ID: '4242'\n", "env.SLURM_JOB_ID", ["launcher", "remove it"],
     "SLURM_JOB_ID"),
    ("env-rank", COMMAND + "env:\n  WORLD_SIZE: '8'\n", "env.WORLD_SIZE", ["launcher"], "WORLD_SIZE"),
    ("env-visible-devices", COMMAND + "env:\n  CUDA_VISIBLE_DEVICES: '0'\n", "env.CUDA_VISIBLE_DEVICES",
     ["resources.devices"], "CUDA_VISIBLE"),
    ("env-run-dir", COMMAND + "env:\n  HPCGPU_RUN_DIR: /x\n", "env.HPCGPU_RUN_DIR", ["launcher"], "HPCGPU_RUN"),
    ("passthrough-bad-name", COMMAND + "env_passthrough: [HF-TOKEN]\n", "env_passthrough[0]",
     ["environment variable name"], "env_passthrough"),
    ("passthrough-and-env", COMMAND + "env: {HF_HOME: /x}\nenv_passthrough: [HF_HOME]\n", "env_passthrough",
     ["HF_HOME", "env:"], "env_passthrough"),
    ("export-drops-passthrough", COMMAND + "env_passthrough: [HF_TOKEN]\nslurm:\n  extra: {export: NONE}\n",
     "slurm.extra.export", ["HF_TOKEN", "ALL"], "extra"),
    ("export-list-drops-passthrough", COMMAND + "env_passthrough: [HF_TOKEN, B]\nslurm:\n  extra: {export: "
     "'PATH,HF_TOKEN'}\n", "slurm.extra.export", ["keeps env_passthrough's B from"], "extra"),
]


@pytest.mark.parametrize("text,key,words,line_text", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_spec_gives_one_clear_line(write_spec, text, key, words, line_text):
    path = write_spec(text)
    msg = load_error(path)
    assert str(path) in msg, msg  # the file is always named
    if key:
        assert f"{key}:" in msg, msg
    for word in words:
        assert word in msg, msg
    if line_text:
        assert f"{path}:{line_of(text, line_text)}:" in msg, msg


@pytest.mark.parametrize("text, words", [
    (INFER + "  gpus_per_replica: 2\n", "infer.gpus_per_replica: 2 does not divide the 1 GPUs per node"),
    (INFER.replace("{name_or_path: gpt2}", "{name_or_path: gpt2, quantization: int4}"),
     "model.quantization: int4 needs bitsandbytes, which this Python does not have: pip install 'hpcgpu[quant]'"),
    (COMMAND + "slurm: {signal: NOTASIG@60}\n", "slurm.signal: 'NOTASIG' is not a signal name"),
], ids=["infer-gpus-per-replica", "infer-quantization", "signal"])
def test_refused_before_any_job_by_every_command(write_spec, tmp_path, text, words):
    """What sbatch or the job would refuse only after the wait in the queue: one line, exit 2, nothing made."""
    import importlib.util
    import os
    import subprocess
    import sys

    if "bitsandbytes" in words and importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here: int4 can run on SLURM")

    path = write_spec(text + f"runs_dir: {tmp_path / 'runs'}\n")
    env = {k: v for k, v in os.environ.items() if k != "HPCGPU_DEBUG"}
    for args in (["validate"], ["sbatch"], ["submit", "--dry-run"], ["submit"], ["submit", "--executor", "local"]):
        done = subprocess.run([sys.executable, "-m", "hpcgpu", args[0], str(path), *args[1:]], capture_output=True,
                              text=True, env=env, timeout=60)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and words in done.stderr, (args, done.stderr)
    assert not (tmp_path / "runs").exists()


def test_task_infer_is_accepted_with_an_input(write_spec, tmp_path):
    spec = load_spec(write_spec(INFER + "  mode: score\n  batch_size: 4\n  gpus_per_replica: 1\n"
                                "resources: {gpus: 2}\n"))
    assert spec.task == "infer" and spec.world_size == 2
    assert spec.infer.input == str(tmp_path / "p.jsonl")  # relative to the spec's folder, like data.train
    assert (spec.infer.mode, spec.infer.batch_size, spec.infer.gpus_per_replica) == ("score", 4, 1)
    assert spec.model.quantization == "none"
    defaults = load_spec(write_spec(INFER)).infer
    assert (defaults.mode, defaults.max_new_tokens, defaults.temperature, defaults.batch_size,
            defaults.gpus_per_replica) == ("generate", 256, 0.0, "auto", "auto")
    assert _round_trip(spec, tmp_path / "moved") == spec
    tiny = load_spec(CONFIGS / "tiny-infer.yaml")
    assert tiny.task == "infer" and Path(tiny.infer.input).is_file()
    assert tiny.model.name_or_path == str(CONFIGS.parent / "runs" / "models" / "tiny-gpt2")


def test_not_yaml_names_the_line(write_spec):
    text = "name: a\ntask: command\ncommand: [x\nenv: {A: b}\n"
    msg = load_error(write_spec(text))
    assert "not valid YAML" in msg and ".yaml:" in msg


def test_empty_file(write_spec):
    for text in ("", "\n   \n"):
        msg = load_error(write_spec(text))
        assert "empty" in msg


def test_missing_file(tmp_path):
    msg = load_error(tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "not found" in msg


def test_duplicate_key_rejected(write_spec):
    msg = load_error(write_spec(COMMAND + "resources:\n  gpus: 1\n  gpus: 2\n"))
    assert "given twice" in msg and "gpus" in msg


def test_duplicate_key_names_file_line_and_dotted_key(write_spec):
    text = COMMAND + "resources:\n  gpus: 1\n  gpus: 2\n"
    path = write_spec(text)
    msg = load_error(path)
    assert f"{path}:6:" in msg and "resources.gpus" in msg


@pytest.mark.parametrize("time", ["1-00:00:00", "00:30:00", "10:00:00", "99:00:00", "7-23:59:59"])
def test_good_times(write_spec, time):
    assert load_spec(write_spec(COMMAND + f"resources: {{time: '{time}'}}\n")).resources.time == time


@pytest.mark.parametrize("signal", ["USR2@120", "B:USR1@60", "SIGUSR1@30", "TERM@0", "B:SIGXCPU@65535", "HUP@5"])
def test_good_signals(write_spec, signal):
    assert load_spec(write_spec(COMMAND + f"slurm: {{signal: '{signal}'}}\n")).slurm.signal == signal


@pytest.mark.parametrize("mem", ["32G", "512M", "1T", "1.5G"])
def test_good_memory(write_spec, mem):
    assert load_spec(write_spec(COMMAND + f"resources: {{mem_per_gpu: {mem}}}\n")).resources.mem_per_gpu == mem


def test_env_names_that_only_resemble_secrets_and_passthrough_that_sbatch_keeps_load(write_spec):
    spec = load_spec(write_spec(COMMAND + "env: {TOKENIZERS_PARALLELISM: 'false', HF_HOME: /x, KEY_FILE: k, "
                                "HF_TOKEN: ''}\nenv_passthrough: [HF_TOKEN2]\n"
                                "slurm: {extra: {export: 'ALL,FOO=1'}}\n"))
    assert spec.env["TOKENIZERS_PARALLELISM"] == "false" and spec.env["HF_TOKEN"] == ""  # an empty one is no secret
    listed = load_spec(write_spec(COMMAND + "env_passthrough: [A]\nslurm: {extra: {export: 'PATH,A'}}\n"))
    assert listed.env_passthrough == ["A"]


def test_env_values_are_the_text_written_not_yaml_11_types(write_spec):
    """The ranks see what the spec says: YAML 1.1 would make yes true, 010 8 and 0x10 16."""
    spec = load_spec(write_spec(COMMAND + "env: {A: yes, B: off, C: 010, D: 1e3, E: 0x10, F: 3, G: 'no'}\n"),
                     ["env.X=yes", "env.Y=010"])
    assert spec.env == {"A": "yes", "B": "off", "C": "010", "D": "1e3", "E": "0x10", "F": "3", "G": "no",
                        "X": "yes", "Y": "010"}
    assert load_spec(write_spec(dump_spec(spec))).env == spec.env  # the resolved spec.yaml keeps them


def test_a_secret_set_on_the_command_line_names_the_flag(write_spec):
    msg = load_error(write_spec(COMMAND), ["env.HF_TOKEN=hf_abc"])
    assert msg.startswith("--set env.HF_TOKEN=hf_abc") and "env_passthrough" in msg


# --- --set / --gpus / --nodes ---------------------------------------------------------------------


def test_set_values_are_yaml_typed(write_spec):
    path = write_spec(COMMAND)
    spec = load_spec(path, ["train.lr=1e-4", "slurm.requeue=false", "command=[a,b]", "train.lr=0.5",
                            "distributed.nccl.debug=INFO", "env.FOO=bar baz", "resources.time=02:00:00"])
    assert spec.resources.time == "02:00:00"
    assert isinstance(spec.train.lr, float) and spec.train.lr == 0.5  # repeated: the last one wins
    assert spec.slurm.requeue is False
    assert spec.command == ["a", "b"]
    assert spec.distributed.nccl.debug == "INFO"  # nested sections are created
    assert spec.env == {"FOO": "bar baz"}


def test_set_exponent_float(write_spec):
    """`--set train.lr=1e-4` is the example in our own help text; YAML 1.1 reads 1e-4 as a string."""
    spec = load_spec(write_spec(COMMAND), ["train.lr=1e-4"])
    assert isinstance(spec.train.lr, float) and spec.train.lr == pytest.approx(1e-4)
    assert load_spec(write_spec(COMMAND + "train: {lr: 3e-4}\n")).train.lr == pytest.approx(3e-4)


def test_set_beats_the_file_and_errors_name_the_flag(write_spec):
    path = write_spec(COMMAND + "resources:\n  gpus: 2\n")
    assert load_spec(path, ["resources.gpus=4"]).resources.gpus == 4
    msg = load_error(path, ["resources.gpus=0"])
    assert msg.startswith("--set resources.gpus=0") and ">= 1" in msg
    msg = load_error(path, ["resources.gpu=2"])
    assert "--set resources.gpu=2" in msg and "did you mean 'gpus'" in msg


def test_set_unknown_section_names_the_flag(write_spec):
    msg = load_error(write_spec(COMMAND), ["resourcs.gpus=2"])
    assert "--set resourcs.gpus=2" in msg and "did you mean 'resources'" in msg


@pytest.mark.parametrize("item", ["train.lr", "=3", "a..b=1", "1abc=2"])
def test_set_malformed(write_spec, item):
    msg = load_error(write_spec(COMMAND), [item])
    assert "--set" in msg


def test_set_through_a_scalar_is_an_error(write_spec):
    msg = load_error(write_spec(COMMAND), ["name.x=1"])
    assert "cannot set name.x" in msg and "not a mapping" in msg


def test_gpus_nodes_flags(write_spec):
    spec = load_spec(CONFIGS / "hello-command.yaml", gpus=4, nodes=3)
    assert (spec.resources.gpus, spec.resources.nodes, spec.world_size) == (4, 3, 12)
    path = write_spec(COMMAND)
    assert load_error(path, gpus=0).startswith("--gpus 0")
    assert load_error(path, nodes=-1).startswith("--nodes -1")
    # the flag changes the ranks, so the batch check runs against the new world size
    msg = load_error(CONFIGS / "tiny-gpt2.yaml", gpus=3)
    assert "train.global_batch_size" in msg and "3 ranks" in msg


# --- paths and round trip ---------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_spec_folder(tmp_path, monkeypatch):
    spec_dir = tmp_path / "exp"
    (spec_dir / "data").mkdir(parents=True)
    (spec_dir / "mymodel").mkdir()
    (spec_dir / "s.yaml").write_text(
        "name: a\nmodel: {name_or_path: mymodel}\n"
        "data: {train: data/train.txt, eval: /abs/eval.txt, cache_dir: tokcache}\nruns_dir: out\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load_spec("../exp/s.yaml")
    assert spec.data.train == str(spec_dir / "data" / "train.txt")
    assert spec.data.eval == "/abs/eval.txt"
    assert spec.model.name_or_path == str(spec_dir / "mymodel")  # a local directory
    assert spec.runs_dir == str(elsewhere / "out")  # outputs go where the command runs
    assert spec.data.cache_dir == str(elsewhere / "tokcache")  # likewise the prepared-data cache
    hub = tmp_path / "exp" / "hub.yaml"
    for name in ("gpt2", "openai-community/gpt2"):
        hub.write_text(f"name: a\nmodel: {{name_or_path: {name}}}\ndata: {{train: t.txt}}\n")
        assert load_spec(hub).model.name_or_path == name  # not a local path: a hub id stays
    # shaped like a path, so a path (made absolute for the job) even where it does not exist yet
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for written, resolved in (("./gone", spec_dir / "gone"), ("../models/x", tmp_path / "models" / "x"),
                              ("models/llama/7b", spec_dir / "models" / "llama" / "7b"),
                              ("~/models/x", tmp_path / "home" / "models" / "x")):
        hub.write_text(f"name: a\nmodel: {{name_or_path: '{written}'}}\ndata: {{train: '~/t.txt'}}\n")
        spec = load_spec(hub)
        assert spec.model.name_or_path == str(resolved), written
        assert spec.data.train == str(tmp_path / "home" / "t.txt")


def _round_trip(spec: Spec, folder: Path) -> Spec:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "spec.yaml"
    out.write_text(dump_spec(spec))
    return load_spec(out)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")) + sorted(GOLDEN.glob("*.yaml")),
                         ids=lambda p: p.name)
def test_dump_reload_round_trip(path, tmp_path):
    spec = load_spec(path)
    assert _round_trip(spec, tmp_path / "elsewhere") == spec


def test_round_trip_full_and_sexagesimal_time(write_spec, tmp_path):
    spec = load_spec(write_spec(FULL), ["resources.time='10:00:00'"])
    assert spec.resources.time == "10:00:00"
    again = _round_trip(spec, tmp_path / "moved")
    assert again == spec and again.resources.time == "10:00:00"


# --- JSON Schema ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    from hpcgpu.spec.jsonschema import json_schema

    schema = json.loads(json.dumps(json_schema()))  # what `hpcgpu schema` prints must be JSON
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")) + sorted(GOLDEN.glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_specs_match_the_schema(validator, path):
    errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
    assert not errors


def test_full_spec_matches_the_schema(validator):
    assert not [e.message for e in validator.iter_errors(yaml.safe_load(FULL))]


@pytest.mark.parametrize("doc", [
    {"name": "a", "resources": {"gpu": 2}},
    {"name": "a", "resourcez": {}},
    {"name": "a", "resources": {"gpus": 0}},
    {"name": "a", "resources": {"time": "25:00"}},
    {"name": "my job"},
    {"name": "a", "task": "fly"},
    {"task": "train"},
    {"name": "a", "env_passthrough": ["HF-TOKEN"]},
    {"name": "a", "env_passthrough": "HF_TOKEN"},
    {"name": "a", "train": {"profile": {"steps": 0}}},
], ids=["misspelled-nested", "misspelled-top", "zero-gpus", "bad-time", "bad-name", "bad-task", "no-name",
        "passthrough-name", "passthrough-not-list", "profile-steps"])
def test_schema_rejects_what_the_loader_rejects(validator, doc):
    assert not validator.is_valid(doc)


# --- property: any valid resources load and round-trip ------------------------------------------


@st.composite
def times(draw):
    days = draw(st.one_of(st.none(), st.integers(0, 30)))
    hours = draw(st.integers(0, 23 if days is not None else 99))
    minutes, seconds = draw(st.integers(0, 59)), draw(st.integers(0, 59))
    text = f"{hours:02d}:{minutes:02d}:{seconds:02d}"
    total = hours * 3600 + minutes * 60 + seconds
    if days is not None:
        text, total = f"{days}-{text}", total + days * 86400
    return text, total


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nodes=st.integers(1, 128), gpus=st.integers(1, 16), cpus=st.integers(1, 256), time=times())
def test_valid_resources_load_and_round_trip(tmp_path_factory, nodes, gpus, cpus, time):
    folder = tmp_path_factory.mktemp("prop")
    text, seconds = time
    doc = {"name": "prop", "task": "command", "command": ["x"],
           "resources": {"nodes": nodes, "gpus": gpus, "cpus_per_gpu": cpus, "time": text}}
    path = folder / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    r = spec.resources
    assert (r.nodes, r.gpus, r.cpus_per_gpu, r.time) == (nodes, gpus, cpus, text)
    assert spec.world_size == nodes * gpus
    assert time_limit_s(spec) == seconds
    assert _round_trip(spec, folder / "again") == spec
