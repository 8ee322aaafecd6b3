"""A DeepSpeed spec on the real cluster: submitted with `hpcgpu submit --gpus 2`, no ssh or hostfile."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slurm


@pytest.mark.parametrize("stage", [3])
def test_deepspeed_spec_through_submit_finishes_and_exports_a_model(slurm, stage, plain_model_vocab):
    doc = slurm.tiny_train(max_steps=12)
    doc["distributed"] = {"strategy": "deepspeed", "deepspeed": {"zero_stage": stage}}
    doc["checkpoint"] = {"every_steps": 5}
    spec = slurm.write_spec(doc)
    job, run_dir, _ = slurm.submit(spec, "--gpus", "2")
    view, _ = slurm.wait_status(job, timeout=400)
    out = slurm.job_output(run_dir, job)
    assert view["state"] == "COMPLETED", out
    assert "(deepspeed)" in out and "x 2 ranks" in out
    log = slurm.loss_log(run_dir)
    assert sorted(log) == list(range(1, 13)) and log[12] < log[1]
    assert (run_dir / "checkpoints" / "step-00000010" / "deepspeed").is_dir()
    assert plain_model_vocab(run_dir / "model") == 256  # loads and runs without DeepSpeed
