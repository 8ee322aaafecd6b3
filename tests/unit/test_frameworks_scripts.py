"""Real public scripts as `task: command` on the local executor (issue 34): each runs unchanged (or
with the smallest CPU patch, stated in its fixture's header) at 2 ranks as ONE distributed job.

The scripts live in tests/unit/fixtures/frameworks/<name>/, fetched with their commit pinned:
pytorch/examples' DDP tutorial `multinode.py` and nanoGPT's `train.py`. One group of 2 is shown three
ways: the script's own output (what only a 2-rank group prints), and an observer that the program
does not see (a sitecustomize.py on PYTHONPATH, through the spec's env:) which, when the script calls
destroy_process_group, all-gathers each rank's (RANK, WORLD_SIZE, group rank, group size) and a
digest of its DDP model's weights: every rank must list both ranks, and end with the same weights
although each rank trained on other data, which only DDP's gradient averaging gives.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import only_run_dir, submit_all, write_spec_file

pytestmark = pytest.mark.slow

FRAMEWORKS = Path(__file__).resolve().parent / "fixtures" / "frameworks"

# Imported by every Python the program starts (PYTHONPATH from the spec's env:); acts only in a
# process that has torchrun's RANK, i.e. the user's program, never hpcgpu's own wrapper.
OBSERVER = '''
import os

if os.environ.get("RANK") is not None and os.environ.get("FRAMEWORK_OBSERVE_OUT"):
    import torch.distributed as _dist

    _destroy = _dist.destroy_process_group

    def _observed_destroy(*args, **kwargs):
        if _dist.is_initialized():
            import gc, hashlib, json
            from torch.nn.parallel import DistributedDataParallel

            import warnings

            with warnings.catch_warnings():  # isinstance on every object touches deprecated ones
                warnings.simplefilter("ignore")
                models = [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]
            digest = hashlib.sha256()
            for p in (models[0].module.parameters() if models else ()):
                digest.update(p.detach().cpu().contiguous().numpy().tobytes())
            mine = {"env_rank": int(os.environ["RANK"]), "env_world_size": int(os.environ["WORLD_SIZE"]),
                    "rank": _dist.get_rank(), "world_size": _dist.get_world_size(),
                    "ddp_models": len(models), "weights": digest.hexdigest()}
            group = [None] * _dist.get_world_size()
            _dist.all_gather_object(group, mine)
            path = os.path.join(os.environ["FRAMEWORK_OBSERVE_OUT"], "observed-%s.json" % os.environ["RANK"])
            with open(path, "w") as f:
                json.dump({"me": mine, "group": group}, f)
        return _destroy(*args, **kwargs)

    _dist.destroy_process_group = _observed_destroy  # before the script's `from torch.distributed import`
'''

EPOCHS, BATCH = 2, 64                  # multinode.py: MyTrainDataset(2048), a DistributedSampler
NANO_ITERS, NANO_ACCUM = 3, 2          # nanoGPT: iterations after iter 0; gradient accumulation (global)
NANO_BATCH, NANO_BLOCK = 4, 32
NANO_ARGS = [
    "--device=cpu", "--compile=False", "--backend=gloo", "--dtype=float32", "--dataset=tiny",
    "--n_layer=1", "--n_head=2", "--n_embd=32", f"--block_size={NANO_BLOCK}", f"--batch_size={NANO_BATCH}",
    f"--gradient_accumulation_steps={NANO_ACCUM}", f"--max_iters={NANO_ITERS}", "--eval_interval=1000",
    "--eval_iters=2", "--log_interval=1", "--decay_lr=False", "--learning_rate=0.01",
]


def project(folder: Path, name: str) -> Path:
    """The user's project folder: the fetched files, copied as they are (the submit folder, where the
    ranks start: nanoGPT reads configurator.py and data/ relative to it)."""
    for path in (FRAMEWORKS / name).glob("*.py"):
        shutil.copy(path, folder / path.name)
    (folder / "observer").mkdir()
    (folder / "observer" / "sitecustomize.py").write_text(OBSERVER)
    return folder


def command_spec(name: str, folder: Path, argv: list[str]) -> dict:
    return {"name": name, "task": "command", "resources": {"gpus": 2, "cpus_per_gpu": 1},
            "command": [sys.executable, *argv],
            "env": {"PYTHONPATH": str(folder / "observer"), "FRAMEWORK_OBSERVE_OUT": str(folder)}}


def tiny_nanogpt_data(folder: Path, vocab: int = 64) -> None:
    """nanoGPT's data layout (data/<dataset>/train.bin, val.bin of uint16 tokens, meta.pkl with the
    vocab size, as its shakespeare_char prepare.py writes them), a few thousand random tokens."""
    data = folder / "data" / "tiny"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, 4000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, vocab, 1000, dtype=np.uint16).tofile(data / "val.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab}))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both scripts at 2 local ranks, started together (2 cores: most of a run is torch's start-up)."""
    multinode = project(tmp_path_factory.mktemp("multinode"), "multinode")
    nanogpt = project(tmp_path_factory.mktemp("nanogpt"), "nanogpt")
    tiny_nanogpt_data(nanogpt)
    specs = {
        "multinode": write_spec_file(multinode, command_spec(
            "multinode", multinode, ["multinode.py", str(EPOCHS), "1", f"--batch_size={BATCH}"])),
        "nanogpt": write_spec_file(nanogpt, command_spec("nanogpt", nanogpt, ["train.py", *NANO_ARGS])),
    }
    results = submit_all({key: (path, ()) for key, path in specs.items()}, timeout=150)
    return {key: (results[key], path.parent) for key, path in specs.items()}


def rank_logs(folder: Path, name: str) -> list[str]:
    run_dir = only_run_dir(folder / "runs", name)
    return [(run_dir / "logs" / f"rank-{rank}.log").read_text(errors="replace") for rank in range(2)]


def assert_one_group_of_two(folder: Path, logs: list[str]) -> None:
    seen = {}
    for rank in range(2):
        path = folder / f"observed-{rank}.json"
        assert path.exists(), f"rank {rank} never reached destroy_process_group:\n{logs[rank][-3000:]}"
        seen[rank] = json.loads(path.read_text())
    for rank, view in seen.items():
        me = view["me"]
        assert (me["env_rank"], me["rank"], me["env_world_size"], me["world_size"]) == (rank, rank, 2, 2), me
        assert me["ddp_models"] == 1, me
        # one group: the all-gather in it brought both ranks' views to each rank
        assert view["group"] == [seen[0]["me"], seen[1]["me"]], view
    # DDP averaged the gradients: the ranks trained on other data and end with the same weights
    assert seen[0]["me"]["weights"] == seen[1]["me"]["weights"]


def test_ddp_tutorial_multinode_runs_as_one_job_of_two(jobs: dict) -> None:
    proc, folder = jobs["multinode"]
    logs = rank_logs(folder, "multinode")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[1][-3000:]
    # the script's own line: a DistributedSampler over the group splits the 2048 samples in two
    steps = 2048 // 2 // BATCH
    for rank, log in enumerate(logs):
        epochs = re.findall(rf"^\[GPU{rank}\] Epoch (\d+) \| Batchsize: {BATCH} \| Steps: (\d+)$", log, re.M)
        assert epochs == [(str(e), str(steps)) for e in range(EPOCHS)], log[-3000:]
    assert "Training snapshot saved" in logs[0] and "snapshot saved" not in logs[1]  # rank 0 saves
    assert (folder / "snapshot.pt").exists()  # where the script writes it: the folder it starts in
    assert_one_group_of_two(folder, logs)


def test_nanogpt_train_runs_as_one_job_of_two(jobs: dict) -> None:
    proc, folder = jobs["nanogpt"]
    logs = rank_logs(folder, "nanogpt")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[1][-3000:]
    # each rank split the accumulation by WORLD_SIZE: tokens per iteration are the global batch's
    tokens = NANO_ACCUM * NANO_BATCH * NANO_BLOCK
    for log in logs:
        assert f"tokens per iteration will be: {tokens:,}" in log, log[-3000:]
    # only the master process (RANK 0) evaluates and logs
    assert re.findall(r"^iter (\d+): loss", logs[0], re.M) == [str(i) for i in range(NANO_ITERS + 1)], logs[0]
    assert "iter 0: loss" not in logs[1] and "step 0: train loss" in logs[0]
    assert_one_group_of_two(folder, logs)
