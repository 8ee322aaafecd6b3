"""`hpcgpu queue FILE`: many jobs over a pool of GPUs, never two jobs on one GPU, resumable.

The jobs are `task: command` programs that record the GPUs they were given and when they ran; on
this CPU machine the pool comes from --gpus (or from recorded NVML readings), exactly as the ids of
real GPUs would.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import job_env, kill_leftovers, wait_for, write_spec_file
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.busy import BusyThresholds
from hpcgpu.gpu.readings import RecordedSource
from hpcgpu.launch.queue import GpuWatch
from hpcgpu.launch.registry import Registry

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"

RECORD = """
import json, os, pathlib, signal, sys, time
out = pathlib.Path(os.environ["OUT"]) / (os.environ["JOB"] + ".json")
start = time.time()
def stop(*_):
    out.with_suffix(".stopped").write_text("")
    sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGUSR2):  # whichever stop signal the spec gives
    signal.signal(sig, stop)
pathlib.Path(os.environ["OUT"], os.environ["JOB"] + ".started").write_text("")
override = out.with_suffix(".seconds")  # lets a test shorten a rerun without changing the spec
if os.environ.get("WAIT_FOR"):  # run until another job has written its record (at most 30 s)
    while not pathlib.Path(os.environ["WAIT_FOR"]).exists() and time.time() < start + 30:
        time.sleep(0.05)
else:
    time.sleep(float(override.read_text() if override.exists() else os.environ.get("SECONDS_TO_RUN", "2")))
out.write_text(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time()}))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def job_spec(folder: Path, name: str = "job", seconds: float = 2.0, exit_code: int = 0) -> Path:
    (folder / "record.py").write_text(RECORD)
    return write_spec_file(folder, {
        "name": name, "task": "command", "resources": {"gpus": 1, "cpus_per_gpu": 1},
        "command": [sys.executable, str(folder / "record.py")],
        "env": {"OUT": str(folder), "JOB": name, "SECONDS_TO_RUN": str(seconds), "EXIT": str(exit_code)}})


def queue_cmd(queue_file: Path, *args: str) -> list[str]:
    """Readings (and looks at the jobs) every 0.2 s: short tests; a recorded timeline steps per reading."""
    return [sys.executable, "-m", "hpcgpu", "queue", str(queue_file), "--poll", "0.2", *args]


def run_queue(queue_file: Path, *args: str, env: dict | None = None, timeout: float = 120
              ) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(queue_cmd(queue_file, *args), capture_output=True, text=True, timeout=timeout,
                              env=env or job_env(), cwd=queue_file.parent)
    finally:
        kill_leftovers(str(queue_file.parent))


def write_queue(folder: Path, *lines: str) -> Path:
    path = folder / "jobs.queue"
    path.write_text("# the jobs\n" + "\n".join(lines) + "\n")
    return path


def table(stdout: str) -> dict[str, dict[str, str]]:
    """The summary table by line number (REASON, the last column, may have spaces)."""
    head = ["LINE", "NAME", "GPUS", "STATE", "EXIT", "TRIES", "SECONDS", "JOB", "RUN_DIR", "REASON"]
    lines = stdout.strip().splitlines()
    assert lines[0].split() == head[:8] + ["RUN", "DIR", "REASON"], lines[0]
    out = {}
    for line in lines[1:]:
        row = line.replace("NOT STARTED", "NOT_STARTED").split(maxsplit=len(head) - 1)
        row[3] = row[3].replace("_", " ")
        out[row[0]] = dict(zip(head, row))
    return out


def recorded(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def test_jobs_spread_over_the_pool_and_never_share_a_gpu(tmp_path):
    job_spec(tmp_path)
    q = write_queue(tmp_path, "job.yaml --set name=a --set env.JOB=a",
                    "job.yaml --gpus 2 --set name=b --set env.JOB=b",
                    "job.yaml --set name=c --set env.JOB=c   # a comment",
                    "job.yaml --set name=d --set env.JOB=d")
    proc = run_queue(q, "--gpus", "0,1,2")
    assert proc.returncode == 0, proc.stderr
    rows = table(proc.stdout)
    assert [rows[n]["STATE"] for n in ("2", "3", "4", "5")] == ["COMPLETED"] * 4
    jobs = {name: recorded(tmp_path, name) for name in "abcd"}
    for name, want in zip("abcd", (1, 2, 1, 1)):
        devices = jobs[name]["visible"].split(",")
        assert len(devices) == want and set(devices) <= {"0", "1", "2"}, (name, devices)
    overlapped = 0
    for x in "abcd":
        for y in "abcd":
            if x < y and jobs[x]["start"] < jobs[y]["end"] and jobs[y]["start"] < jobs[x]["end"]:
                overlapped += 1
                assert not set(jobs[x]["visible"].split(",")) & set(jobs[y]["visible"].split(",")), (x, y)
    assert overlapped >= 1  # the pool was used in parallel, not one job at a time
    assert "[line 3] b: started on GPU" in proc.stderr


def test_a_sweep_line_is_one_job_per_point(tmp_path):
    job_spec(tmp_path, seconds=1.5)
    q = write_queue(tmp_path, "job.yaml --sweep env.JOB=p1,p2 --sweep env.SECONDS_TO_RUN=1.5")
    proc = run_queue(q, "--gpus", "0,1")
    assert proc.returncode == 0, proc.stderr
    assert "[line 2] job[env.JOB=p1 env.SECONDS_TO_RUN=1.5]: started on GPU" in proc.stderr
    p1, p2 = recorded(tmp_path, "p1"), recorded(tmp_path, "p2")
    assert {p1["visible"], p2["visible"]} == {"0", "1"}  # side by side, one GPU each
    assert p1["start"] < p2["end"] and p2["start"] < p1["end"]
    again = run_queue(q, "--gpus", "0,1")
    assert again.returncode == 0 and again.stderr.count("finished earlier") == 2, again.stderr


def test_running_the_queue_again_skips_what_finished(tmp_path):
    job_spec(tmp_path, seconds=0.2)
    q = write_queue(tmp_path, "job.yaml", "job.yaml --set name=again --set env.JOB=again --new")
    assert run_queue(q, "--gpus", "0").returncode == 0
    first = recorded(tmp_path, "job")["start"]
    again = run_queue(q, "--gpus", "0")
    assert again.returncode == 0, again.stderr
    rows = table(again.stdout)
    assert rows["2"]["STATE"] == "SKIPPED" and rows["3"]["STATE"] == "COMPLETED"  # --new: always runs
    assert recorded(tmp_path, "job")["start"] == first
    assert "finished earlier in" in again.stderr


def test_without_gpus_the_jobs_run_one_at_a_time(tmp_path):
    job_spec(tmp_path, seconds=1.0)
    q = write_queue(tmp_path, "job.yaml --set name=a --set env.JOB=a", "job.yaml --set name=b --set env.JOB=b")
    proc = run_queue(q)  # no NVML here, no --gpus
    assert proc.returncode == 0, proc.stderr
    assert "the CPU, one job at a time" in proc.stderr
    a, b = recorded(tmp_path, "a"), recorded(tmp_path, "b")
    assert a["end"] <= b["start"] and a["visible"] == b["visible"] == ""


def test_a_failing_job_does_not_stop_the_others(tmp_path):
    job_spec(tmp_path, seconds=0.2)
    q = write_queue(tmp_path, "job.yaml --set name=bad --set env.JOB=bad --set env.EXIT=3", "job.yaml")
    proc = run_queue(q, "--gpus", "0")
    assert proc.returncode == 1, proc.stderr
    rows = table(proc.stdout)
    assert (rows["2"]["STATE"], rows["2"]["EXIT"]) == ("FAILED", "3")
    assert rows["3"]["STATE"] == "COMPLETED"
    assert "[line 2] bad: failed (exit 3)" in proc.stderr
    # the job ids and run dirs the queue shows are the registry's records of those jobs
    bad, good = (Registry().find(rows[n]["JOB"])[0] for n in ("2", "3"))
    assert (bad.state, bad.exit_code, bad.run_dir, bad.gpus) == ("FAILED", 3, rows["2"]["RUN_DIR"], 1)
    assert (good.state, good.run_dir) == ("COMPLETED", rows["3"]["RUN_DIR"])
    assert f"[line 2] bad: started on GPU 0, job {bad.job_id}" in proc.stderr
    assert f"; {bad.reason}" in proc.stderr and bad.reason.startswith("rank 0 on ")  # why, from the registry


@pytest.mark.parametrize("line, message", [
    ("job.yaml --bogus", "jobs.queue:3: no such option --bogus"),
    ("missing.yaml", "jobs.queue:3: "),
    ("job.yaml --set resources.gpus=three", "jobs.queue:3: "),
    ("job.yaml --gpus 3", "jobs.queue:3: job needs 3 GPUs, the queue has 2 (0,1)"),
    ("job.yaml --nodes 2", "jobs.queue:3: the queue runs jobs on this machine"),
    ("job.yaml 'unclosed", "jobs.queue:3: No closing quotation"),
])
def test_a_bad_line_is_one_error_naming_it_and_nothing_starts(tmp_path, line, message):
    job_spec(tmp_path, seconds=0.2)
    q = write_queue(tmp_path, "job.yaml", line)
    proc = run_queue(q, "--gpus", "0,1")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_busy_gpus_are_left_out_of_the_pool(tmp_path):
    """Recorded readings of a shared 8 x H100 node: GPUs 0, 1, 4 and 7 are in use by others."""
    job_spec(tmp_path)
    q = write_queue(tmp_path, "job.yaml")
    env = job_env(HPCGPU_NVML_RECORDED=str(FIXTURES / "nvml_h100x8_shared.json"))
    del env["CUDA_VISIBLE_DEVICES"]  # job_env hides every GPU; this node shows all eight
    everything = run_queue(q, "--dry-run", env=env)
    assert everything.returncode == 0, everything.stderr
    assert "over GPUs 2,3,5,6" in everything.stderr
    assert sum("left out, busy" in line for line in everything.stderr.splitlines()) == 4
    chosen = run_queue(q, "--dry-run", "--gpus", "7,3", env=env)
    assert "over GPUs 3" in chosen.stderr and "GPU 7 left out, busy: utilization 37%" in chosen.stderr
    forced = run_queue(q, "--dry-run", "--gpus", "7,3", "--ignore-busy", env=env)
    assert "over GPUs 7,3" in forced.stderr
    unknown = run_queue(q, "--dry-run", "--gpus", "3,9", env=env)
    assert unknown.returncode == 2 and "no GPU '9' here" in unknown.stderr, unknown.stderr
    none_free = run_queue(q, "--dry-run", "--gpus", "0,1", env=env)
    assert none_free.returncode == 2 and "no free GPU to run the queue on among --devices 0,1" in none_free.stderr
    assert not (tmp_path / "runs").exists()


def test_sigterm_stops_the_running_jobs_and_the_same_queue_goes_on(tmp_path):
    job_spec(tmp_path, seconds=60)
    q = write_queue(tmp_path, "job.yaml", "job.yaml --set name=later --set env.JOB=later --set env.SECONDS_TO_RUN=0.2")
    proc = subprocess.Popen(queue_cmd(q, "--gpus", "0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(), cwd=tmp_path)
    try:
        wait_for(lambda: (tmp_path / "job.started").exists(), timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_leftovers(str(tmp_path))
    assert proc.returncode == 75, err
    rows = table(out)
    assert rows["2"]["STATE"] == "PREEMPTED" and rows["3"]["STATE"] == "NOT STARTED"
    assert ": stopped at a checkpoint in " in err, err  # a command's own checkpoints: no stop record to read
    assert (tmp_path / "job.stopped").exists() and not (tmp_path / "later.started").exists()
    stopped_dir = rows["2"]["RUN_DIR"]

    (tmp_path / "job.seconds").write_text("0.2")
    again = run_queue(q, "--gpus", "0")
    assert again.returncode == 0, again.stderr
    rows = table(again.stdout)
    assert rows["2"]["STATE"] == rows["3"]["STATE"] == "COMPLETED"
    assert rows["2"]["RUN_DIR"] == stopped_dir  # the stopped job resumed in its own run dir
    assert (tmp_path / "later.json").exists()


# --- the queue watches the GPUs: recorded readings that change one reading at a time -------------------

SHARED = json.loads((FIXTURES / "nvml_h100x8_shared.json").read_text())["gpus"]


def timeline(folder: Path, *steps: str) -> Path:
    """A recording of H100s that changes with each reading: step "F B F" has GPU 0 free (an idle
    H100's reading), GPU 1 busy (another user's python process holding 62 GiB at 98%), GPU 2 free.
    The k-th reading of a process sees step k, and the last step once they are used up."""
    def gpu(index: int, state: str) -> dict:
        return {**SHARED[0 if state == "B" else 2], "index": index, "uuid": SHARED[index]["uuid"]}

    path = folder / "nvml_timeline.json"
    path.write_text(json.dumps({"driver": "580.159.04", "timeline": [
        {"gpus": [gpu(i, state) for i, state in enumerate(step.split())]} for step in steps]}))
    return path


def test_a_recorded_timeline_steps_one_snapshot_per_read(tmp_path):
    source = RecordedSource.from_file(timeline(tmp_path, "F B", "B F"))
    assert source.available() and source.driver_version() == "580.159.04"  # neither one reads
    seen = [[bool(r.processes) for r in source.read()] for _ in range(4)]
    assert seen == [[False, True], [True, False], [True, False], [True, False]]  # the last step stays
    (tmp_path / "bad.json").write_text('{"timeline": []}')
    with pytest.raises(HpcgpuError, match="non-empty list"):
        RecordedSource.from_file(tmp_path / "bad.json")


def test_a_gpu_is_usable_after_n_free_readings_in_a_row(tmp_path):
    """Reading by reading, 2 free readings in a row needed: GPU 0 busy at the start, then free,
    free, busy (a flicker: the count starts again), free, free. GPU 1 shows someone else's process
    first while a job of the queue holds it (its own: not judged), then once it is back in the pool."""
    source = RecordedSource.from_file(timeline(tmp_path, "B F", "F B", "F B", "B F", "F F", "F F"))
    watch = GpuWatch(source, BusyThresholds(), 2, source.read())
    usable = [(watch.usable("0"), watch.usable("1"))]
    lines: list[str] = []
    for held in (set(), {"1"}, set(), set(), set(), set()):
        watch.look(held, lines.append)  # the first look goes by the pool's own first reading: no read
        usable.append((watch.usable("0"), watch.usable("1")))
    assert usable == [(False, True), (False, True), (False, True), (True, False), (False, False), (False, True),
                      (True, True)]
    busy = ("memory 78% used, utilization 98%, 1 compute process(es); 62.0 of 79.6 GiB used; "
            "processes: pid 412233 python (61.5 GiB)")
    assert lines == [
        "queue: GPU 0 free in 2 readings in a row: back in the pool",
        f"queue: GPU 1 busy: {busy}; not used until free in 2 readings in a row",
        f"queue: GPU 0 busy: {busy}; not used until free in 2 readings in a row",
        "queue: GPU 1 free in 2 readings in a row: back in the pool",
        "queue: GPU 0 free in 2 readings in a row: back in the pool"]


def test_a_busy_gpu_waits_for_n_free_readings_in_a_row(tmp_path):
    """GPUs 1 and 2 are busy at the start. GPU 2 then stays free; GPU 1 flickers (free twice,
    busy, free twice, busy for good), never free in 3 readings in a row: job b waits for GPU 2."""
    job_spec(tmp_path)
    rec = timeline(tmp_path, "F B B", "F F B", "F F B", "F B F", "F F F", "F F F", "F B F")
    q = write_queue(tmp_path, f"job.yaml --set name=a --set env.JOB=a --set env.WAIT_FOR={tmp_path / 'b.json'}",
                    "job.yaml --set name=b --set env.JOB=b --set env.SECONDS_TO_RUN=0")
    proc = run_queue(q, "--gpus", "0,1,2", "--free-checks", "3", env=job_env(HPCGPU_NVML_RECORDED=str(rec)))
    assert proc.returncode == 0, proc.stderr
    assert recorded(tmp_path, "a")["visible"] == "0"  # a held GPU 0 until b had run
    assert recorded(tmp_path, "b")["visible"] == "2"
    err = proc.stderr
    assert "over GPUs 0 (and 1,2 once free)" in err
    assert "queue: GPU 1 left out, busy: " in err and "used once free in 3 readings in a row" in err
    assert "queue: GPU 2 free in 3 readings in a row: back in the pool" in err
    assert "GPU 1 free in" not in err
    assert f"[line 2] a: started on GPU 0 (NVIDIA H100 80GB HBM3, {SHARED[0]['uuid']}), job " in err
    assert f"[line 3] b: started on GPU 2 (NVIDIA H100 80GB HBM3, {SHARED[2]['uuid']}), job " in err
    rows = table(proc.stdout)
    assert (rows["2"]["GPUS"], rows["3"]["GPUS"]) == ("0:GPU-66e5630b", "2:GPU-8a3d5c21")
    assert (rows["3"]["STATE"], rows["3"]["TRIES"], rows["3"]["REASON"]) == ("COMPLETED", "1", "-")


def test_a_gpu_taken_by_someone_else_mid_queue_is_not_given_to_the_next_job(tmp_path):
    """Both GPUs free at the start; from the next reading on, another user's process holds GPU 1.
    Job b runs there meanwhile (the queue's own); once b is done, c waits for GPU 0."""
    job_spec(tmp_path)
    rec = timeline(tmp_path, "F F", "F B")
    q = write_queue(tmp_path, "job.yaml --set name=a --set env.JOB=a --set env.SECONDS_TO_RUN=3",
                    "job.yaml --set name=b --set env.JOB=b --set env.SECONDS_TO_RUN=0",
                    "job.yaml --set name=c --set env.JOB=c --set env.SECONDS_TO_RUN=0")
    proc = run_queue(q, "--gpus", "0,1", "--free-checks", "2", env=job_env(HPCGPU_NVML_RECORDED=str(rec)))
    assert proc.returncode == 0, proc.stderr
    a, b, c = (recorded(tmp_path, n) for n in "abc")
    assert (a["visible"], b["visible"], c["visible"]) == ("0", "1", "0")
    assert c["start"] >= a["end"]
    assert "queue: GPU 1 busy: memory 78% used, utilization 98%, 1 compute process(es); 62.0 of 79.6 GiB" in proc.stderr
    assert table(proc.stdout)["4"]["GPUS"] == "0:GPU-66e5630b"


FLAKY = ("import pathlib, sys; m = pathlib.Path(sys.argv[1]); "
         "m.exists() or (m.write_text(''), sys.exit('no marker yet: the first attempt fails'))")


def test_retries_run_a_failed_job_again_in_its_run_dir(tmp_path):
    """flaky fails once (no marker yet), then finishes: 2 attempts. bad always fails: 1 + 2 retries."""
    for name, code in (("flaky", FLAKY), ("bad", "import sys; sys.exit('out of luck')")):
        write_spec_file(tmp_path, {"name": name, "task": "command", "resources": {"gpus": 1, "cpus_per_gpu": 1},
                                   "command": [sys.executable, "-c", code, str(tmp_path / "marker")]})
    q = write_queue(tmp_path, "flaky.yaml --new", "bad.yaml")
    proc = run_queue(q, "--gpus", "0,1", "--retries", "2")
    assert proc.returncode == 1, proc.stderr
    rows = table(proc.stdout)
    flaky, bad = rows["2"], rows["3"]
    assert (flaky["STATE"], flaky["EXIT"], flaky["TRIES"]) == ("COMPLETED", "0", "2")
    assert flaky["REASON"].startswith("attempt 1: rank 0 on ")
    assert flaky["REASON"].endswith("exit code 1: no marker yet: the first attempt fails")
    assert (bad["STATE"], bad["EXIT"], bad["TRIES"]) == ("FAILED", "1", "3")
    assert bad["REASON"].startswith("attempt 3: ") and bad["REASON"].endswith("out of luck")
    err = proc.stderr
    assert err.count("[line 3] bad: started") == 3 and "bad: started (attempt 3 of 3) on GPU" in err
    assert "; retrying (attempt 2 of 3)" in err and "retrying (attempt 4" not in err
    # the retry resumed the run dir the failed attempt left (even on a --new line)
    assert f"flaky: started (attempt 2 of 3) on GPU " in err and f"resuming {flaky['RUN_DIR']}" in err
    assert len(list((tmp_path / "runs" / "flaky").iterdir())) == 1


def test_gpus_without_nvml_must_be_indexes_or_uuids_each_once(tmp_path: Path, monkeypatch) -> None:
    """Without NVML nothing checks --gpus against real GPUs, so its form is checked: the ids become the
    jobs' CUDA_VISIBLE_DEVICES. And a queue file that is not there is said in words."""
    from hpcgpu.cli.queue import gpu_ids_as_given, read_entries
    from hpcgpu.errors import UsageError

    assert gpu_ids_as_given("0, 3,GPU-8a3d5c21") == ["0", "3", "GPU-8a3d5c21"]
    for bad, says in [("abc", "not abc"), ("-1", "not -1"), ("0,0", "a GPU named twice"), (",", "no GPU named")]:
        with pytest.raises(UsageError, match=says):
            gpu_ids_as_given(bad)
    with pytest.raises(UsageError, match="no such file"):
        read_entries(tmp_path / "nofile.txt")
    from hpcgpu.cli.queue import gpu_pool
    from hpcgpu.gpu.source import default_source

    if not default_source().available():  # this machine (CI): --gpus is taken with a word, not silently
        pool, notes = gpu_pool("0,9", ignore_busy=False)
        assert pool.ids == ["0", "9"] and notes == [
            "warning: NVML is not available here: GPUs 0,9 are taken as given (not checked to exist, not watched "
            "for other jobs)"]


def test_a_cancelled_job_is_cancelled_not_failed_nor_retried() -> None:
    """`hpcgpu cancel` twice kills the job's ranks (exit 137): the queue called it FAILED and exited 1."""
    from hpcgpu.launch.queue import QueueEntry, QueueResult, exit_code

    done = QueueResult(QueueEntry(1, ("a.yaml",), "a", 1), exit_code=0)
    killed = QueueResult(QueueEntry(2, ("b.yaml",), "b", 1), exit_code=137, cancelled=True)
    stopped = QueueResult(QueueEntry(3, ("c.yaml",), "c", 1), exit_code=75, cancelled=True)
    assert [r.state for r in (done, killed, stopped)] == ["COMPLETED", "CANCELLED", "CANCELLED"]
    assert exit_code([done, killed]) == 75  # not done: the queue run again goes on with it
    assert exit_code([done, killed, QueueResult(QueueEntry(4, ("d.yaml",), "d", 1), exit_code=1)]) == 1
