"""task: infer on the real local cluster: 2 replicas on 2 nodes, preempted mid-run with
`scancel --signal=USR2 --full`, requeued, and finished with every input row exactly once."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

# with max_new_tokens 128 and the model below: ~10 rows/s on 2 CPU ranks of this 2-core VM, whose two
# SLURM "nodes" are one machine (0.7 rows/s while each rank ran 2 torch threads on the 2 cores: see
# set_cpu_threads in runtime/dist.py); long enough to be preempted mid-run, short enough for
# the waits below
ROWS = 240


def replica_records(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / "outputs").glob("replica-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a row still being written
    return out


def test_infer_two_nodes_preempted_requeued_every_row_once(slurm):
    model = slurm.tmp / "model"
    made = subprocess.run([sys.executable, str(slurm.repo / "scripts" / "make_tiny_model.py"), str(model),
                           "--n-layer", "4", "--n-embd", "256", "--n-head", "4"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    shipped = slurm.repo / "configs" / "data" / "prompts.jsonl"
    prompts = [json.loads(line) for line in shipped.read_text().splitlines()]
    rows = [{**prompts[i % len(prompts)], "id": f"row-{i:03d}"} for i in range(ROWS)]
    source = slurm.tmp / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = slurm.write_spec({
        "name": "infer", "task": "infer", "resources": {"gpus": 1, "cpus_per_gpu": 1, "time": "00:10:00"},
        "model": {"name_or_path": str(model)},
        "infer": {"input": str(source), "max_new_tokens": 128, "batch_size": 4, "gpus_per_replica": 2},
    })
    # 2 nodes x 2 GPUs, a model copy over 2 GPUs: one task (replica) per node
    job, run_dir, _ = slurm.submit(spec, "--nodes", "2", "--gpus", "2")

    slurm.wait_for(lambda: len(replica_records(run_dir)) > 0, timeout=180, what="the first rows written")
    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
    info = slurm.wait(job, timeout=300, states={"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    out = slurm.job_output(run_dir, job)
    assert info["JobState"] == "COMPLETED", out
    assert info["Restarts"] == "1", info
    assert info["NodeList"] == "n[1-2]", info
    assert info["NumTasks"] == "2" and "cpu=4," in info["TRES"], info  # a task per copy, the cores of its 2 GPUs
    assert "x 2 replica(s)" in out and "requeued job" in out
    assert "2 ranks share this machine's 2 cores: 1 torch thread(s) per rank" in out, out

    events = [r for r in slurm.metrics(run_dir) if r["kind"] in ("stop", "resume", "end")]
    assert [e["kind"] for e in events] == ["stop", "resume", "end"], events
    stop, resume, end = events
    assert stop["reason"] == "preempted" and stop["restart_count"] == 0
    assert 0 < stop["rows"] < ROWS  # stopped mid-run, after some rows
    assert resume["restart_count"] == 1 and resume["rows"] == stop["rows"]  # the resumed job kept them
    assert end["rows"] == ROWS and end["rows_this_start"] == ROWS - stop["rows"]

    # every row exactly once: in outputs.jsonl, in input order; and once over the replicas' files
    merged = [json.loads(line) for line in (run_dir / "outputs.jsonl").read_text().splitlines()]
    assert [r["id"] for r in merged] == [r["id"] for r in rows]
    assert [r["index"] for r in merged] == list(range(ROWS))
    assert all(isinstance(r["text"], str) and r["completion_tokens"] >= 1 for r in merged)
    written = [r["id"] for r in replica_records(run_dir)]
    assert sorted(written) == sorted(r["id"] for r in rows)  # none twice, none missing
    assert (run_dir / "FINISHED").exists()
