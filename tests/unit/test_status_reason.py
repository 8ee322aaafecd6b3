"""`hpcgpu status` tells the truth: why a job FAILED (rank, node, exit code or signal, last error line),
elapsed and GPU time over all runs of a requeued job, and no nodes while it waits again."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcgpu.cli import cli
from hpcgpu.launch import progress
from hpcgpu.launch import state as jobs_mod
from hpcgpu.launch.executors import refresh
from hpcgpu.contract import Failure, record_failure
from hpcgpu.launch.joblogs import first_failed_task, last_line, rank_error_line, tail_lines
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.scheduler import JobInfo, format_duration, parse_sacct, parse_squeue

# What a 2-node job's slurm-<id>.err holds after rank 1 crashed (srun --label, --kill-on-bad-exit=1).
CRASH_ERR = """\
0: [W socket.cpp:464] [c10d] The server socket has failed to listen on [::]:17007 (errno: 98).
1: Traceback (most recent call last):
1:   File "/home/alice/train.py", line 88, in <module>
1:     main()
1:   File "/home/alice/train.py", line 71, in main
1:     loss.backward()
1: RuntimeError: CUDA error: an illegal memory access was encountered
srun: error: n2: task 1: Exited with exit code 3
srun: launch/slurm: _step_signal: Terminating StepId=7.0
0: slurmstepd-n1: error: *** STEP 7.0 ON n1 CANCELLED AT 2026-11-26T11:05:38 ***
srun: error: n1: task 0: Exited with exit code 143
"""
# An earlier run stopped at a checkpoint (exit 75) and was requeued; --open-mode=append keeps it.
REQUEUED_THEN_KILLED_ERR = """\
0: hpcgpu: stop signal USR2: checkpoint at step 40, then requeue
srun: error: n1: tasks 0-1: Exited with exit code 75
0: resuming from step 40
srun: error: n1: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=8.0
srun: error: n1: task 0: Terminated
"""


@pytest.mark.parametrize("text, rank, node, code", [
    (CRASH_ERR, 1, "n2", 3),
    (REQUEUED_THEN_KILLED_ERR, 1, "n1", 137),
    ("srun: error: n2: tasks 2-3: Exited with exit code 1\nsrun: error: n1: tasks 0-1: Exited with exit code 1\n",
     2, "n2", 1),
    ("srun: error: gpu-a17: task 5: Segmentation fault (core dumped)\n", 5, "gpu-a17", 139),
    ("srun: error: n1: task 0: Out Of Memory\n", 0, "n1", 137),
])
def test_srun_lines_name_the_first_failed_rank(text, rank, node, code):
    task = first_failed_task(text.splitlines())
    assert task is not None and (task.rank, task.node, task.exit_code) == (rank, node, code)


def test_no_srun_line_no_task():
    assert first_failed_task(["0: hello", "srun: error: Unable to create step for job 9: Job/step already completing"]) is None


def test_the_last_error_line_of_a_rank_skips_scheduler_lines():
    lines = CRASH_ERR.splitlines()
    assert rank_error_line(1, lines) == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert rank_error_line(0, lines).startswith("[W socket.cpp:464]")  # not slurmstepd's CANCELLED line
    assert rank_error_line(3, lines) == ""
    # srun pads labels to the widest rank
    assert last_line([" 3: ValueError: x", "13: other", " 3: "], rank=3) == "ValueError: x"
    # the batch script's own lines have no label
    assert last_line(["0: hi", "slurm_script: line 12: module: command not found", "srun: error: x"],
                     rank=None) == "slurm_script: line 12: module: command not found"
    # the GPU monitor's summary, written after the program died, is not the error
    assert last_line(["Traceback (most recent call last):", "ValueError: bad batch",
                      "12:00:01 [rank 0] gpu monitor: gpu 2: util mean 3% peak 9% | memory peak 0.5/79.6 GiB"],
                     rank=-1) == "ValueError: bad batch"
    assert last_line(["0: ValueError: bad batch", "0: 12:00:01 gpu monitor: gpu 0: util mean 1%"],
                     rank=0) == "ValueError: bad batch"


def test_only_the_tail_of_a_log_is_read(tmp_path):
    log = tmp_path / "slurm-1.err"
    log.write_text("0: " + "x" * 5_000_000 + "\n1: the end\n")
    assert tail_lines(log, max_bytes=100) == ["1: the end"]  # the cut line is dropped, not misread
    assert tail_lines(tmp_path / "missing.err") == []


# --- the registry and the CLI ---------------------------------------------------------------------

@pytest.fixture
def env(tmp_path, monkeypatch):
    """A registry of its own and a fake squeue whose answers a test sets."""
    monkeypatch.setenv("HPCGPU_REGISTRY", str(tmp_path / "jobs.db"))
    answers: dict[str, JobInfo] = {}
    monkeypatch.setattr(jobs_mod, "query_jobs", lambda ids: dict(answers))
    return answers


def cli_json(*args: str) -> dict | list:
    done = CliRunner().invoke(cli, [*args, "--json"])
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


def slurm_job(tmp_path: Path, job_id: str = "7", **more) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    Registry().add(JobRecord(job_id, "exp", "/s.yaml", str(run_dir), "slurm", state="RUNNING", **more))
    return run_dir


def failure(rank: int, node: str, code: int, attempt: str = "7.0", message: str = "") -> Failure:
    return Failure(attempt, rank, node, code, message, time.time())


def test_status_says_which_rank_failed_where_how_and_its_last_error_line(tmp_path, env):
    run_dir = slurm_job(tmp_path)
    (run_dir / "slurm-7.err").write_text(CRASH_ERR)
    record_failure(run_dir, failure(1, "n2", 3))  # the rank's own record: no message known
    env["7"] = JobInfo("7", "FAILED", elapsed="2:05", nodes="n[1-2]", exit_code=143)
    view = cli_json("status", "7")
    assert view["state"] == "FAILED"
    assert view["failure"] == {"rank": 1, "node": "n2", "exit_code": 3, "signal": None,
                               "message": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert view["reason"] == ("rank 1 on n2 failed with exit code 3: "
                              "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert cli_json("list")[0]["reason"] == view["reason"]
    text = CliRunner().invoke(cli, ["status", "7"]).output
    assert "state     FAILED (rank 1 on n2, exit 3)\n" in text
    assert "reason    rank 1 on n2 failed with exit code 3: RuntimeError: CUDA error" in text
    assert "FAILED (rank 1 on n2, exit 3)" in CliRunner().invoke(cli, ["list"]).output


def test_a_record_with_a_message_wins_and_a_stale_one_does_not_speak(tmp_path, env):
    run_dir = slurm_job(tmp_path)
    (run_dir / "slurm-7.err").write_text(REQUEUED_THEN_KILLED_ERR)
    record_failure(run_dir, failure(0, "n1", 1, attempt="7.0", message="old crash, retried"))
    env["7"] = JobInfo("7", "FAILED", restarts=1, nodes="n1", exit_code=0)
    view = cli_json("status", "7")  # run 1 wrote no record (SIGKILL): srun's lines tell
    assert view["failure"]["rank"] == 1 and view["failure"]["exit_code"] == 137
    assert view["failure"]["signal"] == "SIGKILL"
    assert view["reason"].startswith("rank 1 on n1 failed with exit code 137 (SIGKILL)")

    run_dir2 = tmp_path / "run2"
    run_dir2.mkdir()
    Registry().add(JobRecord("8", "exp", "/s.yaml", str(run_dir2), "slurm", state="RUNNING"))
    record_failure(run_dir2, failure(2, "n2", 1, attempt="8.0", message="ValueError: bad shard"))
    env["8"] = JobInfo("8", "FAILED", nodes="n[1-2]", exit_code=1)
    assert cli_json("status", "8")["reason"] == "rank 2 on n2 failed with exit code 1: ValueError: bad shard"


def test_without_ranks_the_exit_code_and_the_batch_scripts_last_line(tmp_path, env):
    run_dir = slurm_job(tmp_path)
    (run_dir / "slurm-7.err").write_text("/var/spool/slurmd/job00007/slurm_script: line 14: module: command not found\n")
    env["7"] = JobInfo("7", "FAILED", exit_code=127)
    view = cli_json("status", "7")
    assert view["failure"] is None
    assert view["reason"] == "exit code 127: /var/spool/slurmd/job00007/slurm_script: line 14: module: command not found"


def test_array_task_and_local_job_reasons(tmp_path, env):
    sweep = tmp_path / "sweep"
    (sweep / "1").mkdir(parents=True)
    (sweep / "1" / "slurm-9_1.err").write_text("0: KeyError: 'text'\nsrun: error: n1: task 0: Exited with exit code 1\n")
    tasks = [TaskRecord("9_0", str(sweep / "0")), TaskRecord("9_1", str(sweep / "1"))]
    Registry().add(JobRecord("9", "exp", "/s.yaml", str(sweep), "slurm", state="RUNNING", tasks=tasks))
    env.update({"9_0": JobInfo("9_0", "COMPLETED", exit_code=0), "9_1": JobInfo("9_1", "FAILED", exit_code=1)})
    view = cli_json("status", "9_1")
    assert view["reason"] == "rank 0 on n1 failed with exit code 1: KeyError: 'text'"
    assert cli_json("status", "9")["reason"] == "task 9_1: rank 0 on n1 failed with exit code 1: KeyError: 'text'"

    run_dir = tmp_path / "local"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank-1.log").write_text("step 3\nTraceback (most recent call last):\nOSError: disk full\n\n")
    job = Registry().add(JobRecord("", "exp", "/s.yaml", str(run_dir), "local", state="FAILED", reason="exit code 1",
                                   exit_code=1))
    record_failure(run_dir, failure(1, "laptop", 1, attempt=f"{job.job_id}.0"))
    assert cli_json("status", job.job_id)["reason"] == "rank 1 on laptop failed with exit code 1: OSError: disk full"


def test_elapsed_and_gpu_time_add_up_every_run_and_a_requeued_job_has_no_nodes(tmp_path, env):
    slurm_job(tmp_path, job_id="5")
    t0 = time.time() - 1000

    def look(info: JobInfo) -> dict:
        env["5"] = info
        return cli_json("status", "5")

    view = look(JobInfo("5", "RUNNING", elapsed="0:40", nodes="n1", start=t0, gpus=4))
    assert (view["elapsed"], view["nodes"], view["gpus"]) == ("0:40", "n1", 4)
    # SLURM tears the run down: still COMPLETING, restarts already 1, times not settled yet
    view = look(JobInfo("5", "COMPLETING", elapsed="0:00", nodes="n1", restarts=1, start=t0 + 100))
    assert (view["state"], view["nodes"], view["elapsed"]) == ("REQUEUED", "", "0:40")
    # waiting again: SubmitTime is the requeue, so run 0 lasted 100 s (last seen at 40 s)
    view = look(JobInfo("5", "PENDING", "BeginTime", elapsed="0:00", restarts=1, submit=t0 + 100, gpus=4))
    assert (view["state"], view["nodes"], view["elapsed"]) == ("REQUEUED", "", "1:40")
    view = look(JobInfo("5", "RUNNING", elapsed="0:30", nodes="n2", restarts=1, start=t0 + 130, gpus=4))
    assert (view["elapsed"], view["nodes"], view["elapsed_s"]) == ("2:10", "n2", 130)
    view = look(JobInfo("5", "COMPLETED", elapsed="1:00", nodes="n2", restarts=1, exit_code=0, gpus=4))
    assert (view["elapsed"], view["elapsed_s"], view["gpu_hours"]) == ("2:40", 160, round(160 * 4 / 3600, 3))
    assert "gpu time  0.18 GPU-hours (4 GPUs)" in CliRunner().invoke(cli, ["status", "5"]).output
    assert cli_json("list")[0]["gpu_hours"] == view["gpu_hours"]


def test_accounting_totals_win(tmp_path, env):
    slurm_job(tmp_path, job_id="6")
    env["6"] = JobInfo("6", "RUNNING", elapsed="0:10", nodes="n1", restarts=2, gpus=2, total_s=3 * 3600 + 10)
    view = cli_json("status", "6")
    assert (view["elapsed"], view["gpu_hours"]) == ("3:00:10", round((3 * 3600 + 10) * 2 / 3600, 3))


# --- what the scheduler commands print ------------------------------------------------------------

def test_squeue_start_submit_and_gpus():
    got = parse_squeue(
        "11|RUNNING|None|1:02|n[1-2]|0||2026-11-26T11:04:03|2026-11-26T11:04:02|2|gres:gpu:2|N/A|\n"
        "12|PENDING|BeginTime|0:00||1||2026-11-26T11:04:21|2026-11-26T11:04:10|1|gres/gpu:a100:4|N/A|\n"
        "13|RUNNING|None|0:05|n1|0||2026-11-26T11:04:03|2026-11-26T11:04:02|1|N/A|gres:gpu:3|\n")
    assert got["11"].gpus == 4 and got["12"].gpus == 4 and got["13"].gpus == 3
    assert got["11"].start == time.mktime(time.strptime("2026-11-26T11:04:03", "%Y-%m-%dT%H:%M:%S"))
    assert got["12"].start is None  # a pending job's StartTime is only SLURM's guess
    assert got["12"].submit - got["11"].start == 7


def test_sacct_duplicates_sum_the_runs_of_one_job():
    text = ("41|COMPLETED|00:10:00|n1|0:0|600|2026-01-02T08:00:00\n"  # an older job 41, before a controller reset
            "41|REQUEUED|00:05:00|n1|0:0|300|2026-11-26T10:00:00\n"
            "41|PREEMPTED|00:01:40|n2|0:15|100|2026-11-26T10:06:00\n"
            "41|RUNNING|00:00:20|n1|0:0|20|2026-11-26T10:09:00\n"
            "42|FAILED|00:00:05|n2|0:9|5|2026-11-26T10:00:00\n")
    got = parse_sacct(text)
    assert (got["41"].state, got["41"].total_s, got["41"].restarts) == ("RUNNING", 420, 2)
    assert got["42"].exit_code == 137 and got["42"].total_s == 5


@pytest.mark.parametrize("seconds, text", [(5, "0:05"), (125, "2:05"), (3 * 3600 + 7, "3:00:07"),
                                           (2 * 86400 + 3661, "2-01:01:01")])
def test_durations_are_written_as_slurm_writes_them(seconds, text):
    assert format_duration(seconds) == text


def test_one_sacct_call_for_forgotten_and_requeued_jobs(monkeypatch):
    from hpcgpu.launch import scheduler

    calls: list[list[str]] = []
    answers = {"squeue": "30|RUNNING|None|0:20|n1|1||2026-11-26T11:04:03|2026-11-26T11:04:02|1|gres:gpu:2|N/A|\n"
                         "31|RUNNING|None|0:20|n1|0||2026-11-26T11:04:03|2026-11-26T11:04:02|1|gres:gpu:2|N/A|\n",
               "sacct": "30|REQUEUED|00:01:00|n2|0:0|60|2026-11-26T10:00:00\n"
                        "30|RUNNING|00:00:20|n1|0:0|20|2026-11-26T11:04:02\n"
                        "29|COMPLETED|00:05:00|n2|0:0|300|2026-11-26T09:00:00\n"}

    def run(argv):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, answers[argv[0]], "")

    monkeypatch.setattr(scheduler, "run_scheduler", run)
    got = scheduler.query_jobs(["29", "30", "31"])
    assert [c[0] for c in calls] == ["squeue", "sacct"] and calls[1][-1] == "29,30"
    assert got["30"].total_s == 80 and got["30"].state == "RUNNING" and got["30"].gpus == 2
    assert got["31"].total_s is None and got["29"].state == "COMPLETED" and got["29"].elapsed == "00:05:00"


def test_a_stale_copy_of_a_local_job_that_has_ended_takes_its_recorded_result(tmp_path, env):
    """`hpcgpu logs -f` holds the job from before it ended; its refresh must not write FAILED over the
    COMPLETED the local executor saved meanwhile."""
    run_dir = tmp_path / "local"
    run_dir.mkdir()
    registry = Registry()
    held = registry.add(JobRecord("", "exp", "/s.yaml", str(run_dir), "local", state="RUNNING", pid=2**22 + 7))
    finished = registry.find(held.job_id)[0]
    registry.update(finished, state="COMPLETED", exit_code=0, reason="")  # the executor's own word
    refresh(registry, [held])  # its pid is gone and nothing holds the run dir
    assert held.state == "COMPLETED" and held.exit_code == 0
    assert registry.find(held.job_id)[0].state == "COMPLETED"
    assert cli_json("status", held.job_id)["state"] == "COMPLETED"

    killed = registry.add(JobRecord("", "exp", "/s.yaml", str(run_dir), "local", state="RUNNING", pid=2**22 + 7))
    refresh(registry, [killed])  # no word from the executor: it was killed
    assert registry.find(killed.job_id)[0].state == "FAILED"


# rank 1 SIGKILLed mid-run (the OOM killer, `kill -9`): it writes no record; rank 0 then fails in its
# all-reduce and records that
KILLED_THEN_PEER_ERR = """\
srun: error: n1: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=7.0
0: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5845: Connection reset by peer
srun: error: n1: task 0: Exited with exit code 1
"""


def test_a_rank_killed_outright_is_the_failure_not_the_peer_that_recorded_its_error(tmp_path, env):
    run_dir = slurm_job(tmp_path)
    (run_dir / "slurm-7.err").write_text(KILLED_THEN_PEER_ERR)
    record_failure(run_dir, failure(0, "n1", 1, message="RuntimeError: [gloo] Read error: Connection reset by peer"))
    env["7"] = JobInfo("7", "FAILED", nodes="n1", exit_code=1)
    view = cli_json("status", "7")
    assert view["failure"]["rank"] == 1 and view["failure"]["signal"] == "SIGKILL", view
    assert view["reason"].startswith("rank 1 on n1 failed with exit code 137 (SIGKILL)"), view["reason"]


def test_a_run_stopped_at_its_requeue_cap_says_so_not_exit_code_75(tmp_path, env):
    run_dir = slurm_job(tmp_path)
    (run_dir / "slurm-7.out").write_text(
        "0: 10:00:01 [rank 0] timeout: stopped at step 40 with a checkpoint\n"
        "0: 10:00:01 [rank 0] timeout: requeue cap reached (1 of slurm.max_requeues=1); not requeuing\n")
    env["7"] = JobInfo("7", "FAILED", restarts=1, nodes="n1", exit_code=75)
    assert cli_json("status", "7")["reason"] == (
        "stopped at a checkpoint and not requeued (timeout: requeue cap reached (1 of slurm.max_requeues=1); "
        "not requeuing); `scontrol requeue 7` goes on from it")


@pytest.mark.parametrize("stop, said", [
    ({"step": 0, "saved": False}, "stopped before its first step, nothing saved"),
    ({"step": 40, "saved": True}, "stopped at step 40, at its checkpoint"),
    ({"step": 0}, "stopped at step 0, at its checkpoint"),  # ctx.stop of your own loop saves at step 0 too
    ({"rows": 96}, "stopped after 96 rows, all written"),
])
def test_a_stopped_run_says_what_it_kept(tmp_path: Path, stop: dict, said: str) -> None:
    """Exit 75 after Ctrl-C or a preemption: a train run stopped while starting saved nothing, and
    saying "at a checkpoint" would promise a resume that is a fresh start."""
    records = [{"kind": "train", "step": 1}, {"kind": "stop", "reason": "signal", **stop}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert progress.stop_summary(tmp_path) == said
    assert progress.stop_summary(tmp_path / "missing") == "stopped at a checkpoint"


def test_a_job_whose_run_dir_a_later_job_resumed_shows_no_progress_of_the_later_one(tmp_path: Path) -> None:
    """Submitting the same spec again goes on in the run dir: its metrics are the later job's, so the
    earlier row of `list` points at that job instead of showing its step as its own."""
    import subprocess
    import sys

    from hpcgpu.launch.registry import JobRecord, Registry

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 40, "loss": 1.5}) + "\n")
    registry = Registry(tmp_path / "jobs.db")
    registry.add(JobRecord("11", "again", "s.yaml", str(run_dir), "slurm", state="FAILED", submitted=1000.0))
    registry.add(JobRecord("12", "again", "s.yaml", str(run_dir), "slurm", state="COMPLETED", submitted=2000.0))
    out = subprocess.run([sys.executable, "-m", "hpcgpu", "list", "--json"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "HPCGPU_REGISTRY": str(tmp_path / "jobs.db")}, check=True)
    views = {v["id"]: v for v in json.loads(out.stdout)}
    assert views["12"]["step"] == 40 and views["12"].get("resumed_by") is None
    assert views["11"]["step"] is None and views["11"]["resumed_by"] == "12"
