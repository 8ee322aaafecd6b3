"""CUDA only: ctx.prepare with SyncBatchNorm on 2 GPUs gives the BatchNorm statistics one GPU gets from
the whole batch (each rank sees half of it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

two_gpus = pytest.mark.two_gpus

SYNCBN = '''
import json, torch
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 12, 12, generator=g) * 3 + 1
def main(ctx):
    m = model()
    net, opt = ctx.prepare(m, torch.optim.SGD(m.parameters(), lr=0.0))
    half = batch()[ctx.rank * 8:(ctx.rank + 1) * 8].to(ctx.device)
    net.train()
    net(half)
    bn = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)][0]
    out = {"kind": type(bn).__name__, "mean": bn.running_mean.tolist(), "var": bn.running_var.tolist()}
    (ctx.run_dir / f"bn-{ctx.rank}.json").write_text(json.dumps(out))
    return 0
'''

ONE_GPU = """
import json, syncbn
net = syncbn.model().cuda().train()
net(syncbn.batch().cuda())
print(json.dumps({"mean": net[1].running_mean.tolist(), "var": net[1].running_var.tolist()}))
"""


@two_gpus
def test_sync_batchnorm_on_two_gpus_matches_one_gpu_with_the_whole_batch(tmp_path: Path) -> None:
    (tmp_path / "syncbn.py").write_text(SYNCBN)
    spec = {"name": "syncbn", "task": "callable", "entry": "syncbn:main", "runs_dir": str(tmp_path / "runs"),
            "resources": {"gpus": 2, "cpus_per_gpu": 2}, "env": {"PYTHONPATH": str(tmp_path)},
            "train": {"precision": "fp32"}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", "--new"],
                          capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "syncbn").iterdir()
    ranks = [json.loads((run_dir / f"bn-{r}.json").read_text()) for r in (0, 1)]
    assert all(r["kind"] == "SyncBatchNorm" for r in ranks)

    # the same model and batch on one GPU, in a subprocess: a CUDA context in the pytest process would
    # make GPU 0 look busy to every later test's busy-GPU check
    ref = subprocess.run([sys.executable, "-c", ONE_GPU], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ})
    assert ref.returncode == 0, ref.stderr[-3000:]
    one = json.loads(ref.stdout.strip().splitlines()[-1])
    for r in ranks:
        assert torch.allclose(torch.tensor(r["mean"]), torch.tensor(one["mean"]), atol=1e-5)
        assert torch.allclose(torch.tensor(r["var"]), torch.tensor(one["var"]), atol=1e-4)
