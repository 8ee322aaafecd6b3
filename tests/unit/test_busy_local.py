"""Busy GPUs under the local executor and the queue, against recorded NVML readings of a shared
8 x H100 node (tests/unit/fixtures/nvml_h100x8_shared.json): GPUs 0 and 1 run someone's training
(78% memory, 98% utilization, one process each), GPU 4 holds a small process, GPU 7 is 37% utilized;
2, 3, 5 and 6 are free. The jobs are `task: command` programs that only record the GPUs they were
given, so they run on this CPU machine as they would on the node."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import job_env, submit, write_spec_file
from hpcgpu.launch.registry import Registry

pytestmark = pytest.mark.slow

RECORDED = Path(__file__).parent / "fixtures" / "nvml_h100x8_shared.json"
SEEN = "import json, os; print('visible', json.dumps(os.environ.get('CUDA_VISIBLE_DEVICES')))"


def spec_file(folder: Path, **resources: object) -> Path:
    return write_spec_file(folder, {"name": "seen", "task": "command",
                                    "resources": {"gpus": 2, "cpus_per_gpu": 1, **resources},
                                    "command": [sys.executable, "-c", SEEN]})


def on_the_node(folder: Path, visible: str | None = None) -> dict[str, str]:
    env = job_env(HPCGPU_NVML_RECORDED=str(RECORDED), HPCGPU_REGISTRY=str(folder / "jobs.db"))
    if visible is None:
        del env["CUDA_VISIBLE_DEVICES"]  # job_env hides every GPU; this node shows all eight
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hpcgpu: warning: GPU")]


def test_a_busy_chosen_gpu_is_a_warning_with_its_processes_and_the_job_runs(tmp_path):
    done = submit(spec_file(tmp_path), env=on_the_node(tmp_path, "3,0"))
    assert done.returncode == 0, done.stderr
    (line,) = warnings(done.stderr)
    assert line.startswith("hpcgpu: warning: GPU 0 (NVIDIA H100 80GB HBM3) is busy: memory 78% used, "
                           "utilization 98%, 1 compute process(es); 62.0 of 79.6 GiB used"), line
    assert "processes: pid 412233 python (61.5 GiB)" in line
    assert 'visible "3,0"' in done.stdout  # the ranks got the GPUs chosen, the busy one too
    (record,) = Registry(tmp_path / "jobs.db").recent()
    assert record.state == "COMPLETED" and record.gpus == 2


@pytest.mark.parametrize("how", ["CUDA_VISIBLE_DEVICES", "resources.devices"])
def test_every_chosen_gpu_busy_is_refused_unless_ignore_busy(tmp_path, how):
    if how == "resources.devices":
        spec, env = spec_file(tmp_path, gpus=1, devices="4"), on_the_node(tmp_path)
    else:
        spec, env = spec_file(tmp_path), on_the_node(tmp_path, "1,0,3")  # 2 ranks: GPUs 1 and 0
    refused = submit(spec, env=env)
    assert refused.returncode == 2, refused.stderr
    *warned, error = refused.stderr.strip().splitlines()
    assert warned == warnings(refused.stderr) and len(warned) == (1 if how == "resources.devices" else 2)
    assert all("GiB used; processes: pid " in w for w in warned), warned
    assert error.startswith("hpcgpu: error: every GPU chosen for seen is busy (GPU ")
    assert "(free here: 2,3,5,6), or add --ignore-busy" in error
    assert not (tmp_path / "runs").exists() and not (tmp_path / "jobs.db").exists()  # nothing started

    forced = submit(spec, "--ignore-busy", env=env)
    assert forced.returncode == 0, forced.stderr
    assert warnings(forced.stderr) == warned  # still said, then run anyway
    assert ('visible "4"' if how == "resources.devices" else 'visible "1,0"') in forced.stdout


def test_the_queue_honours_busy_thresholds_and_flags(tmp_path):
    lenient = {"memory_pct": 90, "util_pct": 99, "processes": False}
    spec_file(tmp_path, gpus=1, busy=lenient)
    queue = tmp_path / "jobs.queue"
    queue.write_text("seen.yaml\n")

    def pool(*flags: str) -> str:
        done = subprocess.run([sys.executable, "-m", "hpcgpu", "queue", str(queue), "--dry-run", *flags],
                              capture_output=True, text=True, env=on_the_node(tmp_path), cwd=tmp_path, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "over GPUs 0,1,2,3,4,5,6,7" in pool()  # resources.busy: none of them counts as busy
    assert "over GPUs 2,3,4,5,6" in pool("--busy-util-pct", "30")  # the flag wins: 0, 1 and 7 are busy
    queue.write_text("seen.yaml --set resources.busy.processes=true\n")
    out = pool("--busy-util-pct", "50")
    assert "over GPUs 2,3,5,6,7" in out  # GPU 4's process counts again; 7 is under 50%
    assert "GPU 4 left out, busy: 1 compute process(es); 1.5 of 79.6 GiB used; processes: pid 98765" in out
    forced = pool("--ignore-busy")
    assert "over GPUs 0,1,2,3,4,5,6,7" in forced and "GPU 0 is busy: " in forced
    assert "processes: pid 412233 python (61.5 GiB); used anyway (--ignore-busy)" in forced

