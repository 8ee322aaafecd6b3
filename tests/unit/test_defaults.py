"""Defaults files: the user's ($XDG_CONFIG_HOME/hpcgpu/defaults.yaml) and the project's (the nearest
hpcgpu.yaml) under the spec, --set over all; errors name the file and line a value came from."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml

from hpcgpu.cli import main
from hpcgpu.errors import SpecError
from hpcgpu.spec import load_spec

SPEC = """\
name: d
task: command
command: [echo, hi]
"""


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's config folder, in this test's tmp_path; HOME there too (above the project)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HPCGPU_NO_DEFAULTS", raising=False)
    return tmp_path / "config" / "hpcgpu"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def hpcgpu(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """The CLI in this process (fast): exit code, stdout, stderr."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def layered(tmp_path: Path, user_dir: Path) -> Path:
    """user < project < spec: each level sets one key fewer than the one below it."""
    write(user_dir / "defaults.yaml", """\
        slurm:
          partition: user-p
          account: user-a
          qos: user-q
          constraint: user-c
          setup: [module load a, module load b]
        resources:
          time: "02:00:00"
        """)
    write(tmp_path / "proj" / "hpcgpu.yaml", """\
        slurm:
          partition: proj-p
          account: proj-a
          qos: proj-q
          setup: [module load c]
        """)
    return write(tmp_path / "proj" / "exp" / "s.yaml", SPEC + textwrap.dedent("""\
        slurm:
          partition: spec-p
          account: spec-a
        resources:
          gpus: 1
        """))


def test_precedence_user_project_spec_set(tmp_path, user_dir):
    spec = load_spec(layered(tmp_path, user_dir), ["slurm.partition=set-p"], defaults=True)
    s = spec.slurm
    assert (s.partition, s.account, s.qos, s.constraint) == ("set-p", "spec-a", "proj-q", "user-c")
    assert s.setup == ["module load c"]  # a list is replaced, not appended to
    assert (spec.resources.time, spec.resources.gpus) == ("02:00:00", 1)  # mappings merge key by key
    # a run dir's spec.yaml (and anything else read without defaults=True) is taken as written
    plain = load_spec(tmp_path / "proj" / "exp" / "s.yaml")
    assert (plain.slurm.partition, plain.slurm.qos, plain.slurm.setup) == ("spec-p", None, [])


def test_no_defaults_env_reads_neither_file(tmp_path, user_dir, monkeypatch):
    path = layered(tmp_path, user_dir)
    monkeypatch.setenv("HPCGPU_NO_DEFAULTS", "1")
    spec = load_spec(path, defaults=True)
    assert (spec.slurm.qos, spec.slurm.constraint, spec.resources.time) == (None, None, "01:00:00")


def test_bad_type_in_project_file_names_its_line(tmp_path, user_dir, capsys):
    write(tmp_path / "proj" / "hpcgpu.yaml", """\
        slurm:
          partition: p
        resources:
          gpus: two
        """)
    spec = write(tmp_path / "proj" / "s.yaml", SPEC)
    code, _, err = hpcgpu(capsys, "validate", str(spec))
    assert code == 2
    assert err.strip().splitlines() == [
        f"hpcgpu: error: {tmp_path / 'proj' / 'hpcgpu.yaml'}:4: resources.gpus: must be an integer, got a string ('two')"]


def test_unknown_key_in_user_file_did_you_mean(tmp_path, user_dir, capsys):
    write(user_dir / "defaults.yaml", """\
        # site settings
        slurm:
          partiton: gpu
        """)
    spec = write(tmp_path / "proj" / "s.yaml", SPEC)
    code, _, err = hpcgpu(capsys, "validate", str(spec))
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith(f"hpcgpu: error: {user_dir / 'defaults.yaml'}:3: slurm.partiton: unknown key "
                           "(did you mean 'partition'?)")


def test_malformed_user_file_one_line(tmp_path, user_dir, capsys):
    write(user_dir / "defaults.yaml", "slurm: [\n")
    code, _, err = hpcgpu(capsys, "validate", str(write(tmp_path / "s.yaml", SPEC)))
    assert code == 2
    (line,) = err.strip().splitlines()
    assert f"{user_dir / 'defaults.yaml'}:2: not valid YAML" in line
    write(user_dir / "defaults.yaml", "- a list\n")
    code, _, err = hpcgpu(capsys, "validate", str(tmp_path / "s.yaml"))
    assert code == 2 and "defaults.yaml: a defaults file holds spec keys" in err


def test_a_spec_value_names_the_spec_even_over_a_defaults_section(tmp_path, user_dir):
    write(user_dir / "defaults.yaml", "resources:\n  time: '01:00:00'\n")
    path = write(tmp_path / "s.yaml", SPEC + "resources:\n  gpus: -1\n")
    with pytest.raises(SpecError, match=re.escape(f"{path}:5: resources.gpus")):
        load_spec(path, defaults=True)


def test_validate_full_shows_sources(tmp_path, user_dir, capsys):
    path = layered(tmp_path, user_dir)
    code, out, _ = hpcgpu(capsys, "validate", str(path), "--full", "--set", "slurm.partition=set-p", "--gpus", "2")
    assert code == 0
    summary, written = out.split("---\n", 1)
    assert yaml.safe_load(written)["slurm"]["qos"] == "proj-q"  # below ---: the spec.yaml a run dir gets
    sources = dict(line.split(maxsplit=1) for line in summary.split("  sources ", 1)[1].splitlines()[1:])
    user, project = str(user_dir / "defaults.yaml"), str(tmp_path / "proj" / "hpcgpu.yaml")
    assert sources["slurm.constraint"] == f"{user}:5" and sources["resources.time"] == f"{user}:8"
    assert sources["slurm.qos"] == f"{project}:4" and sources["slurm.setup"] == f"{project}:5"
    assert sources["slurm.account"] == f"{path}:6" and sources["name"] == f"{path}:1"
    assert sources["slurm.partition"] == "--set slurm.partition=set-p" and sources["resources.gpus"] == "--gpus 2"
    assert "train.lr" not in sources  # a default is not listed


def test_nearest_project_file_below_home(tmp_path, user_dir, monkeypatch):
    write(tmp_path / "a" / "hpcgpu.yaml", "slurm:\n  partition: far\n")
    write(tmp_path / "a" / "b" / "hpcgpu.yaml", "slurm:\n  partition: near\n")
    deep = write(tmp_path / "a" / "b" / "c" / "d" / "s.yaml", SPEC)
    assert load_spec(deep, defaults=True).slurm.partition == "near"  # the nearest only
    beside = write(tmp_path / "a" / "s.yaml", SPEC)
    assert load_spec(beside, defaults=True).slurm.partition == "far"  # the spec's own folder counts
    monkeypatch.setenv("HOME", str(tmp_path / "a" / "b"))  # the search stops before home
    assert load_spec(deep, defaults=True).slurm.partition is None


def test_relative_paths_are_relative_to_the_defaults_file(tmp_path, user_dir, monkeypatch):
    write(tmp_path / "proj" / "hpcgpu.yaml", "runs_dir: runs\ndata:\n  train: data/train.txt\n")
    spec_text = SPEC.replace("task: command\ncommand: [echo, hi]\n", "task: train\nmodel:\n  name_or_path: gpt2\n")
    path = write(tmp_path / "proj" / "exp" / "s.yaml", spec_text)
    monkeypatch.chdir(tmp_path)
    spec = load_spec(path, defaults=True)
    assert spec.runs_dir == str(tmp_path / "proj" / "runs")
    assert spec.data.train == str(tmp_path / "proj" / "data" / "train.txt")
    assert spec.model.name_or_path == "gpt2"


def test_run_dir_spec_is_the_merged_one(tmp_path, user_dir, capsys):
    path = layered(tmp_path, user_dir)
    runs = tmp_path / "runs"
    code, _, err = hpcgpu(capsys, "sbatch", str(path), "--set", f"runs_dir={runs}")
    assert code == 0, err
    (written,) = runs.glob("d/*/spec.yaml")
    (user_dir / "defaults.yaml").unlink()  # a requeue days later: the files changed, the job did not
    (tmp_path / "proj" / "hpcgpu.yaml").write_text("slurm:\n  qos: later\n")
    saved = load_spec(written)
    s = saved.slurm
    assert (s.partition, s.account, s.qos, s.constraint) == ("spec-p", "spec-a", "proj-q", "user-c")
    assert saved.resources.time == "02:00:00"
    job = (written.parent / "job.sbatch").read_text()
    assert "--qos=proj-q" in job and "module load c" in job
