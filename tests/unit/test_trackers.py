"""track: TensorBoard and W&B (offline) fed by rank 0, on CPU.

One real train job through `hpcgpu submit --executor local`, stopped and resumed, read back with each
tracker's own reader; the submit-time checks; and the GPU monitor's samples reaching the trackers
(the train task samples GPUs only on CUDA devices, so that path is tested on recorded NVML readings
at the GpuMonitor + Tracking level).
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from wandb_files import wandb_config, wandb_history
from conftest import EVAL_TEXT, job_env, only_run_dir, submit, train_spec, wait_for, write_spec_file
from resumes import assert_resumed
from hpcgpu.gpu.monitor import GpuMonitor
from hpcgpu.gpu.readings import RecordedSource
from hpcgpu.launch.checks import tracker_package_problem, wandb_login_problem
from hpcgpu.runtime.track import TensorBoardTracker, Tracking
from hpcgpu.spec.load import spec_from_raw

RECORDED = Path(__file__).parent / "fixtures" / "nvml_h100x8_shared.json"


# ---------------------------------------------------------------- readers

def tensorboard_events(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()  # applies purge_step: what an earlier writer logged from that step on is hidden
    return events


def metrics(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def tracker_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The job's environment, with W&B's own folders in the test's (never the user's ~/.config)."""
    env = {k: v for k, v in job_env(**extra).items() if not k.startswith("WANDB_")}
    env.update({f"WANDB_{name}_DIR": str(tmp / f"wandb-{name.lower()}") for name in ("CONFIG", "CACHE", "DATA")})
    return env


# ---------------------------------------------------------------- a job, stopped and resumed

def test_both_trackers_mirror_a_stopped_and_resumed_train_run(tmp_path: Path) -> None:
    spec = write_spec_file(tmp_path, train_spec(
        "trk", data={"eval": str(EVAL_TEXT)}, train={"eval_every": 4}, checkpoint={"every_steps": 4},
        track={"tensorboard": True, "wandb": {"project": "hpcgpu-tests", "tags": ["unit"]}, "every_steps": 2}))
    first = submit(spec, env=tracker_env(tmp_path, HPCGPU_SIGNAL_AT="9"), timeout=240)  # stops after step 10
    assert first.returncode == 75, first.stderr[-2000:]
    run_dir = only_run_dir(tmp_path / "runs", "trk")
    # as if the job had died writing its stop checkpoint: the next start resumes at step 8, so the
    # steps 9 and 10 the first job logged are run (and logged) again
    shutil.rmtree(run_dir / "checkpoints" / "step-00000010")
    second = submit(spec, env=tracker_env(tmp_path), timeout=240)
    assert second.returncode == 0, second.stderr[-2000:]
    (resume,) = metrics(run_dir, "resume")
    assert resume["step"] == 8
    assert_resumed(run_dir, at=[8])
    train = metrics(run_dir, "train")
    assert [r["step"] for r in train] == [*range(1, 11), *range(9, 13)]  # metrics.jsonl keeps every step
    tracked = [1, 2, 4, 6, 8, 10, 12]  # every_steps 2, and the first and last step
    last_loss = {r["step"]: r["loss"] for r in train}  # the resumed job's values where it logged twice

    events = tensorboard_events(run_dir / "tensorboard")
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == tracked  # continuous, each step once: the resumed job purged 9 and up
    assert all(e.value == pytest.approx(last_loss[e.step]) for e in loss)
    assert next(e for e in loss if e.step == 10).wall_time >= resume["time"] - 1  # step 10 of the second job
    assert [e.step for e in events.Scalars("eval/loss")] == [4, 8, 12]
    assert {"train/lr", "train/tokens_per_s", "train/ms_per_step"} <= set(events.Tags()["scalars"])
    config = [json.loads(e.tensor_proto.string_val[0].decode().replace("\n    ", "\n"))
              for e in events.Tensors("config/text_summary")]
    assert config[-1]["spec"]["name"] == "trk" and config[-1]["spec"]["track"]["every_steps"] == 2
    assert config[-1]["plan"]["world_size"] == 2

    run_id = (run_dir / "wandb-run-id").read_text().strip()
    files = sorted((run_dir / "wandb").glob("offline-run-*/*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # one W&B run, two starts
    first_rows, second_rows = (wandb_history(f) for f in files)
    steps = [row["_step"] for row in first_rows + second_rows]
    assert steps == tracked  # the second start sends only steps after the highest one sent (10)
    assert [row["_step"] for row in second_rows] == [12]
    rows = {row["_step"]: row for row in first_rows + second_rows}
    assert all(rows[s]["train/loss"] == pytest.approx(last_loss[s]) for s in tracked)
    assert [s for s in tracked if "eval/loss" in rows[s]] == [4, 8, 12]
    assert (run_dir / "wandb-step").read_text().strip() == "12"
    wb_config = wandb_config(files[-1])
    assert wb_config["spec"]["name"] == "trk" and wb_config["plan"]["world_size"] == 2
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "tracker tensorboard" not in log and "tracker wandb" not in log  # no tracker failed
    assert "Traceback" not in log


# W&B's helper process ended under the job, as a SIGTERM to every process of a SLURM job ends it
WANDB_CORE_ENDS = """
import logging, signal, sys
from pathlib import Path
import psutil
from hpcgpu.runtime.track import Tracking, WandbTracker
from hpcgpu.spec.load import spec_from_raw

logging.basicConfig(level=logging.WARNING)
spec = spec_from_raw({"name": "x", "task": "command", "command": ["true"], "track": {"wandb": {"project": "p"}}})
tracking = Tracking(spec, None, {"wandb": lambda purge: WandbTracker(spec, Path(sys.argv[1]))})
tracking.record("train", {"step": 1, "loss": 1.0})
for child in psutil.Process().children(recursive=True):
    if "wandb-core" in " ".join(child.cmdline()):
        child.send_signal(signal.SIGTERM)
        child.wait(30)
        print("wandb-core ended", flush=True)
tracking.record("train", {"step": 2, "loss": 0.5})
tracking.close()
"""


def test_wandb_ended_under_the_job_is_one_warning_and_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", WANDB_CORE_ENDS, str(tmp_path)], env=tracker_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "wandb-core ended" in proc.stdout
    assert proc.stderr.count("tracker wandb: log at step 2 failed") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]  # wandb's exit hook said nothing more
    # the helper died with step 1 perhaps unwritten: no step is claimed, so a resumed job sends it again
    assert not (tmp_path / "wandb-step").exists()


# ---------------------------------------------------------------- checks at submit

def test_online_wandb_without_a_login_is_one_line_at_submit(tmp_path: Path) -> None:
    spec = write_spec_file(tmp_path, train_spec("online", track={"wandb": {"mode": "online"}}))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in tracker_env(tmp_path, HOME=str(home)).items() if k not in ("NETRC",)}
    done = submit(spec, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("hpcgpu: error: track.wandb.mode: online needs a W&B login")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs" / "online").exists()


def test_a_login_is_an_api_key_or_a_netrc_entry_for_the_wandb_host(tmp_path: Path) -> None:
    spec = spec_from_raw({"name": "x", "task": "command", "command": ["true"], "track": {"wandb": {"mode": "online"}}})
    home = {"HOME": str(tmp_path)}
    assert wandb_login_problem(spec, home) is not None
    assert wandb_login_problem(spec, {**home, "WANDB_API_KEY": "k"}) is None
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_login_problem(spec, home) is None
    assert wandb_login_problem(spec, {**home, "WANDB_BASE_URL": "https://wandb.example.org"}) is not None
    offline = spec_from_raw({"name": "x", "task": "command", "command": ["true"], "track": {"wandb": {}}})
    assert offline.track.wandb is not None and offline.track.wandb.mode == "offline"
    assert wandb_login_problem(offline, {"HOME": "/nonexistent"}) is None


def test_a_missing_tracker_package_is_one_line_naming_the_extra() -> None:
    missing = lambda name: None  # noqa: E731  (find_spec where the package is not installed)
    both = spec_from_raw({"name": "x", "task": "command", "command": ["true"], "track": {"tensorboard": True, "wandb": {"project": "p"}}})
    assert "pip install 'hpcgpu[tensorboard]'" in (tracker_package_problem(both, missing) or "")
    wandb_only = spec_from_raw({"name": "x", "task": "command", "command": ["true"], "track": {"wandb": {"project": "p"}}})
    assert "pip install 'hpcgpu[wandb]'" in (tracker_package_problem(wandb_only, missing) or "")
    disabled = spec_from_raw({"name": "x", "task": "command", "command": ["true"], "track": {"wandb": {"mode": "disabled"}}})
    assert tracker_package_problem(disabled, missing) is None
    assert tracker_package_problem(both) is None  # installed here (scripts/setup.sh)
    assert spec_from_raw({"name": "x", "task": "command", "command": ["true"]}).track.wandb is None  # no W&B unless asked for


# ---------------------------------------------------------------- GPU samples, failures

class Recorder:
    """A Tracker that keeps its calls and the thread each came from."""

    name = "recorder"

    def __init__(self) -> None:
        self.logs: list[tuple[str, int, dict[str, float]]] = []
        self.configs: list[dict] = []
        self.closed = False

    def config(self, values: dict[str, Any]) -> None:
        self.configs.append(values)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logs.append((threading.current_thread().name, step, metrics))

    def close(self) -> None:
        self.closed = True


def test_gpu_monitor_samples_reach_the_trackers_from_its_thread(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    source = RecordedSource.from_file(RECORDED)
    recorder = Recorder()
    tracking = Tracking(None, None, {"recorder": lambda purge: recorder,
                                     "tensorboard": lambda purge: TensorBoardTracker(tmp_path / "tb", purge)})
    tracking.gpu_sample([{"gpu": 2, "util": 1.0}])  # before the trackers opened: dropped
    tracking.start(0)
    tracking.record("train", {"step": 3, "loss": 2.5, "lr": 1e-3, "mfu": None})
    with GpuMonitor(tmp_path, 0, 0.05, source=source, node_rank=0, on_sample=tracking.gpu_sample):
        assert wait_for(lambda: sum(who == "hpcgpu-gpu-monitor" for who, _, _ in recorder.logs) >= 2, 30)
    tracking.close()
    assert recorder.logs[0] == ("MainThread", 3, {"train/loss": 2.5, "train/lr": 1e-3})
    gpu = [(step, m) for who, step, m in recorder.logs if "gpu/2/util" in m]
    assert len(gpu) >= 3 and {step for step, _ in gpu} == {3}  # the sampler's, and the last one at stop
    reading = {r.index: r for r in source.read([2, 3], processes=False)}
    step, m = gpu[0]
    assert set(m) == {f"gpu/{i}/{k}" for i in (2, 3) for k in ("util", "mem_used_gib", "power_w", "temp_c")}
    assert m["gpu/3/util"] == reading[3].utilization and m["gpu/2/power_w"] == reading[2].power_draw
    assert m["gpu/2/mem_used_gib"] == pytest.approx(reading[2].memory_used / 2**30)
    assert recorder.closed and recorder.configs == [{"spec": None, "plan": None}]
    events = tensorboard_events(tmp_path / "tb")
    assert {"gpu/2/util", "gpu/3/temp_c", "train/loss"} <= set(events.Tags()["scalars"])
    assert events.Scalars("gpu/3/util")[0].value == reading[3].utilization


class Broken(Recorder):
    name = "broken"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise OSError(28, "No space left on device")


def test_a_failing_tracker_warns_once_and_the_others_go_on(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="hpcgpu")
    good, broken = Recorder(), Broken()

    def unavailable(purge: int | None) -> Recorder:
        raise RuntimeError("wandb: network unreachable")

    tracking = Tracking(None, None, {"broken": lambda purge: broken, "gone": unavailable,
                                     "good": lambda purge: good})
    for step in (1, 2, 3):
        tracking.record("train", {"step": step, "loss": 1.0 / step})
    tracking.record("eval", {"step": 3, "loss": 0.5})
    tracking.record("stop", {"step": 3, "reason": "interrupted"})  # not a kind the trackers mirror
    tracking.close()
    assert [(step, m) for _, step, m in good.logs] == [
        (1, {"train/loss": 1.0}), (2, {"train/loss": 0.5}), (3, {"train/loss": 1 / 3}), (3, {"eval/loss": 0.5})]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "tracker gone: not started (RuntimeError: wandb: network unreachable)" in warnings[0]
    assert "tracker broken: log at step 1 failed" in warnings[1] and "No space left" in warnings[1]
    assert broken.closed and good.closed


def test_a_failing_on_sample_leaves_gpu_jsonl_going(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    calls: list[int] = []

    def failing(records: list[dict]) -> None:
        calls.append(len(records))
        raise ValueError("tracker gone")

    gpu_jsonl = tmp_path / "gpu.jsonl"
    with GpuMonitor(tmp_path, 0, 0.05, source=RecordedSource.from_file(RECORDED), node_rank=0, on_sample=failing):
        assert wait_for(lambda: gpu_jsonl.exists() and len(gpu_jsonl.read_text().splitlines()) >= 3, 30)
    assert calls == [1]  # called once, then no more, while the samples go on
