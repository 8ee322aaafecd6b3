"""No rank outlives its launcher, and a run dir never gets two live writers (issue 12, defect 3).

Real processes throughout: a launcher (`hpcgpu submit --executor local`, or `hpcgpu queue`) killed
with SIGKILL must take its ranks and their programs along within seconds; a job holds
<run dir>/.lock for as long as any of its processes lives; a second job on a locked run dir is
refused with one line and exit 2 and changes nothing there. Processes are found through /proc.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import job_env, submit, submit_cmd, wait_for, write_spec_file
from hpcgpu.launch import runlock
from hpcgpu.procs import PARENT_PID_VAR, child_dies_with_me

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")

# the user's program: records its pid, then waits for OUT/go (or 120 s) and exits 0
PROGRAM = textwrap.dedent("""
    import os, pathlib, time
    out = pathlib.Path(os.environ["OUT"])
    (out / ("prog-" + os.environ["RANK"] + ".pid")).write_text(str(os.getpid()))
    deadline = time.time() + 120
    while not (out / "go").exists() and time.time() < deadline:
        time.sleep(0.05)
""")

# task: callable, the same through the chain the command task uses: the rank (the callable)
# starts a program through child_dies_with_me and waits for it
ENTRY = textwrap.dedent("""
    import os, subprocess, sys
    from hpcgpu.procs import child_dies_with_me

    def main(ctx):
        os.environ["RANK"] = str(ctx.rank)
        argv = child_dies_with_me([sys.executable, os.environ["PROGRAM"]])
        return subprocess.Popen(argv).wait()
""")


# --- processes, seen through /proc ---------------------------------------------------------------

def alive(pid: int) -> bool:
    """A live process (a zombie counts as gone: it runs nothing and holds no file)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def rank_pids(marker: str) -> list[int]:
    """Live `hpcgpu run` processes whose spec path contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in cmd]
        if "hpcgpu" in args and "run" in args and any(marker in a for a in args) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def program_pids(out: Path, ranks: int) -> list[int] | None:
    files = [out / f"prog-{r}.pid" for r in range(ranks)]
    if not all(f.exists() and f.read_text() for f in files):
        return None
    return [int(f.read_text()) for f in files]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after `timeout` seconds (polling), [] when all are gone."""
    wait_for(lambda: not any(alive(p) for p in pids), timeout=timeout, interval=0.05)
    return [p for p in pids if alive(p)]


# --- specs ---------------------------------------------------------------------------------------

def command_job(folder: Path, name: str, ranks: int = 2) -> Path:
    (folder / "program.py").write_text(PROGRAM)
    return write_spec_file(folder, {
        "name": name, "task": "command", "resources": {"gpus": ranks, "cpus_per_gpu": 1},
        "command": [sys.executable, str(folder / "program.py")], "env": {"OUT": str(folder)}})


def callable_job(folder: Path, name: str) -> Path:
    (folder / "program.py").write_text(PROGRAM)
    (folder / "orphan_entry.py").write_text(ENTRY)
    return write_spec_file(folder, {
        "name": name, "task": "callable", "resources": {"gpus": 2, "cpus_per_gpu": 1},
        "entry": "orphan_entry:main",
        "env": {"PYTHONPATH": str(folder), "OUT": str(folder), "PROGRAM": str(folder / "program.py")}})


def start(cmd: list[str], folder: Path, log: str = "launcher.out") -> subprocess.Popen:
    with open(folder / log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=job_env(), cwd=folder,
                                start_new_session=True)


def wait_started(proc: subprocess.Popen, folder: Path, ranks: int, log: str = "launcher.out") -> list[int]:
    def started() -> list[int] | None:
        if proc.poll() is not None:
            raise AssertionError(f"ended early ({proc.returncode}): {(folder / log).read_text()}")
        return program_pids(folder, ranks)

    pids = wait_for(started, timeout=90)
    assert pids, f"the programs did not start within 90 s: {(folder / log).read_text()}"
    return pids


# --- the lock ------------------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import subprocess, sys, time
    from hpcgpu.launch import runlock
    lock = runlock.acquire(sys.argv[1], "local-77")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=(lock.fd,))
    print(child.pid, flush=True)
    time.sleep(120)
""")


def test_the_lock_lives_as_long_as_any_process_given_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert not runlock.is_locked(run_dir)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert holder.stdout is not None
        child = int(holder.stdout.readline())
        assert runlock.is_locked(run_dir)
        with pytest.raises(runlock.RunDirLocked) as refused:
            runlock.acquire(run_dir)
        message = str(refused.value)
        assert "\n" not in message and str(run_dir.resolve()) in message
        assert "local-77" in message and f"pid {holder.pid}" in message and "--new" in message
        holder.kill()  # the first holder dies; the process it gave the fd keeps the lock
        holder.wait()
        assert runlock.is_locked(run_dir)
        assert "gone" in str(runlock.RunDirLocked(run_dir))  # its launcher is dead, its ranks still run
        os.kill(child, signal.SIGKILL)
        assert wait_for(lambda: not runlock.is_locked(run_dir), timeout=5), "the kernel did not release the lock"
        with runlock.hold(run_dir, "local-78") as lock:  # free again; re-entrant in one process
            assert runlock.acquire(run_dir) is lock
            runlock.release(lock)
            assert runlock.is_locked(run_dir)
        assert not runlock.is_locked(run_dir)
    finally:
        holder.kill()
        kill_all([child] if child else [])


# --- dying with the parent -----------------------------------------------------------------------

def test_a_rank_whose_launcher_is_already_gone_dies_at_once(tmp_path: Path) -> None:
    code = "from hpcgpu.procs import die_with_parent; print(die_with_parent(), flush=True)"
    env = {**job_env(), PARENT_PID_VAR: str(os.getpid())}  # the right parent: lives on, says True
    ok = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert (ok.returncode, ok.stdout.strip()) == (0, "True"), ok.stderr
    unset = subprocess.run([sys.executable, "-c", code], env=job_env(), capture_output=True, text=True, timeout=30)
    assert (unset.returncode, unset.stdout.strip()) == (0, "False"), unset.stderr
    # the launcher died before the rank asked for the parent-death signal: the rank was re-parented
    env[PARENT_PID_VAR] = "1" if os.getpid() != 1 else "2"
    late = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert late.returncode == -signal.SIGKILL and "launcher (pid" in late.stderr, (late.returncode, late.stderr)


MIDDLE = textwrap.dedent("""
    import subprocess, sys, time
    from hpcgpu.procs import child_dies_with_me
    proc = subprocess.Popen(child_dies_with_me([sys.executable, "-c", "import time; time.sleep(120)"]))
    print(proc.pid, flush=True)
    time.sleep(120)
""")


def test_a_program_started_with_child_dies_with_me_dies_with_its_starter() -> None:
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE], stdout=subprocess.PIPE, text=True)
    grandchild = 0
    try:
        assert middle.stdout is not None
        grandchild = int(middle.stdout.readline())
        # past the shim (its code calls prctl): the program itself runs under that pid now
        assert wait_for(lambda: b"prctl" not in Path(f"/proc/{grandchild}/cmdline").read_bytes(), timeout=10)
        assert alive(grandchild)
        middle.kill()
        middle.wait()
        assert not wait_gone([grandchild], timeout=5), "the program outlived its starter"
    finally:
        middle.kill()
        kill_all([grandchild] if grandchild else [])


# --- end to end: kill -9 of the launcher ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kind", ["command", "callable"])
def test_kill_9_of_the_launcher_takes_the_ranks_and_programs_along(tmp_path: Path, kind: str) -> None:
    marker = str(tmp_path / "runs")
    spec = (command_job if kind == "command" else callable_job)(tmp_path, f"orphans-{kind}")
    launcher = start(submit_cmd(spec), tmp_path)
    ranks: list[int] = []
    programs: list[int] = []
    try:
        programs = wait_started(launcher, tmp_path, 2)
        ranks = rank_pids(marker)
        assert len(ranks) == 2, ranks
        run_dir = next((tmp_path / "runs" / f"orphans-{kind}").iterdir())
        locked = runlock.is_locked(run_dir)
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher only, not its process group
        killed = time.monotonic()
        launcher.wait()
        left = wait_gone(ranks + programs, timeout=5)
        print(f"kill -9 of the launcher to all ranks and programs gone ({kind}): {time.monotonic() - killed:.2f} s")
        assert not left, f"still alive 5 s after the launcher's SIGKILL: ranks {ranks}, programs {programs}: {left}"
        assert locked, "the run dir was not locked while the job ran"
        assert wait_for(lambda: not runlock.is_locked(run_dir), timeout=5), "the run dir is still locked"
    finally:
        launcher.kill()
        kill_all(ranks + programs + rank_pids(marker))


@pytest.mark.slow
def test_kill_9_of_the_queue_takes_its_jobs_along(tmp_path: Path) -> None:
    command_job(tmp_path, "queued", ranks=1)
    (tmp_path / "jobs.queue").write_text("queued.yaml\n")
    queue = start([sys.executable, "-m", "hpcgpu", "queue", str(tmp_path / "jobs.queue"), "--gpus", "0"], tmp_path)
    ranks: list[int] = []
    programs: list[int] = []
    try:
        programs = wait_started(queue, tmp_path, 1)
        ranks = rank_pids(str(tmp_path / "runs"))
        assert len(ranks) == 1, ranks
        launchers = children(queue.pid)
        assert launchers
        os.kill(queue.pid, signal.SIGKILL)
        queue.wait()
        left = wait_gone(launchers + ranks + programs, timeout=5)
        assert not left, f"still alive 5 s after the queue's SIGKILL: {left}"
    finally:
        queue.kill()
        kill_all(ranks + programs + rank_pids(str(tmp_path / "runs")))


# --- one live job per run dir --------------------------------------------------------------------

def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_second_job_on_a_locked_run_dir_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    marker = str(tmp_path / "runs")
    spec = command_job(tmp_path, "twice")
    first = start(submit_cmd(spec), tmp_path)
    try:
        wait_started(first, tmp_path, 2)
        run_dir = next((tmp_path / "runs" / "twice").iterdir())
        before = snapshot(tmp_path / "runs")
        second = submit(spec, timeout=60)  # the same command again: it would resume into run_dir
        assert second.returncode == 2, second.stdout + second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hpcgpu: error: "), second.stderr
        assert str(run_dir) in lines[0] and "a live job still writes this run dir" in lines[0]
        assert "hpcgpu cancel local-" in lines[0] and "--new" in lines[0]
        assert snapshot(tmp_path / "runs") == before  # nothing written, no run dir made
        assert first.poll() is None and len(rank_pids(marker)) == 2  # the first job never noticed

        (tmp_path / "go").write_text("")
        assert first.wait(timeout=60) == 0, (tmp_path / "launcher.out").read_text()
        assert not runlock.is_locked(run_dir)  # released when the job ended
        assert (run_dir / "FINISHED").exists()
    finally:
        (tmp_path / "go").write_text("")
        first.kill()
        kill_all(rank_pids(marker))


@pytest.mark.slow
def test_the_same_command_resumes_once_the_orphans_are_gone(tmp_path: Path) -> None:
    """After kill -9 of the launcher, running the same command again resumes the run dir (its ranks
    are dead, the lock is free): the resume the issue saw, now with no second writer."""
    marker = str(tmp_path / "runs")
    spec = command_job(tmp_path, "again")
    first = start(submit_cmd(spec), tmp_path)
    try:
        programs = wait_started(first, tmp_path, 2)
        ranks = rank_pids(marker)
        run_dir = next((tmp_path / "runs" / "again").iterdir())
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert not wait_gone(ranks + programs, timeout=5), "the first job's processes outlived its launcher"
        assert wait_for(lambda: not runlock.is_locked(run_dir), timeout=5)
        (tmp_path / "go").write_text("")
        again = submit(spec, timeout=60)
        assert again.returncode == 0, again.stderr
        assert f"resuming the unfinished run {run_dir}" in again.stderr
        assert [p for p in (tmp_path / "runs" / "again").iterdir()] == [run_dir]
    finally:
        (tmp_path / "go").write_text("")
        first.kill()
        kill_all(rank_pids(marker))
