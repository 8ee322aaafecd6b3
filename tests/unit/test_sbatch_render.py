"""`hpcgpu sbatch` rendering: golden files, what sbatch reads from the #SBATCH lines, and shell quoting.

The shell tests run the rendered script with bash, with `srun` and `scontrol` replaced by PATH shims that
record their argv and environment: they test our quoting, not the scheduler.
"""
from __future__ import annotations

import difflib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import GOLDEN
from hpcgpu.hostlist import port_for_job
from hpcgpu.launch.options import sbatch_options
from hpcgpu.launch.rundir import make_run_dir
from hpcgpu.launch.sbatch import render_sbatch
from hpcgpu.spec import load_spec
from hpcgpu.errors import SpecError

NAMES = ["gpu1", "gpu4_type", "nodes2", "all_options"]
PYTHON = "/opt/venv/bin/python"
UPDATE = os.environ.get("HPCGPU_UPDATE_GOLDEN", "") not in ("", "0")


def render_golden(name: str) -> str:
    spec = load_spec(GOLDEN / f"{name}.yaml")
    run_dir = Path(f"/runs/{name}/RUNID")
    return render_sbatch(spec, run_dir=run_dir, spec_path=run_dir / "spec.yaml", python=PYTHON,
                         script_hint="job.sbatch")


@pytest.mark.parametrize("name", NAMES)
def test_golden(name):
    text = render_golden(name)
    golden = GOLDEN / f"{name}.sbatch"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"{golden} missing: run with HPCGPU_UPDATE_GOLDEN=1 to create it"
    want = golden.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            fromfile=str(golden), tofile="rendered"))
        pytest.fail(f"rendered script differs from {golden.name} "
                    f"(HPCGPU_UPDATE_GOLDEN=1 regenerates it):\n{diff}")


@pytest.mark.parametrize("name", NAMES)
def test_golden_is_valid_bash(name):
    done = subprocess.run(["bash", "-n", str(GOLDEN / f"{name}.sbatch")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --- what sbatch itself reads -------------------------------------------------------------------


def sbatch_directive_args(script: str) -> list[str]:
    """The arguments sbatch takes from the #SBATCH lines, tokenised the way sbatch does.

    Mirrors Slurm's src/sbatch/opt.c (_opt_batch_script/_get_argument): directives are read only up to the
    first line that is neither blank nor a comment; an argument ends at whitespace unless quoted; quotes are
    removed; backslash escapes; an unquoted '#' starts a comment; an unmatched quote is a fatal error.
    """
    args: list[str] = []
    for line in script.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if not line.startswith("#SBATCH"):
            continue
        rest, i = line[len("#SBATCH"):], 0
        while True:
            while i < len(rest) and rest[i].isspace():
                i += 1
            if i >= len(rest):
                break
            arg, quoted, q, esc = "", False, "", False
            while i < len(rest) and (quoted or not rest[i].isspace()):
                ch = rest[i]
                if esc:
                    esc = False
                elif ch == "\\":
                    esc, i = True, i + 1
                    continue
                elif quoted and ch == q:
                    quoted, i = False, i + 1
                    continue
                elif not quoted and ch in "\"'":
                    quoted, q, i = True, ch, i + 1
                    continue
                elif not quoted and ch == "#":
                    i = len(rest)
                    break
                arg += ch
                i += 1
            if quoted:
                raise ValueError(f"sbatch: unmatched {q} in {line!r}")
            if arg:
                args.append(arg)
    return args


def expected_args(spec, run_dir: Path) -> list[str]:
    return [f"--{k}" if v is None else f"--{k}={v}" for k, v in sbatch_options(spec, run_dir)]


@pytest.mark.parametrize("name", NAMES)
def test_every_option_reaches_sbatch(name):
    spec = load_spec(GOLDEN / f"{name}.yaml")
    text = render_golden(name)
    # every option is an #SBATCH line, and sbatch reads it (before the first command) as exactly that value
    assert sbatch_directive_args(text) == expected_args(spec, Path(f"/runs/{name}/RUNID"))


def test_resource_lines_of_the_goldens():
    """Spot-check the numbers a user asked for land in the directives sbatch reads."""
    args = {name: sbatch_directive_args(render_golden(name)) for name in NAMES}
    assert "--gres=gpu:1" in args["gpu1"] and "--nodes=1" in args["gpu1"]
    assert "--gres=gpu:a100:4" in args["gpu4_type"] and "--mem=96G" in args["gpu4_type"]  # 4 x 24G per node
    assert "--ntasks-per-node=4" in args["gpu4_type"]
    assert "--nodes=2" in args["nodes2"] and "--ntasks-per-node=2" in args["nodes2"]
    a = args["all_options"]
    assert "--gpus-per-node=h100:2" in a and not any(x.startswith("--gres") for x in a)
    assert "--mem=3G" in a and "--signal=B:USR1@90" in a and "--no-requeue" in a
    assert "--exclusive" in a and "--nice=10" in a and not any("hint" in x for x in a)  # hint: false -> absent


def test_a_cpu_job_asks_for_no_gpu(tmp_path):
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump({"name": "cpu", "task": "command", "command": ["true"],
                                    "resources": {"gpus": 3, "cpus_per_gpu": 2},
                                    "slurm": {"gpu_request": "none"}, "runs_dir": str(tmp_path / "runs")}))
    text = render_sbatch(load_spec(path), Path("/runs/cpu/RUNID"), Path("/runs/cpu/RUNID/spec.yaml"))
    args = sbatch_directive_args(text)
    assert not any(a.startswith(("--gres", "--gpus")) for a in args)
    assert "--ntasks-per-node=3" in args and "--cpus-per-task=2" in args
    assert "1 node(s) x 3 CPU task(s), no GPU" in text.splitlines()[1]


@pytest.mark.parametrize("runs_dir", ["/home/me/My Drive/runs", "/home/o'brien/runs", "/data/run#1"])
def test_directive_values_survive_sbatch_tokenizer(write_spec, runs_dir):
    spec = load_spec(write_spec("name: a\ntask: command\ncommand: [x]\n"), [f"runs_dir={runs_dir!r}"])
    run_dir = Path(spec.runs_dir) / "a" / "RUNID"
    text = render_sbatch(spec, run_dir=run_dir, spec_path=run_dir / "spec.yaml", python=PYTHON)
    assert sbatch_directive_args(text) == expected_args(spec, run_dir)


# --- the script run by bash, with srun/scontrol shims -------------------------------------------

SHIM_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_OUT/srun.argv"
env -0 > "$STUB_OUT/srun.env"
"""
SHIM_SCONTROL = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_OUT/scontrol.argv"
printf 'gpu07\\n'
sleep 0.05  # the rest comes in a later write, as from a real scontrol with a long list (SIGPIPE check)
printf 'gpu08\\n'
"""


def run_script(script: Path, out: Path, job_id: int = 4242, extra_env: dict | None = None,
               shims: dict | None = None) -> subprocess.CompletedProcess:
    shim_dir = out / "shims"
    shim_dir.mkdir(parents=True, exist_ok=True)
    for name, body in {"srun": SHIM_SRUN, "scontrol": SHIM_SCONTROL, **(shims or {})}.items():
        (shim_dir / name).write_text(body)
        (shim_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")
           and not k.startswith("SLURM_")}
    env.update(PATH=f"{shim_dir}:/usr/bin:/bin", STUB_OUT=str(out), SLURM_JOB_ID=str(job_id),
               SLURM_JOB_NODELIST="gpu[07-08]", **(extra_env or {}))
    work = out / "cwd"
    work.mkdir(exist_ok=True)
    return subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=30)


def read0(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def srun_env(out: Path) -> dict[str, str]:
    return dict(item.split("=", 1) for item in read0(out / "srun.env"))


NASTY = [
    "$(touch PWNED)",
    "`touch PWNED`",
    "a; touch PWNED",
    "it's \"quoted\" && touch PWNED",
    "line1\nline2; touch PWNED\n",
    "$HOME ${PATH} \\ back\\slash",
    "'; touch PWNED; '",
    "*",
    "-n",
    " padded ",
    "",
]


def _write_nasty(tmp_path: Path, env: dict, **more) -> Path:
    doc = {"name": "inj", "task": "command", "command": NASTY, "env": env,
           "data": {"train": "data/$(touch PWNED);`touch PWNED`.txt"},
           "runs_dir": str(tmp_path / "runs $(touch PWNED) `touch PWNED`; 'q' #1"), **more}
    path = tmp_path / "spec dir" / "s.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(doc))
    return path


def _no_marker(root: Path) -> None:
    made = [p for p in root.rglob("*") if p.name == "PWNED"]
    assert not made, f"a value ran as a command: {made}"


def test_nothing_from_the_spec_runs_as_shell(tmp_path):
    env = {f"V{i}": v for i, v in enumerate(NASTY)}
    spec = load_spec(_write_nasty(tmp_path, env))
    run_dir = make_run_dir(spec, run_id="RID")
    spec_path = run_dir / "spec.yaml"
    script = run_dir / "job.sbatch"
    script.write_text(render_sbatch(spec, run_dir, spec_path, python=PYTHON, script_hint=str(script)))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    out = tmp_path / "out"
    done = run_script(script, out)
    assert done.returncode == 0, done.stderr
    _no_marker(tmp_path)

    got = srun_env(out)
    for name, value in env.items():
        assert got[name] == value, name  # byte-exact, newlines and quotes included
    assert got["HPCGPU_RUN_DIR"] == str(run_dir)
    argv = read0(out / "srun.argv")
    assert argv[-5:] == [PYTHON, "-m", "hpcgpu", "run", str(spec_path)]
    assert "--ntasks-per-node=1" in argv
    # the user's argv and data path travel in spec.yaml, untouched
    again = load_spec(spec_path)
    assert again.command == NASTY and again.data.train == spec.data.train == str(
        tmp_path / "spec dir" / "data" / "$(touch PWNED);`touch PWNED`.txt")


def test_rendezvous_from_job_id(tmp_path):
    spec = load_spec(_write_nasty(tmp_path, {"NCCL_DEBUG": "WARN"},
                                  distributed={"nccl": {"debug": "INFO"}}, resources={"gpus": 2, "nodes": 2}))
    run_dir = make_run_dir(spec, run_id="RID")
    script = run_dir / "job.sbatch"
    script.write_text(render_sbatch(spec, run_dir, run_dir / "spec.yaml", python=PYTHON))
    ports = []
    for job in (4242, 4243):
        out = tmp_path / f"out{job}"
        done = run_script(script, out, job_id=job)
        assert done.returncode == 0, done.stderr
        got = srun_env(out)
        assert got["MASTER_ADDR"] == "gpu07"  # the first host of the allocation
        assert read0(out / "scontrol.argv") == ["show", "hostnames", "gpu[07-08]"]
        assert got["MASTER_PORT"] == str(port_for_job(job))
        assert got["NCCL_DEBUG"] == "WARN"  # the user's env wins over the generated NCCL settings
        assert got["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert "--ntasks-per-node=2" in read0(out / "srun.argv")
        ports.append(got["MASTER_PORT"])
    assert ports[0] != ports[1]
    _no_marker(tmp_path)


@pytest.mark.parametrize("port", ["23456", "$(touch PWNED)"])
def test_master_port_in_spec_env_wins(tmp_path, port):
    spec = load_spec(_write_nasty(tmp_path, {"MASTER_PORT": port}))
    run_dir = make_run_dir(spec, run_id="RID")
    script = run_dir / "job.sbatch"
    script.write_text(render_sbatch(spec, run_dir, run_dir / "spec.yaml", python=PYTHON))
    out = tmp_path / "out"
    done = run_script(script, out, job_id=777)
    assert done.returncode == 0, done.stderr
    assert srun_env(out)["MASTER_PORT"] == port
    assert script.read_text().count("MASTER_PORT=") == 1  # exported once, not twice
    _no_marker(tmp_path)


def test_runs_dir_with_a_newline_is_rejected(write_spec):
    """A newline in a path that lands in a #SBATCH/comment line would start a new shell line."""
    path = write_spec("name: a\ntask: command\ncommand: [x]\n")
    with pytest.raises(SpecError) as info:
        load_spec(path, ['runs_dir="/tmp/x\\ntouch PWNED\\n"'])
    assert "runs_dir" in str(info.value)


SHIM_SRUN_WAITS = """#!/bin/bash
echo $$ > "$STUB_OUT/srun.pid"
trap 'echo USR1 > "$STUB_OUT/srun.signal"; exit 0' USR1
for i in $(seq 100); do sleep 0.05; done
"""


def test_batch_signal_reaches_the_ranks(tmp_path):
    spec = load_spec(_write_nasty(tmp_path, {}, slurm={"signal": "B:USR1@60"}))
    run_dir = make_run_dir(spec, run_id="RID")
    script = run_dir / "job.sbatch"
    script.write_text(render_sbatch(spec, run_dir, run_dir / "spec.yaml", python=PYTHON))
    out = tmp_path / "out"
    shim_dir = out / "shims"
    shim_dir.mkdir(parents=True)
    for name, body in {"srun": SHIM_SRUN_WAITS, "scontrol": SHIM_SCONTROL}.items():
        (shim_dir / name).write_text(body)
        (shim_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{shim_dir}:/usr/bin:/bin", "STUB_OUT": str(out), "SLURM_JOB_ID": "5",
           "SLURM_JOB_NODELIST": "gpu07"}
    batch = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 5
        while not (out / "srun.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (out / "srun.pid").exists(), "srun never started"
        batch.send_signal(signal.SIGUSR1)  # what SLURM does for B:USR1@60
        deadline = time.monotonic() + 3
        while not (out / "srun.signal").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (out / "srun.signal").exists(), "the signal sent to the batch shell never reached srun"
    finally:
        batch.kill()
        batch.wait()
        pid_file = out / "srun.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_setup_lines_run_verbatim_before_srun(tmp_path):
    """setup is shell by design: it runs, in order, before srun (so `module load` affects the ranks)."""
    spec = load_spec(_write_nasty(tmp_path, {}, slurm={"setup": ["export FROM_SETUP=$((6*7))",
                                                                 "echo setup-ran > \"$STUB_OUT/setup\""]}))
    run_dir = make_run_dir(spec, run_id="RID")
    script = run_dir / "job.sbatch"
    script.write_text(render_sbatch(spec, run_dir, run_dir / "spec.yaml", python=sys.executable))
    out = tmp_path / "out"
    done = run_script(script, out)
    assert done.returncode == 0, done.stderr
    assert (out / "setup").read_text() == "setup-ran\n"
    assert srun_env(out)["FROM_SETUP"] == "42"


@pytest.mark.parametrize("umask, mode", [(0o077, 0o700), (0o022, 0o755)])
def test_the_written_scripts_follow_the_umask(tmp_path, umask, mode):
    """job.sbatch holds env values and paths: `umask 077` keeps it (and the -o copy) private."""
    out = tmp_path / "job.sbatch"
    cmd = [sys.executable, "-m", "hpcgpu", "sbatch", str(Path(__file__).parents[2] / "configs" / "hello-command.yaml"),
           "--set", f"runs_dir={tmp_path / 'runs'}", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr
    (in_run_dir,) = (tmp_path / "runs" / "hello").glob("*/job.sbatch")
    assert [p.stat().st_mode & 0o777 for p in (out, in_run_dir)] == [mode, mode]
