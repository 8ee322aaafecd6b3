"""A train run goes on at another width (DDP, CPU ranks): stopped at 2 ranks and resumed at 1, or at 1
and resumed at 2, it follows the uninterrupted run's loss curve at the same global batch; the plan
records the widths; a width that does not divide the global batch is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import job_env, only_run_dir, step_losses, submit, train_spec, write_spec_file
from resumes import assert_resumed

STEPS = 8


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_stopped_run_goes_on_at_another_width_on_the_same_curve(tmp_path: Path, before: int, after: int) -> None:
    spec = write_spec_file(tmp_path, train_spec("width", train={"max_steps": STEPS}))
    stopped = submit(spec, "--gpus", str(before), env=job_env(HPCGPU_SIGNAL_AT="3"))  # stops after step 4
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    if before == 2:  # a width that does not divide the global batch of 8: one line, nothing started
        bad = submit(spec, "--gpus", "3")
        assert bad.returncode == 2 and "not divisible by the 3 ranks" in bad.stderr, bad.stderr[-2000:]
    again = submit(spec, "--gpus", str(after))
    assert again.returncode == 0, again.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs", "width")
    assert (f"resuming the unfinished run {run_dir} from step 4 at {after} GPUs (it ran at {before}; the global "
            "batch stays 8)") in again.stderr, again.stderr[-2000:]
    assert_resumed(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == after and plan["widths"] == [before, after]
    assert plan["train"]["batch_per_rank"] == 8 // after
    baseline = tmp_path / "baseline"
    base = submit(write_spec_file(baseline, train_spec("width", train={"max_steps": STEPS})), "--gpus", "2")
    assert base.returncode == 0, base.stderr[-3000:]
    got, want = step_losses(run_dir), step_losses(only_run_dir(baseline / "runs", "width"))
    assert got.keys() == want.keys() == set(range(1, STEPS + 1))
    for step in want:  # the same global batches in the same order; only the sums' grouping differs
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
