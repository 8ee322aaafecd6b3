"""`hpcgpu submit` and the job commands without a cluster: the submitit batch file, the sinfo check,
squeue parsing, sweeps, the array script, the local executor's registry rows, and imports."""
from __future__ import annotations

import json
import socket
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, GOLDEN, REPO
from hpcgpu.errors import HpcgpuError, SpecError, UsageError
from hpcgpu.launch.executors import refresh
from hpcgpu.launch.progress import last_progress
from hpcgpu.launch.state import array_state, shown_state
from hpcgpu.launch.options import sbatch_options
from hpcgpu.launch.preflight import RequestError, check_request
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord
from hpcgpu.launch.sbatch import ArrayIndex, array_block, render_directives
from hpcgpu.launch.scheduler import JobInfo, parse_duration, parse_gres, parse_sinfo, parse_squeue
from hpcgpu.launch.submission import array_plan, single_plan
from hpcgpu.launch.submitit_slurm import check_same_options, directives_of, submission_text
from hpcgpu.launch.sweep import (array_chunks, array_range, check_one_script, parse_sweep_flag, sweep_tasks,
                                 with_sweep)
from hpcgpu.launch.wait import exit_status
from hpcgpu.spec import load_spec

RUN_DIR = Path("/runs/x/RUNID")


def env_without_debug(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HPCGPU_DEBUG"}
    env.update(more)
    return env


def hpcgpu(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env or env_without_debug(), timeout=120)


# --- the submitit batch file is the sbatch one ----------------------------------------------------

@pytest.mark.parametrize("name", ["gpu1", "gpu4_type", "nodes2", "all_options"])
def test_submitit_file_asks_for_exactly_the_sbatch_options(name):
    spec = load_spec(GOLDEN / f"{name}.yaml")
    plan = single_plan(spec, RUN_DIR)
    text = submission_text(plan.folder, plan.options, plan.command)
    assert directives_of(text) == directives_of(render_directives(sbatch_options(spec, RUN_DIR)))
    assert "--wckey" not in text and "submitit.core._submit" not in text
    # the body is the one `hpcgpu sbatch` renders: same srun line, same exports and forwarding
    sbatch_body = (GOLDEN / f"{name}.sbatch").read_text().split("\nset -eo pipefail", 1)[1]
    submit_body = text.split("\nset -eo pipefail", 1)[1]
    assert submit_body.rstrip() == sbatch_body.replace("/opt/venv/bin/python", sys.executable).replace(
        "/runs/" + name, "/runs/x").rstrip()
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_check_same_options_catches_an_extra_directive():
    options = [("job-name", "a"), ("requeue", None)]
    with pytest.raises(HpcgpuError, match="differ"):
        check_same_options("#SBATCH --job-name=a\n#SBATCH --requeue\n#SBATCH --wckey=submitit\n", options)
    check_same_options("#SBATCH --requeue\n#SBATCH --job-name='a'\n", options)


def test_array_plan_options_and_index(tmp_path):
    spec = load_spec(CONFIGS / "hello-command.yaml", ["slurm.array_parallelism=2"])
    plan = array_plan(spec, tmp_path, tmp_path / "tasks.txt", offset=1001, length=5)
    opts = dict(plan.options)
    assert opts["array"] == "0-4%2"
    assert opts["output"] == str(tmp_path / "slurm-%A_%a.out")
    assert "SLURM_ARRAY_TASK_ID + 1001 + 1" in plan.command
    assert '-m hpcgpu run "$spec_path"' in plan.command and 'HPCGPU_RUN_DIR="$run_dir"' in plan.command


def test_array_block_finds_the_task_and_logs_into_its_run_dir(tmp_path):
    dirs = [tmp_path / "sweep" / str(i) for i in range(3)]
    for d in dirs:
        d.mkdir(parents=True)
    tasks = tmp_path / "sweep" / "tasks.txt"
    tasks.write_text("".join(f"{d / 'spec.yaml'}\n" for d in dirs))
    script = array_block(ArrayIndex(tasks, offset=1)) + 'echo "spec=$spec_path"; echo oops >&2\n'
    env = {"PATH": os.environ["PATH"], "SLURM_ARRAY_JOB_ID": "50", "SLURM_ARRAY_TASK_ID": "1"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (dirs[2] / "slurm-50_1.out").read_text() == f"spec={dirs[2] / 'spec.yaml'}\n"
    assert (dirs[2] / "slurm-50_1.err").read_text() == "oops\n"
    env["SLURM_ARRAY_TASK_ID"] = "7"
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "array task 7 is not in" in done.stderr


# --- sinfo check ----------------------------------------------------------------------------------

SINFO = """n1|gpu*|8|16000|gpu:4|idle|infinite
n2|gpu*|8|16000|gpu:4(S:0)|mixed|infinite
n1|debug|8|16000|gpu:4|idle|1:00:00
n3|big|64|512000|gpu:a100:8,gpu:v100:2|idle|2-00:00:00
"""


def spec_with(tmp_path, *overrides: str, gpus: int | None = None, nodes: int | None = None):
    return load_spec(CONFIGS / "hello-command.yaml", list(overrides), gpus=gpus, nodes=nodes)


def test_parse_sinfo_gres_and_times():
    cluster = parse_sinfo(SINFO)
    assert cluster.default_partition == "gpu" and cluster.partitions == ["gpu", "debug", "big"]
    assert cluster.in_partition("big")[0].gpus == {"a100": 8, "v100": 2}
    assert parse_gres("(null)") == {} and parse_gres("gpu:4(S:0-1),shard:8") == {"": 4}
    assert [parse_duration(t) for t in ("infinite", "1:00:00", "30:00", "5", "2-00:00:00")] == \
        [None, 3600, 1800, 300, 172800]


@pytest.mark.parametrize("overrides, gpus, nodes, words", [
    (["slurm.partition=nosuch"], None, None, "slurm.partition: no partition 'nosuch'"),
    ([], 5, None, "no node in partition 'gpu' has 5 GPU(s) (the most is 4"),
    (["resources.cpus_per_gpu=3"], 4, None, "4 GPU(s) x 3 CPUs = 12 CPUs per node"),
    (["resources.mem_per_gpu=5G"], 4, None, "4 GPU(s) x 5G = 20G per node"),
    ([], None, 3, "3 nodes asked for, but partition 'gpu' has only 2"),
    (["slurm.partition=debug", "resources.time='02:00:00'"], None, None, "over the time limit of partition 'debug'"),
    (["slurm.partition=big", "resources.gpu_type=h100", "resources.time='01:00:00'"], None, None,
     "GPU types there: a100, v100"),
])
def test_request_that_cannot_fit_is_refused(tmp_path, overrides, gpus, nodes, words):
    with pytest.raises(RequestError) as info:
        check_request(spec_with(tmp_path, *overrides, gpus=gpus, nodes=nodes), parse_sinfo(SINFO))
    assert words in str(info.value) and info.value.exit_code == 2


def test_request_that_fits():
    cluster = parse_sinfo(SINFO)
    assert check_request(load_spec(CONFIGS / "hello-command.yaml", gpus=4, nodes=2), cluster) == "gpu"
    spec = load_spec(CONFIGS / "hello-command.yaml", ["slurm.partition=nosuch,big", "resources.gpu_type=a100"], gpus=8)
    assert check_request(spec, cluster) == "big"


# --- squeue -------------------------------------------------------------------------------------

def test_parse_squeue_states_and_exit_codes():
    text = ("12|RUNNING|None|1:02|n1|0||\n12_3|PENDING|Priority|0:00||0||\n"
            "13|FAILED|NonZeroExitCode|0:05|n2|0|768|\n14|CANCELLED|None|0:01|n1|0|15|\n")
    got = parse_squeue(text)
    assert got["12"].state == "RUNNING" and got["12"].nodes == "n1" and got["12"].exit_code is None
    assert got["12_3"].reason == "Priority"
    assert got["13"].exit_code == 3 and got["14"].exit_code == 143
    assert shown_state(JobInfo("1", "PENDING", "BeginTime", restarts=1)) == "REQUEUED"
    assert shown_state(JobInfo("1", "PENDING", "Priority")) == "PENDING"


def test_array_state_and_exit_status():
    def tasks(*states):
        return [TaskRecord(f"1_{i}", "/", state=s) for i, s in enumerate(states)]

    assert array_state(tasks("COMPLETED", "RUNNING", "PENDING")) == "RUNNING"
    assert array_state(tasks("COMPLETED", "COMPLETED")) == "COMPLETED"
    assert array_state(tasks("COMPLETED", "FAILED", "CANCELLED")) == "FAILED"
    job = JobRecord("1", "n", "s", "/", "slurm", tasks=tasks("COMPLETED", "FAILED"))
    job.tasks[1].exit_code = 3
    assert exit_status([job]) == 3
    assert exit_status([JobRecord("2", "n", "s", "/", "slurm", state="COMPLETED")]) == 0
    assert exit_status([JobRecord("2", "n", "s", "/", "slurm", state="TIMEOUT")]) == 1
    # rank 1 failed with 3 and srun ended rank 0 (143): `submit --wait` exits 3, as the local executor does
    torn = JobRecord("3", "n", "s", "/", "slurm", state="FAILED", exit_code=143,
                     failure={"rank": 1, "node": "n1", "exit_code": 3, "signal": None, "message": "boom"})
    assert exit_status([torn]) == 3


def test_last_progress_reads_the_last_train_record(tmp_path):
    lines = [{"kind": "train", "step": s, "loss": 5.0 - s / 10} for s in range(1, 2000)] + [{"kind": "end"}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + '\n{"kind": "tr')
    p = last_progress(tmp_path)
    assert p.step == 1999 and p.loss == pytest.approx(5.0 - 199.9)
    assert last_progress(tmp_path / "nothing").step is None


def test_eta_comes_from_the_rate_since_the_last_start(tmp_path):
    records = [{"kind": "train", "step": 1, "time": 0.0, "max_steps": 100, "ms_per_step": 900.0},
               {"kind": "resume", "step": 40},
               {"kind": "train", "step": 50, "time": 1000.0, "max_steps": 100, "ms_per_step": 500.0},
               {"kind": "train", "step": 60, "time": 1020.0, "max_steps": 100, "ms_per_step": 500.0,
                "tokens_per_s": 123.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    p = last_progress(tmp_path)
    assert (p.step, p.max_steps, p.tokens_per_s, p.text()) == (60, 100, 123.0, "step 60/100")
    assert p.eta_s() == pytest.approx(40 / (10 / 20))  # 10 steps in 20 s since the resume: 80 s left
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[-1]) + "\n")  # one record: its ms/step
    assert last_progress(tmp_path).eta_s() == pytest.approx(40 * 0.5)
    infer = {"kind": "infer", "rows": 30, "rows_total": 90, "rows_per_s": 2.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(infer) + "\n")
    assert last_progress(tmp_path).eta_s() == pytest.approx(30.0)


def test_infer_rows_are_the_rows_written_when_the_last_record_is_older(tmp_path):
    """A SIGKILLed infer job: its last progress record said 8 rows; its replicas had written 164 (and
    cut one in half), which is what a resume keeps."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "infer", "rows": 8, "rows_total": 400}) + "\n")
    (tmp_path / "outputs").mkdir()
    for n, count in ((0, 82), (1, 82)):
        rows = "".join(json.dumps({"index": i, "text": "x"}) + "\n" for i in range(count))
        (tmp_path / "outputs" / f"replica-{n}.jsonl").write_text(rows + ('{"index": 99, "te' if n else ""))
    assert last_progress(tmp_path).text() == "rows 164/400"


def test_status_of_an_infer_run_gives_rows_done_of_total(tmp_path):
    from hpcgpu.cli.jobs import step_cell

    records = [{"kind": "resume", "rows": 8, "rows_total": 45}, {"kind": "infer", "rows": 24, "rows_total": 45}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    p = last_progress(tmp_path)
    assert (p.rows, p.rows_total, p.step, p.text()) == (24, 45, None, "rows 24/45")
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "end", "rows": 45, "rows_this_start": 37, "tokens": 900}) + "\n")
    p = last_progress(tmp_path)
    assert p.text() == "rows 45/45" and step_cell({"rows": p.rows, "rows_total": p.rows_total}) == "45/45 rows"
    assert step_cell({"step": 200}) == "200" and last_progress(tmp_path / "nothing").text() == "-"


# --- sweeps ---------------------------------------------------------------------------------------

def test_sweep_grid_and_flags(tmp_path):
    spec = load_spec(CONFIGS / "tiny-gpt2.yaml")
    spec = with_sweep(spec, ("train.lr=1e-3,3e-3", "model.config.n_layer=[1, 2]"))
    tasks = sweep_tasks(spec)
    assert [t.values for t in tasks] == [
        {"train.lr": 0.001, "model.config.n_layer": 1}, {"train.lr": 0.001, "model.config.n_layer": 2},
        {"train.lr": 0.003, "model.config.n_layer": 1}, {"train.lr": 0.003, "model.config.n_layer": 2}]
    assert tasks[3].spec.train.lr == 0.003 and tasks[3].spec.model.config["n_layer"] == 2
    assert all(t.spec.sweep == {} for t in tasks)
    check_one_script(tasks)  # training keys only: one batch script for all


def test_sweep_errors_name_the_key(tmp_path):
    spec = load_spec(CONFIGS / "tiny-gpt2.yaml")
    with pytest.raises(SpecError, match="sweep.train.lrr"):
        with_sweep(spec, ("train.lrr=1,2",))
    with pytest.raises(UsageError, match="--sweep"):
        parse_sweep_flag("train.lr")
    with pytest.raises(SpecError, match=r"sweep task 1 \(train.global_batch_size=7\)"):
        sweep_tasks(with_sweep(spec, ("train.global_batch_size=16,7",)))
    with pytest.raises(UsageError, match="different batch script"):
        check_one_script(sweep_tasks(with_sweep(spec, ("resources.gpus=1,2",))))
    # validate says what submit to SLURM would say, not "ok"
    done = hpcgpu("validate", str(CONFIGS / "hello-command.yaml"), "--set", "sweep={resources.cpus_per_gpu: [1, 2]}")
    assert done.returncode == 2 and "different batch script" in done.stderr and done.stderr.count("\n") == 1


def test_array_chunks_respect_max_array_size():
    assert array_chunks(3, 1001) == [(0, 3)]
    assert array_chunks(2500, 1001) == [(0, 1001), (1001, 1001), (2002, 498)]
    assert (array_range(1, None), array_range(3, None), array_range(3, 2)) == ("0", "0-2", "0-2%2")


# --- the CLI --------------------------------------------------------------------------------------

def test_dry_run_prints_spec_and_script_and_writes_nothing(tmp_path):
    done = hpcgpu("submit", str(CONFIGS / "hello-command.yaml"), "--dry-run", "--set", f"runs_dir={tmp_path}/runs",
                  "--sweep", "train.seed=1,2,3")
    assert done.returncode == 0, done.stderr
    assert "name: hello" in done.stdout and "# sweep task 2: train.seed=3" in done.stdout
    assert "#SBATCH --array=0-2" in done.stdout and "#SBATCH --ntasks-per-node=2" in done.stdout
    assert "-m hpcgpu run" in done.stdout
    assert not (tmp_path / "runs").exists()


def test_too_many_gpus_is_refused_before_anything_is_written(tmp_path):
    """Against whatever sinfo says here; without SLURM the check cannot run and says so."""
    done = hpcgpu("submit", str(CONFIGS / "hello-command.yaml"), "--gpus", "64", "--set", f"runs_dir={tmp_path}/runs")
    assert done.returncode in (2, 3), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("sweep", [(), ("--sweep", "train.seed=1,2")])
def test_a_local_job_that_cannot_run_here_is_refused_before_anything_is_written(tmp_path, monkeypatch, sweep):
    monkeypatch.setenv("HPCGPU_REGISTRY", str(tmp_path / "jobs.db"))
    done = hpcgpu("submit", str(CONFIGS / "hello-command.yaml"), "--executor", "local", "--nodes", "2",
                  "--set", f"runs_dir={tmp_path}/runs", *sweep)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "hpcgpu: error: the local executor runs on one node: use --nodes 1 (or submit to SLURM)\n"
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "jobs.db").exists() or Registry(tmp_path / "jobs.db").count() == 0


def write_registry(path: Path, *jobs: JobRecord) -> None:
    reg = Registry(path)
    for job in jobs:
        reg.add(job)
    reg.close()


def test_status_list_logs_cancel_of_local_jobs(tmp_path):
    db = tmp_path / "jobs.db"
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank-0.log").write_text("hello from rank 0\n")
    (run_dir / "logs" / "rank-1.log").write_text("hello from rank 1\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 7, "loss": 2.5}) + "\n")
    # a local job whose executor is gone (pid 0 never matches): status marks it FAILED
    write_registry(db, JobRecord("", "exp", "/s.yaml", str(run_dir), "local", state="RUNNING", pid=2 ** 22 + 7))
    env = env_without_debug(HPCGPU_REGISTRY=str(db))
    done = hpcgpu("status", "local-1", "--json", env=env)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["state"] == "FAILED" and view["step"] == 7 and view["loss"] == 2.5
    listing = hpcgpu("list", env=env)
    assert "local-1" in listing.stdout and "FAILED" in listing.stdout and "2.5000" in listing.stdout
    assert hpcgpu("logs", "local-1", env=env).stdout == "hello from rank 0\n"
    assert hpcgpu("logs", "local-1", "--rank", "1", env=env).stdout == "hello from rank 1\n"
    (run_dir / "spec.yaml").write_text((CONFIGS / "hello-command.yaml").read_text())  # 2 ranks
    done = hpcgpu("logs", "local-1", "--rank", "5", env=env)
    assert done.returncode == 2 and done.stderr == "hpcgpu: error: --rank 5: job local-1 has 2 rank(s), 0-1\n"
    done = hpcgpu("cancel", "local-1", env=env)
    assert done.returncode == 0 and done.stdout == "local-1 already ended (FAILED)\n"  # SLURM's words
    done = hpcgpu("status", "nope", env=env)
    assert done.returncode == 2 and done.stderr.startswith("hpcgpu: error: no job 'nope'")


def test_logs_of_an_array_needs_a_task_and_rank_picks_srun_labels(tmp_path):
    db = tmp_path / "jobs.db"
    tasks = [TaskRecord(f"9_{i}", str(tmp_path / str(i)), state="COMPLETED") for i in range(2)]
    write_registry(db, JobRecord("9", "exp", "/s.yaml", str(tmp_path), "slurm", state="COMPLETED", tasks=tasks),
                   JobRecord("10", "exp", "/s.yaml", str(tmp_path), "slurm", state="COMPLETED"))
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "slurm-9_1.out").write_text("task one\n")
    env = env_without_debug(HPCGPU_REGISTRY=str(db))
    done = hpcgpu("logs", "9", env=env)
    assert done.returncode == 2 and "hpcgpu logs 9_0" in done.stderr
    assert hpcgpu("logs", "9_1", env=env).stdout == "task one\n"
    (tmp_path / "slurm-10.out").write_text("0: step 1 | loss 5.5\n1: [rank 1] hello\n10: not rank 1\n1: bye")
    assert hpcgpu("logs", "10", "--rank", "1", env=env).stdout == "[rank 1] hello\nbye"
    assert hpcgpu("logs", "10", env=env).stdout.startswith("0: step 1")
    status = json.loads(hpcgpu("status", "9", "--json", env=env).stdout)
    assert [t["id"] for t in status["tasks"]] == ["9_0", "9_1"]


COMMAND_SPEC = """
name: quick
task: command
resources: {gpus: 1, cpus_per_gpu: 1}
command: [%s, -c, "import os; print('seed', os.environ['HPCGPU_RUN_DIR'])"]
"""


def test_local_executor_records_jobs_and_sweeps(tmp_path):
    spec = tmp_path / "quick.yaml"
    spec.write_text(textwrap.dedent(COMMAND_SPEC % json.dumps(sys.executable)) + f"runs_dir: {tmp_path / 'runs'}\n")
    db = tmp_path / "jobs.db"
    env = env_without_debug(HPCGPU_REGISTRY=str(db), CUDA_VISIBLE_DEVICES="")
    done = hpcgpu("submit", str(spec), "--executor", "local", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "job local-1 (local), run dir " in done.stderr and "finished in" not in done.stderr
    again = hpcgpu("submit", str(spec), "--executor", "local", env=env, cwd=tmp_path)
    first_dir = done.stderr.split("run dir ")[1].split()[0].rstrip(",;")
    assert again.returncode == 0 and f"the same spec finished in {first_dir}; starting a new run" in again.stderr
    # a second apiece: the tasks' own times show apart from the sweep's
    spec.write_text(spec.read_text().replace("import os;", "import os, time; time.sleep(1.2);"))
    done = hpcgpu("submit", str(spec), "--executor", "local", "--sweep", "train.seed=1,2", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    reg = Registry(db)
    single, sweep = reg.find("local-1")[0], reg.find("local-3")[0]
    assert single.state == "COMPLETED" and single.exit_code == 0 and single.pid and single.ended
    assert single.nodes == socket.gethostname()  # where it ran: `-` is for a job that holds no node
    assert sweep.state == "COMPLETED" and [t.state for t in sweep.tasks] == ["COMPLETED", "COMPLETED"]
    assert [t.values for t in sweep.tasks] == [{"train.seed": 1}, {"train.seed": 2}]
    assert yaml.safe_load((Path(sweep.tasks[1].run_dir) / "spec.yaml").read_text())["train"]["seed"] == 2
    # each task's own node and time, not the whole sweep's (each showed the sweep's elapsed time)
    assert [t.nodes for t in sweep.tasks] == [socket.gethostname()] * 2
    view = json.loads(hpcgpu("status", "local-3", "--json", env=env, cwd=tmp_path).stdout)
    tasks_s = [t["elapsed_s"] for t in view["tasks"]]
    assert all(s >= 1 for s in tasks_s) and sum(tasks_s) <= view["elapsed_s"] + 1, (tasks_s, view["elapsed_s"])


HEAVY = ("torch", "transformers", "deepspeed", "accelerate", "numpy", "matplotlib", "pynvml")


def test_job_commands_import_nothing_heavy(tmp_path):
    """status/list/logs/cancel load neither torch nor submitit; submit loads submitit but no torch."""
    probe = textwrap.dedent(f"""
        import contextlib, io, os, sys
        os.environ["HPCGPU_REGISTRY"] = {str(tmp_path / 'jobs.db')!r}
        import hpcgpu.cli
        def run(argv):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    hpcgpu.cli.main(argv)
                except SystemExit:
                    pass
        for argv in (["status"], ["list"], ["logs", "1"], ["cancel", "1"], ["status", "1", "--json"]):
            run(argv)
        print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY + ("submitit",)!r})))
        run(["submit", "configs/hello-command.yaml", "--dry-run"])
        print(" ".join(sorted({{m.split(".")[0] for m in sys.modules if m.split(".")[0] in {HEAVY + ("submitit",)!r}}})))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    jobs_line, submit_line = done.stdout.splitlines()
    assert jobs_line == "", f"job commands imported: {jobs_line}"
    assert submit_line == "submitit", f"submit imported: {submit_line}"


def test_refresh_asks_once_for_all_and_never_again_for_final_jobs(tmp_path, monkeypatch):
    """How often the registry asks the scheduler, and what a job SLURM forgot becomes. What SLURM itself
    answers (REQUEUED while a requeued job waits, arrays split at MaxArraySize) is tested on the real
    cluster (tests/slurm/test_submit.py, test_arrays_real.py). A forgotten job stays here: the test
    cluster keeps finished jobs for MinJobAge=3600 s, as the other tests need it to."""
    from hpcgpu.launch import state as jobs_mod

    calls: list[list[str]] = []
    answers = {"1": JobInfo("1", "RUNNING", elapsed="0:05", nodes="n1"),
               "2_0": JobInfo("2_0", "COMPLETED", exit_code=0), "2_1": JobInfo("2_1", "PENDING", "Priority"),
               "4": JobInfo("4", "PENDING", "BeginTime", restarts=1)}
    monkeypatch.setattr(jobs_mod, "query_jobs", lambda ids: calls.append(sorted(ids)) or dict(answers))
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "FINISHED").write_text("")
    reg = Registry(tmp_path / "jobs.db")
    for job in (JobRecord("1", "a", "s", "/r1", "slurm"),
                JobRecord("2", "a", "s", "/sweep", "slurm", tasks=[TaskRecord("2_0", "/sweep/0"),
                                                                   TaskRecord("2_1", "/sweep/1")]),
                JobRecord("3", "a", "s", str(finished), "slurm"),  # forgotten by SLURM, finished run dir
                JobRecord("4", "a", "s", "/r4", "slurm", state="PREEMPTED"),  # revivable: asked again
                JobRecord("5", "a", "s", "/r5", "slurm", state="COMPLETED")):
        reg.add(job)
    jobs = reg.all()
    refresh(reg, jobs)
    assert calls == [["1", "2", "3", "4"]]  # one call; the COMPLETED job is not asked about
    got = {j.job_id: j for j in Registry(tmp_path / "jobs.db").all()}
    assert (got["1"].state, got["1"].nodes, got["1"].elapsed) == ("RUNNING", "n1", "0:05")
    assert got["2"].state == "PENDING" and [t.state for t in got["2"].tasks] == ["COMPLETED", "PENDING"]
    assert got["2"].tasks[1].reason == "Priority"
    assert got["3"].state == "COMPLETED" and "run dir" in got["3"].reason
    assert got["4"].state != "PREEMPTED" and got["4"].restarts == 1  # asked again, and the answer taken
    calls.clear()
    answers.clear()
    refresh(reg, list(got.values()))
    assert calls == [["1", "2", "4"]]
    assert Registry(tmp_path / "jobs.db").find("1")[0].state == "UNKNOWN"  # gone, no accounting, not finished


SECRET_SPEC = """
name: secret
task: command
resources: {gpus: 1, cpus_per_gpu: 1}
command: [%s, -c, "import os; print('secret-len', len(os.environ['HF_TOKEN']))"]
env_passthrough: [HF_TOKEN]
"""


def test_a_passthrough_secret_reaches_the_local_job_and_no_file(tmp_path):
    import secrets

    token = "hf_" + secrets.token_hex(16)
    spec = tmp_path / "secret.yaml"
    spec.write_text(textwrap.dedent(SECRET_SPEC % json.dumps(sys.executable)) + f"runs_dir: {tmp_path / 'runs'}\n")
    env = env_without_debug(HPCGPU_REGISTRY=str(tmp_path / "jobs.db"), CUDA_VISIBLE_DEVICES="", HF_TOKEN=token)
    done = hpcgpu("submit", str(spec), "--executor", "local", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs" / "secret").iterdir()
    assert f"secret-len {len(token)}" in (run_dir / "logs" / "rank-0.log").read_text()  # the job saw it
    written = [p for p in [*run_dir.rglob("*"), *tmp_path.glob("jobs.db*")] if p.is_file()]
    assert run_dir / "spec.yaml" in written and tmp_path / "jobs.db" in written
    assert [p for p in written if token.encode() in p.read_bytes()] == []
    assert token not in done.stdout + done.stderr


def test_submitit_runs_sbatch_in_the_submitting_environment(tmp_path, monkeypatch):
    """env_passthrough relies on it: sbatch gets our environment and no --export that would drop it."""
    from hpcgpu.launch.submitit_slurm import submit_command

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$HF_TOKEN" "$@" > {tmp_path / "seen"}\necho "Submitted batch job 42"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("HF_TOKEN", "the-value")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = single_plan(load_spec(CONFIGS / "hello-command.yaml"), run_dir)
    assert submit_command(plan.folder, plan.options, plan.command) == "42"
    token, *args = (tmp_path / "seen").read_text().split()
    assert token == "the-value" and not any("export" in a for a in args), args
    assert "--export" not in (run_dir / "42_submission.sh").read_text()
