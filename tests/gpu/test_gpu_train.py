"""CUDA only: nccl training on 2 GPUs, device binding under non-trivial CUDA_VISIBLE_DEVICES.

Skipped where CUDA is absent (CI never has a GPU); run on a GPU machine with `pytest tests/gpu -m gpu`.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

two_gpus = pytest.mark.two_gpus  # tests/gpu/conftest.py: gpu marker and the CUDA skips

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "configs" / "data" / "pydocs.txt"


def submit(spec: dict, tmp: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    spec = {"runs_dir": str(tmp / "runs"), **spec}
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", "--new", *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    run_dir = Path(proc.stderr.split("run dir ")[1].split()[0].rstrip(",")) if "run dir " in proc.stderr else tmp
    return proc, run_dir


def train_spec(gpus: int, steps: int = 30) -> dict:
    return {
        "name": "gputrain", "task": "train",
        "resources": {"gpus": gpus, "cpus_per_gpu": 2},
        "model": {"config": {"model_type": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 256, "n_positions": 256,
                             "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}},
        "data": {"train": str(TEXT), "seq_len": 256},
        "train": {"global_batch_size": 32, "micro_batch_size": 8, "max_steps": steps, "lr": 1e-3,
                  "warmup_steps": 5, "log_every": 1},
        "checkpoint": {"every_steps": 10},
    }


@two_gpus
def test_two_gpu_nccl_training(tmp_path):
    proc, run_dir = submit(train_spec(2), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cuda:0 x 2 (ddp)" in proc.stdout and "bf16" in proc.stdout
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in train)  # the detected GPU's peak is known
    assert (run_dir / "model" / "model.safetensors").exists()


@two_gpus
def test_auto_settings_are_decided_once_from_the_real_gpu_and_recorded(tmp_path):
    spec = train_spec(2, steps=6)
    spec["train"]["micro_batch_size"] = "auto"
    spec["distributed"] = {"strategy": "auto"}
    proc, run_dir = submit(spec, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    total = torch.cuda.get_device_properties(0).total_memory
    assert plan["world_size"] == 2 and plan["gpu_memory"] == total and plan["precision"] == "bf16"
    t = plan["train"]
    assert t["strategy"] == "ddp" and t["micro_batch"] * t["accum"] * 2 == 32 and t["fits"] is True
    assert "run plan: ddp" in proc.stdout


CALLABLE = '''
import json, os, torch, torch.distributed as dist
def main(ctx):
    x = torch.ones(1, device=ctx.device) * (ctx.rank + 1)
    dist.all_reduce(x)
    props = torch.cuda.get_device_properties(ctx.device)
    out = {"rank": ctx.rank, "device": str(ctx.device), "uuid": str(props.uuid), "sum": x.item(),
           "backend": dist.get_backend(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    (ctx.run_dir / f"bind-{ctx.rank}.json").write_text(json.dumps(out))
    return 0
'''


def physical_uuids() -> list[str]:
    out = subprocess.run([sys.executable, "-c", "import torch, json; print(json.dumps([str(torch.cuda."
                          "get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]))"],
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if k != "CUDA_VISIBLE_DEVICES"})
    return json.loads(out.stdout)


@two_gpus
@pytest.mark.parametrize("visible", ["1,0"])
def test_local_rank_binds_to_the_nth_visible_gpu(tmp_path, visible):
    (tmp_path / "bindmod.py").write_text(CALLABLE)
    spec = {"name": "bind", "task": "callable", "entry": "bindmod:main", "resources": {"gpus": 2},
            "env": {"PYTHONPATH": str(tmp_path)}}
    proc, run_dir = submit(spec, tmp_path, env={"CUDA_VISIBLE_DEVICES": visible})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uuids = physical_uuids()
    order = [int(i) for i in visible.split(",")]
    for rank in (0, 1):
        got = json.loads((run_dir / f"bind-{rank}.json").read_text())
        assert got["backend"] == "nccl" and got["sum"] == 3.0
        assert got["device"] == f"cuda:{rank}"
        assert got["uuid"] == uuids[order[rank]]  # local rank N -> the N-th GPU in CUDA_VISIBLE_DEVICES


@two_gpus
def test_slurm_style_one_gpu_per_task(tmp_path):
    """srun --gpus-per-task=1 gives each task only its own GPU: every rank uses cuda:0 of its view."""
    (tmp_path / "bindmod.py").write_text(CALLABLE)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "bind", "task": "callable", "entry": "bindmod:main",
                                         "resources": {"gpus": 2}}))
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "HPCGPU_RUN_DIR": str(tmp_path),
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
               "SLURM_TASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1",
               "CUDA_VISIBLE_DEVICES": str(1 - rank)}
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcgpu", "run", str(spec_path)], env=env))
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    uuids = physical_uuids()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"bind-{rank}.json").read_text())
        assert got["device"] == "cuda:0" and got["uuid"] == uuids[1 - rank] and got["sum"] == 3.0


NO_WAIT = """
import torch
from hpcgpu.runtime.tasks.train import fetch_batch
dev = torch.device("cuda", 0)
blocks = torch.arange(64 * 8, device=dev).view(64, 8)
idx = torch.randperm(64)[:4]
fetch_batch(blocks, idx, dev)  # a step before: the pinned block is cached, as in a running loop
torch.cuda.synchronize()
torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the fetch
queued = torch.cuda.Event()
queued.record()
batch = fetch_batch(blocks, idx, dev)
ahead = not queued.query()  # the host got here while the GPU still slept
torch.cuda.synchronize()
print(ahead, torch.equal(batch.cpu(), blocks.cpu()[idx]))
"""


def test_a_batch_of_gpu_resident_tokens_is_fetched_without_waiting_for_the_gpu():
    """The step's index copy must not make the host wait for the GPU's queue (a copy from pageable
    memory does): a wait each step leaves the GPU idle while the host queues the next step."""
    proc = subprocess.run([sys.executable, "-c", NO_WAIT], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True"], proc.stdout


def test_async_checkpoints_stage_through_pinned_buffers_and_resume(tmp_path):
    """Several async saves on one GPU reuse the pinned stager (no fallback to default staging), and a
    preempted run resumes from them."""
    spec = train_spec(1, steps=20)
    spec["checkpoint"] = {"every_steps": 4, "async": True, "keep": 2}
    first, run_dir = submit(spec, tmp_path, env={"HPCGPU_SIGNAL_AT": "13"})  # stops after step 14
    assert first.returncode == 75, first.stdout[-3000:] + first.stderr[-3000:]
    path = tmp_path / "spec.yaml"
    again = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    logs = first.stdout + first.stderr + again.stdout + again.stderr + (run_dir / "logs" / "rank-0.log").read_text()
    assert "checkpoint step-00000012 saved" in logs
    assert "pinned checkpoint staging failed" not in logs
    resume = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"resume"' in line]
    assert resume and resume[-1]["checkpoint"] == "step-00000014"


def test_deepspeed_spec_on_one_gpu(tmp_path):
    """A ZeRO-2 spec scaled down to one GPU: DeepSpeed gets a one-rank nccl group and exports a model."""
    pytest.importorskip("deepspeed")
    spec = train_spec(1, steps=12)
    spec["distributed"] = {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2}}
    proc, run_dir = submit(spec, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"train"' in line]
    assert train[-1]["loss"] < train[0]["loss"] and (run_dir / "model" / "model.safetensors").exists()


def oom_spec(micro: int | str) -> dict:
    """A 400M-parameter model at seq_len 1024: micro batch 256 needs about 400 GB of activations."""
    spec = train_spec(1, steps=2)
    spec["model"]["config"].update({"n_layer": 8, "n_head": 16, "n_embd": 2048, "n_positions": 1024})
    spec["data"]["seq_len"] = 1024
    spec["train"].update({"global_batch_size": 256, "micro_batch_size": micro, "compile": False,
                          "warmup_steps": 1})
    spec.pop("checkpoint")
    return spec


def test_a_micro_batch_that_does_not_fit_is_halved_until_it_does(tmp_path):
    """micro_batch_size: auto, with HPCGPU_GPU_MEMORY claiming a huge card so that the plan picks 256:
    the first step really runs out of memory, the micro batch is halved (recorded in plan.json) until
    it fits, and the run finishes with the global batch it asked for."""
    proc, run_dir = submit(oom_spec("auto"), tmp_path, env={"HPCGPU_GPU_MEMORY": "4000G"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())["train"]
    assert plan["oom_halvings"] >= 1 and plan["micro_batch"] == 256 >> plan["oom_halvings"]
    assert plan["micro_batch"] * plan["accum"] == 256
    assert "out of memory in the first step on rank(s) 0 at micro batch 256" in proc.stdout + proc.stderr
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert [r["step"] for r in train] == [1, 2] and all(r["tokens"] == r["step"] * 256 * 1024 for r in train)


def test_a_fixed_micro_batch_that_does_not_fit_is_one_line(tmp_path):
    proc, _ = submit(oom_spec(256), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "train.micro_batch_size: 256 does not fit in GPU memory" in line]
    assert len(lines) == 1 and lines[0].startswith("hpcgpu: error:") and "`hpcgpu estimate` puts" in lines[0], out


@two_gpus
def test_profile_of_two_gpu_steps_times_kernels_and_nccl(tmp_path):
    """train.profile on 2 GPUs (DDP, compiled): each rank writes a Chrome trace with GPU kernels and a
    summary whose kernel, NCCL and compute times per step are real (the CPU tests see no kernels)."""
    spec = train_spec(2, steps=8)
    spec["train"]["profile"] = {"start_step": 5, "steps": 2}
    proc, run_dir = submit(spec, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        trace = json.loads((run_dir / "profile" / f"rank{rank}.trace.json").read_text())
        assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
        text = (run_dir / "profile" / f"rank{rank}.txt").read_text()
        assert f"profile of steps 5-6 on rank {rank} (cuda:{rank}" in text, text[:500]
        line = next(x for x in text.splitlines() if x.startswith("device time per step"))
        kernels, nccl, compute = (float(line.split(name)[1].split(" ms")[0]) for name in
                                  ("all kernels ", "NCCL ", "compute "))
        assert kernels > 0 and nccl > 0 and compute > 0 and abs(kernels - nccl - compute) < 0.2, line
        # the busiest stream's busy and idle time make up the wall time (annotations are no kernels)
        wall = float(re.search(r"([\d.]+) ms/step wall", text).group(1))
        busy, pct, idle = map(float, re.search(r"GPU busy ([\d.]+) ms/step \(([\d.]+)% of wall\), GPU idle "
                                               r"([\d.]+) ms/step", text).groups())
        assert 0 < pct <= 100 and abs(busy + idle - wall) < 0.3, text[:800]
    print("\n" + (run_dir / "profile" / "rank0.txt").read_text()[:1500])


def test_fused_loss_matches_hugging_faces_and_trains(tmp_path):
    """train.fused_loss through Liger's kernel: the same loss and gradients as HF's (bf16 autocast), and
    a run with it on says so and learns (carry liger-kernel: pip install 'hpcgpu[fused]')."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpcgpu.runtime.fused_loss import FusedLossLM, liger_sum_loss

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=32000)).cuda()
    ids = torch.randint(0, 32000, (4, 128), device="cuda")
    labels = ids.clone()
    labels[:, :20] = -100
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = lm(input_ids=ids, labels=labels).loss
    want.backward()
    want_grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = FusedLossLM(lm, liger_sum_loss())(ids, labels)
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=2e-2)
    for w, p in zip(want_grads, lm.parameters()):
        assert torch.allclose(p.grad.float(), w.float(), rtol=5e-2, atol=5e-3)
    del lm, want, got, want_grads
    spec = train_spec(1, steps=30)
    spec["train"]["fused_loss"] = True
    proc, run_dir = submit(spec, tmp_path, "--ignore-busy")  # this test's own CUDA context is on GPU 0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fused loss (Liger)" in proc.stdout
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0


@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=two_gpus)])
def test_cuda_graphs_train_and_log_every_step(tmp_path, gpus):
    """train.compile_mode: reduce-overhead replays the step as CUDA graphs (DDP's buckets at 2): the run
    learns, and every logged loss is its own step's (a graph's output buffer is overwritten by the next
    replay: a loss read late would repeat)."""
    spec = train_spec(gpus, steps=30)
    spec["train"]["compile_mode"] = "reduce-overhead"
    # an earlier test of this process (the fused loss's) may have left its CUDA context on GPU 0
    proc, run_dir = submit(spec, tmp_path, "--ignore-busy")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in train if r["kind"] == "train"]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0
    assert len(set(losses)) == len(losses)
