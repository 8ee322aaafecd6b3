"""The local executor: one process per rank with the environment SLURM gives, exit codes passed
through, one failing rank ends the job, Ctrl-C leaves no orphans."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpcgpu.contract import EXIT_STOPPED

from conftest import (job_env, kill_leftovers, rank_processes, submit, submit_all, submit_cmd, train_spec,
                      wait_for, write_spec_file)

pytestmark = pytest.mark.slow

ENV_KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HPCGPU_RUN_DIR"]

ENTRY = '''
import json, os, time
from pathlib import Path

import torch
import torch.distributed as dist

OUT = Path(os.environ["OUT"])


def report(ctx):
    t = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    dist.all_reduce(t)
    (OUT / f"ctx-{ctx.rank}.json").write_text(json.dumps({
        "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size, "is_main": ctx.is_main,
        "device": str(ctx.device), "backend": dist.get_backend(), "sum": t.item(), "run_dir": str(ctx.run_dir)}))
    return 10 + int(t.item())


def smallest(ctx):
    from hpcgpu.runtime.dist import agreed_min

    agreed = agreed_min(40 - 15 * ctx.rank, ctx.device)  # rank 0 has "40", rank 1 "25"
    (OUT / f"min-{ctx.rank}.json").write_text(json.dumps(agreed))
    return agreed


def threads(ctx):
    (OUT / f"threads-{ctx.rank}.json").write_text(json.dumps(torch.get_num_threads()))
    return 0


def crash(ctx):
    if ctx.rank == 1:
        (OUT / "crash-time").write_text(repr(time.time()))
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # waits for rank 1, which never comes
    time.sleep(600)
    return 0


def crash_while_busy(ctx):
    if ctx.rank == 1:
        (OUT / "crash-time").write_text(repr(time.time()))
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(600)  # rank 0 in its own code, not in a collective: SIGTERM only sets the stop flag
    return 0
'''


def command_spec(name: str, code: str, out: Path, gpus: int = 3) -> dict:
    return {"name": name, "task": "command", "resources": {"gpus": gpus, "cpus_per_gpu": 1},
            "command": [sys.executable, "-c", code], "env": {"OUT": str(out)}}


def callable_spec(name: str, entry: str, folder: Path) -> dict:
    (folder / "hpcgpu_test_entry.py").write_text(ENTRY)
    return {"name": name, "task": "callable", "resources": {"gpus": 2, "cpus_per_gpu": 1},
            "entry": f"hpcgpu_test_entry:{entry}", "env": {"PYTHONPATH": str(folder), "OUT": str(folder)}}


@pytest.fixture(scope="module")
def command_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    dump = ("import json, os; json.dump(dict(os.environ), "
            "open(os.path.join(os.environ['OUT'], 'env-' + os.environ['RANK'] + '.json'), 'w'))")
    codes = {
        "envdump": dump,
        "exit7": "import os, sys; sys.exit(7 if os.environ['RANK'] == '1' else 0)",
        "killed": "import os, signal; os.environ['RANK'] == '2' and os.kill(os.getpid(), signal.SIGKILL)",
        # every rank fails on its own at one moment (the same bug in all): none of them was "stopped".
        # A barrier first (a file per rank), then one moment a second after the last rank got there: a
        # fixed time failed where a rank of a loaded machine was still starting when the others exited
        "together": ("import glob, os, sys, time; ready = os.path.join(os.environ['OUT'], 'ready-'); "
                     "open(ready + os.environ['RANK'], 'w').close()\n"
                     "while len(glob.glob(ready + '*')) < 3: time.sleep(0.01)\n"
                     "time.sleep(max(0.0, max(os.path.getmtime(p) for p in glob.glob(ready + '*')) + 1 - time.time()))\n"
                     "sys.exit(3 + int(os.environ['RANK']))"),
    }
    folders = {key: tmp_path_factory.mktemp(key) for key in codes}
    paths = {key: (write_spec_file(folders[key], command_spec(key, code, folders[key])), ())
             for key, code in codes.items()}
    results = submit_all(paths, timeout=60)
    return {key: (results[key], folders[key]) for key in codes}


def test_command_ranks_get_the_torchrun_variables(command_jobs: dict) -> None:
    proc, folder = command_jobs["envdump"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    envs = [json.loads((folder / f"env-{rank}.json").read_text()) for rank in range(3)]
    run_dirs = list((folder / "runs" / "envdump").iterdir())
    assert len(run_dirs) == 1
    for rank, env in enumerate(envs):
        assert all(key in env for key in ENV_KEYS), sorted(set(ENV_KEYS) - set(env))
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank), str(rank), "3", "3")
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert Path(env["HPCGPU_RUN_DIR"]) == run_dirs[0]
        # a number as SLURM's (Lightning parses it), hpcgpu's local-N name beside it
        assert env["SLURM_JOB_ID"].isdigit() and env["HPCGPU_LOCAL_JOB"] == f"local-{env['SLURM_JOB_ID']}"
    ports = {env["MASTER_PORT"] for env in envs}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536


def test_command_exit_code_passes_through(command_jobs: dict) -> None:
    proc, _ = command_jobs["exit7"]
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "exit code 7" in proc.stderr


def test_command_killed_by_a_signal_exits_128_plus_n(command_jobs: dict) -> None:
    proc, _ = command_jobs["killed"]
    assert proc.returncode == 128 + signal.SIGKILL, proc.stdout + proc.stderr


def test_ranks_that_die_on_their_own_each_record_their_failure(command_jobs: dict) -> None:
    """A rank whose program ended on its own before the executor stopped the others is that rank's
    failure (its exit code, a record), not "stopped because rank 0 failed"."""
    from hpcgpu.contract import read_failures

    proc, folder = command_jobs["together"]
    (run_dir,) = (folder / "runs").glob("*/*")
    codes = {f.rank: f.exit_code for f in read_failures(run_dir)}
    assert codes == {0: 3, 1: 4, 2: 5}, (codes, proc.stdout, proc.stderr)
    for rank in (1, 2):
        assert "was stopped because" not in (run_dir / "logs" / f"rank-{rank}.log").read_text()


def test_callable_gets_a_context_and_a_gloo_group(tmp_path: Path) -> None:
    proc = submit(write_spec_file(tmp_path, callable_spec("report", "report", tmp_path)), timeout=90)
    # each rank returns 10 + (1 + 2): the all_reduce happened, and the int became the exit code
    assert proc.returncode == 13, proc.stdout + proc.stderr
    seen = [json.loads((tmp_path / f"ctx-{rank}.json").read_text()) for rank in range(2)]
    run_dir = next((tmp_path / "runs" / "report").iterdir())
    for rank, ctx in enumerate(seen):
        assert ctx == {"rank": rank, "local_rank": rank, "world_size": 2, "is_main": rank == 0, "device": "cpu",
                       "backend": "gloo", "sum": 3.0, "run_dir": str(run_dir)}


def test_ranks_agree_on_the_smallest_value(tmp_path: Path) -> None:
    """What auto-tuning on mixed GPUs relies on: every rank gets the smallest card's memory."""
    proc = submit(write_spec_file(tmp_path, callable_spec("smallest", "smallest", tmp_path)), timeout=90)
    assert proc.returncode == 25, proc.stdout + proc.stderr
    assert [json.loads((tmp_path / f"min-{rank}.json").read_text()) for rank in range(2)] == [25, 25]


@pytest.mark.parametrize("ranks, cpus, omp", [(2, "all", None), (2, "all", "all"), (1, 1, None)],
                         ids=["two-ranks-share", "omp-decides", "one-rank-gets-its-cpus"])
def test_cpu_ranks_on_one_machine_share_its_cores(tmp_path: Path, ranks: int, cpus: int | str,
                                                  omp: str | None) -> None:
    """The thread rule of docs/running.md: a rank runs SLURM_CPUS_PER_TASK (cpus_per_gpu) torch threads; CPU ranks
    sharing the machine take at most their share of its cores, and say so (oversubscribed OpenMP
    threads wait for each other); OMP_NUM_THREADS, where set, decides."""
    cores = os.cpu_count() or 1
    spec = callable_spec("threads", "threads", tmp_path)
    spec["resources"].update(gpus=ranks, cpus_per_gpu=cores if cpus == "all" else cpus)
    env = job_env()
    del env["OMP_NUM_THREADS"]
    if omp is not None:
        env["OMP_NUM_THREADS"] = str(cores)
    proc = submit(write_spec_file(tmp_path, spec), timeout=90, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expect = cores if omp else 1 if ranks == 1 else max(1, cores // ranks)
    assert [json.loads((tmp_path / f"threads-{rank}.json").read_text()) for rank in range(ranks)] == [expect] * ranks
    log = (next((tmp_path / "runs" / "threads").iterdir()) / "logs" / "rank-0.log").read_text()
    shared = f"2 ranks share this machine's {cores} cores: {cores // 2} torch thread(s) per rank"
    assert (shared in log) == (ranks == 2 and not omp and cores > 1), log[-2000:]


@pytest.mark.parametrize("entry", ["crash", "crash_while_busy"])
def test_a_crashing_rank_ends_the_job(tmp_path: Path, entry: str) -> None:
    """Rank 1 raises; rank 0 waits in a barrier (gloo notices) or sleeps (the executor must kill it)."""
    marker = str(tmp_path / "runs")
    proc = submit(write_spec_file(tmp_path, callable_spec("crash", entry, tmp_path)), timeout=90)
    ended = time.time()
    try:
        assert proc.returncode == 1, proc.stdout + proc.stderr  # rank 1's own exit code
        elapsed = ended - float((tmp_path / "crash-time").read_text())
        print(f"crash-to-exit ({entry}): {elapsed:.1f} s")
        assert elapsed < 30, f"the job took {elapsed:.1f} s to end after rank 1 crashed"
        rank1_log = next((tmp_path / "runs" / "crash").glob("*/logs/rank-1.log")).read_text()
        assert "rank 1 fails on purpose" in rank1_log
        assert not rank_processes(marker)
    finally:
        kill_leftovers(marker)


def start_long_train(tmp_path: Path, name: str, *args: str, wrap: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
    """A 100000-step train job under `hpcgpu submit` (in `wrap`, e.g. `timeout 280`), in a process group
    of its own, once its first step is logged."""
    spec = train_spec(name, train={"max_steps": 100000, "warmup_steps": 2})
    path = write_spec_file(tmp_path, spec)
    log = open(tmp_path / f"{name}.out", "w")
    proc = subprocess.Popen([*wrap, *submit_cmd(path, *args)], stdout=log, stderr=subprocess.STDOUT, env=job_env(),
                            cwd=tmp_path, start_new_session=True)
    log.close()

    def first_metrics() -> Path | None:
        for m in (tmp_path / "runs" / name).glob("*/metrics.jsonl"):
            if '"kind": "train"' in m.read_text():
                return m
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early ({proc.returncode}): {(tmp_path / f'{name}.out').read_text()}")
        return None

    try:
        metrics = wait_for(first_metrics, timeout=60)
        assert metrics, "no train metrics within 60 s"
    except BaseException:  # the caller's cleanup never runs: a 100000-step job must not outlive the test
        stop(proc, str(tmp_path / "runs"))
        raise
    return proc, metrics.parent


def stop(proc: subprocess.Popen, marker: str) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kill_leftovers(marker)


def test_a_rank_killed_mid_training_ends_the_job(tmp_path: Path) -> None:
    marker = str(tmp_path / "runs")
    proc, run_dir = start_long_train(tmp_path, "killrank")
    try:
        ranks = rank_processes(marker)
        assert len(ranks) == 2
        victim = next(p for p in ranks if p.environ().get("SLURM_PROCID") == "1")
        victim.kill()
        killed = time.monotonic()
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - killed
        print(f"crash-to-exit (train, rank 1 SIGKILL): {elapsed:.1f} s, exit {code}")
        assert code != 0
        assert elapsed < 30, f"the job took {elapsed:.1f} s to end after rank 1 was killed"
        assert not rank_processes(marker)
        assert not (run_dir / "model").exists()
    finally:
        stop(proc, marker)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ctrl_c_leaves_no_rank_behind(tmp_path: Path) -> None:
    marker = str(tmp_path / "runs")
    proc, run_dir = start_long_train(tmp_path, "ctrlc", "--new")
    try:
        pids = [p.pid for p in rank_processes(marker)]
        assert len(pids) == 2
        os.kill(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        gone = wait_for(lambda: not any(alive(pid) for pid in pids), timeout=30)
        elapsed = time.monotonic() - sent
        print(f"Ctrl-C to all ranks gone: {elapsed:.1f} s")
        assert gone, f"rank processes still alive 30 s after Ctrl-C: {rank_processes(marker)}"
        assert proc.wait(timeout=30) == 75
        assert not rank_processes(marker)
        # submitted with --new: the same command would start afresh elsewhere, so the hint drops it
        out = (tmp_path / "ctrlc.out").read_text()
        assert "; run the same command without --new to go on" in out
        assert "exited with code 75" not in out  # a rank stopping at a checkpoint is no failure to announce
    finally:
        stop(proc, marker)


def test_one_interrupt_to_a_group_under_timeout_is_one_stop_at_a_checkpoint(tmp_path: Path) -> None:
    """One Ctrl-C to a shell's foreground group holding `timeout 280 hpcgpu submit ...`: `timeout`
    passes it on and signals its group again, so the executor gets it three times within milliseconds.
    That is one person's stop: the ranks checkpoint (exit 75, a stop record, step-N), not killed."""
    marker = str(tmp_path / "runs")
    proc, run_dir = start_long_train(tmp_path, "group", "--new", wrap=("timeout", "280"))
    try:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=90) == EXIT_STOPPED, (tmp_path / "group.out").read_text()[-2000:]
        out = (tmp_path / "group.out").read_text()
        assert out.count("asking all ranks to checkpoint and stop") == 1 and "killing" not in out, out[-2000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        (stop_record,) = [r for r in records if r.get("kind") == "stop"]
        assert (run_dir / "checkpoints" / f"step-{stop_record['step']:08d}" / "COMPLETE").is_file()
        assert not rank_processes(marker)
    finally:
        stop(proc, marker)


def test_a_second_interrupt_after_the_window_kills_and_copies_within_it_do_not(tmp_path: Path) -> None:
    """A program that ignores the stop signal keeps its ranks running: two interrupts at once are one
    stop (nothing killed); one SAME_STOP_S later is a person's second Ctrl-C: it kills (130), and the
    job is CANCELLED, not FAILED."""
    from hpcgpu.stopwindow import SAME_STOP_S

    code = ("import os, signal, time; [signal.signal(s, signal.SIG_IGN) for s in "
            "(signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)]; "
            "open(os.path.join(os.environ['OUT'], 'up-' + os.environ['RANK']), 'w').close(); time.sleep(300)")
    path = write_spec_file(tmp_path, command_spec("deaf", code, tmp_path, gpus=2))
    log = open(tmp_path / "deaf.out", "w")
    proc = subprocess.Popen(submit_cmd(path, "--new"), stdout=log, stderr=subprocess.STDOUT, env=job_env(),
                            cwd=tmp_path, start_new_session=True)
    log.close()
    marker = str(tmp_path / "runs")
    try:
        assert wait_for(lambda: len(list(tmp_path.glob("up-*"))) == 2, timeout=60), (tmp_path / "deaf.out").read_text()
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.3)  # (two at once would reach Python's handler once)
        os.kill(proc.pid, signal.SIGTERM)  # a relayed copy: `timeout` and srun pass a stop on as SIGTERM
        time.sleep(SAME_STOP_S + 0.5)
        out = (tmp_path / "deaf.out").read_text()
        assert proc.poll() is None and "killing" not in out, out[-2000:]
        assert len(rank_processes(marker)) == 2
        os.kill(proc.pid, signal.SIGINT)  # the person's second Ctrl-C
        assert proc.wait(timeout=60) == 130
        out = (tmp_path / "deaf.out").read_text()
        assert "second interrupt: killing all ranks" in out
        assert "cancelled (killed at a second interrupt; the same command goes on from its last complete " \
               "checkpoint)" in out and "failed" not in out, out[-2000:]
        assert not rank_processes(marker)
        status = subprocess.run([sys.executable, "-m", "hpcgpu", "list", "--json"], capture_output=True,
                                text=True, env=job_env(), cwd=tmp_path, timeout=60)
        (run_dir,) = (tmp_path / "runs" / "deaf").iterdir()
        (job,) = [j for j in json.loads(status.stdout) if j["run_dir"] == str(run_dir.resolve())]
        assert job["state"] == "CANCELLED" and "second interrupt" in job["reason"]
    finally:
        stop(proc, marker)


def hpcgpu(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True,
                          env=env or job_env(), cwd=tmp_path, timeout=120)


def job_of(tmp_path: Path, name: str) -> str:
    """The local job id `submit` announced in its output."""
    found = re.search(r"job (local-\d+) \(local\)", (tmp_path / f"{name}.out").read_text())
    assert found, (tmp_path / f"{name}.out").read_text()
    return found.group(1)


def test_cancel_checkpoints_and_status_says_how_to_go_on_and_the_resume_says_where_from(tmp_path: Path) -> None:
    """`hpcgpu cancel` says it checkpoints first; status names the checkpoint and the exact command that
    resumes it; that command (at another width) resumes, and the new job's status says from where."""
    marker = str(tmp_path / "runs")
    proc, run_dir = start_long_train(tmp_path, "cancelme")
    try:
        job = job_of(tmp_path, "cancelme")
        done = hpcgpu(tmp_path, "cancel", job)
        assert done.stdout.strip() == (f"asked {job} to stop: it stops at its next checkpoint; "
                                       f"`hpcgpu cancel --now {job}` stops it without one"), done.stdout + done.stderr
        assert proc.wait(timeout=90) == EXIT_STOPPED
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        step = next(r["step"] for r in records if r.get("kind") == "stop")
        status = hpcgpu(tmp_path, "status", job).stdout
        assert "state     CANCELLED" in status and f"hpcgpu cancel: stopped at step {step}" in status, status
        assert f"saved     {run_dir / 'checkpoints' / f'step-{step:08d}'} (step {step}, the newest complete " \
               "checkpoint)" in status, status
        command = f"hpcgpu submit {tmp_path / 'cancelme.yaml'} --executor local"
        assert f"go on     {command} (resumes this run dir)" in status, status
        assert hpcgpu(tmp_path, "cancel", job).stdout.strip() == f"{job} already ended (CANCELLED)"
        # the command status gave, at 1 rank instead of 2, stopped again right after its first step
        again = hpcgpu(tmp_path, *command.split()[1:], "--gpus", "1", env=job_env(HPCGPU_SIGNAL_AT=str(step + 1)))
        assert again.returncode == EXIT_STOPPED and f"resuming the unfinished run {run_dir} from step {step}" \
            in again.stderr, again.stderr[-2000:]
        resumed = re.search(r"job (local-\d+) \(local\)", again.stderr).group(1)  # type: ignore[union-attr]
        assert f"resumed   from step {step} (at 1 GPU, was 2)" in hpcgpu(tmp_path, "status", resumed).stdout
        assert "resumed" not in hpcgpu(tmp_path, "status", job).stdout  # the earlier job did not resume
    finally:
        stop(proc, marker)


def test_cancel_now_kills_without_a_checkpoint(tmp_path: Path) -> None:
    marker = str(tmp_path / "runs")
    proc, run_dir = start_long_train(tmp_path, "cancelnow")
    try:
        job = job_of(tmp_path, "cancelnow")
        done = hpcgpu(tmp_path, "cancel", "--now", job)
        assert done.returncode == 0 and "now, without a checkpoint" in done.stdout, done.stdout + done.stderr
        assert proc.wait(timeout=60) == 130
        assert not rank_processes(marker)
        assert '"kind": "stop"' not in (run_dir / "metrics.jsonl").read_text()
        assert not list((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").exists() else True
        (view,) = [j for j in json.loads(hpcgpu(tmp_path, "list", "--json").stdout) if j["id"] == job]
        assert (view["state"], view["reason"]) == ("CANCELLED", "hpcgpu cancel: killed without a checkpoint")
    finally:
        stop(proc, marker)


def test_ranks_that_fail_together_are_all_named(tmp_path: Path) -> None:
    """Two ranks that exit before the executor looks: naming only the first one it polls (rank 0)
    contradicted the failure records, which said rank 1 failed first."""
    from hpcgpu.contract import Failure, record_failure
    from hpcgpu.launch.local import Rank, wait_ranks
    from hpcgpu.spec import spec_from_raw

    ranks = []
    for i, code in enumerate(["raise SystemExit(2)", "raise SystemExit(2)", "import time; time.sleep(60)"]):
        log = open(tmp_path / f"rank-{i}.log", "w")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, start_new_session=True)
        ranks.append(Rank(i, proc, log))
    for r in ranks[:2]:
        r.proc.wait()
    # rank 1 recorded its failure (and printed the job's one error line) before rank 0 did: its log's
    # end is what the console is shown, whichever rank the executor happened to poll first
    for r in ranks:
        r.run_dir, r.attempt = tmp_path, "local-1.0"
    for rank, at in ((1, 100.0), (0, 101.0)):
        record_failure(tmp_path, Failure("local-1.0", rank, "n", 2, "cannot load", at))
    ranks[1].log.write("hpcgpu: error: model.name_or_path: cannot load\n")
    ranks[1].log.flush()
    said: list[str] = []
    spec = spec_from_raw(command_spec("both", "", tmp_path) | {"runs_dir": str(tmp_path)})
    assert wait_ranks(ranks, spec, said.append) == 2
    assert said[0] == "ranks 0, 1 exited with codes 2, 2; stopping the other ranks"
    assert "rank 1 exited with code 2; the end of its log" in said[-2], said
    assert said[-1] == "error: model.name_or_path: cannot load", said  # printed as hpcgpu: error: ..., unindented
    assert ranks[2].proc.returncode == -signal.SIGTERM  # the one still running was stopped


def test_command_ranks_get_a_thread_cap_unless_the_user_set_one(tmp_path: Path, monkeypatch) -> None:
    """OpenMP and MKL in a command rank take the rank's cores (cpus_per_gpu, at most its share of the
    node's), not every core of the machine; a value the user set (the shell, env:) is kept."""
    import dataclasses

    from hpcgpu.contract import RunPaths
    from hpcgpu.runtime.env import DistEnv
    from hpcgpu.runtime.tasks.command import command_env
    from hpcgpu.spec import spec_from_raw

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    env = dataclasses.replace(DistEnv.from_environ(), local_world_size=2)
    spec = spec_from_raw(command_spec("threads", "pass", tmp_path, gpus=2), need_data=False)
    out = command_env(spec, tmp_path / "spec.yaml", RunPaths(tmp_path), env)
    assert out["OMP_NUM_THREADS"] == out["MKL_NUM_THREADS"] == "1"
    spec = spec_from_raw({**command_spec("threads", "pass", tmp_path, gpus=2), "env": {"OMP_NUM_THREADS": "3"}},
                         need_data=False)
    out = command_env(spec, tmp_path / "spec.yaml", RunPaths(tmp_path), env)
    assert out["OMP_NUM_THREADS"] == "3" and out["MKL_NUM_THREADS"] == "1"


@pytest.mark.parametrize("signal_spec, allowed", [("USR2@120", 110), ("B:USR1@60", 50), ("USR2@16", 12), ("TERM@0", 10)])
def test_a_command_program_gets_the_signal_s_lead_less_a_margin_to_stop(signal_spec: str, allowed: float) -> None:
    """As docs/preemption.md gives them: 10 s before SLURM's kill, a quarter of a short lead, 10 s at least."""
    from hpcgpu.runtime.tasks.command import stop_allowance_s
    from hpcgpu.spec import spec_from_raw

    spec = spec_from_raw({"name": "c", "task": "command", "command": ["true"], "slurm": {"signal": signal_spec}})
    assert stop_allowance_s(spec) == allowed
