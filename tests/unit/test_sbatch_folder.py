"""sbatch/ holds the script `hpcgpu sbatch` writes for every shipped config, kept current like the
golden files: rendered again here by scripts/render_sbatch_examples.py, the script that writes them."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO


def examples():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("render_sbatch_examples", REPO / "scripts" / "render_sbatch_examples.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLES = examples()
REGENERATE = f"regenerate with: {EXAMPLES.COMMAND}"


def test_every_config_has_a_script_and_every_script_a_config():
    configs = {p.stem for p in EXAMPLES.configs()}
    scripts = {p.stem for p in (REPO / "sbatch").glob("*.sbatch")}
    assert configs, "no configs/*.yaml"
    assert not configs - scripts, f"configs without a script in sbatch/: {sorted(configs - scripts)}; {REGENERATE}"
    assert not scripts - configs, f"scripts in sbatch/ without a config: {sorted(scripts - configs)}; {REGENERATE}"


def test_scripts_are_what_hpcgpu_sbatch_renders_now():
    problems = EXAMPLES.problems()
    if problems:
        pytest.fail("\n".join(problems) + f"\n{REGENERATE}")


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "sbatch").glob("*.sbatch")))
def test_scripts_are_valid_bash_with_no_path_of_this_machine(name):
    path = REPO / "sbatch" / name
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = path.read_text()
    assert str(REPO) not in text and sys.executable not in text  # placeholders only


def test_the_check_names_a_stale_missing_and_orphaned_script(tmp_path, monkeypatch):
    monkeypatch.setattr(EXAMPLES, "FOLDER", tmp_path)
    want = EXAMPLES.expected()
    first, *rest = sorted(want)
    (tmp_path / first).write_text(want[first].replace("#SBATCH --requeue\n", ""))
    (tmp_path / "gone.sbatch").write_text("#!/bin/bash\n")
    found = EXAMPLES.problems(want)
    assert f"sbatch/{first} is stale" in found[0] and "-#SBATCH --requeue" not in found[0]
    assert "+#SBATCH --requeue" in found[0]
    assert [p.split(" ")[0] for p in found[1:]] == [f"sbatch/{name}" for name in rest] + ["sbatch/gone.sbatch"]
    assert all("is missing" in p for p in found[1:-1]) and "has no config" in found[-1]
    assert EXAMPLES.write() and EXAMPLES.problems() == [] and not (tmp_path / "gone.sbatch").exists()
