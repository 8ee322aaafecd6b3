"""task: infer with a model copy over several GPUs: the launch mapping (sbatch, local executor), the
host's decision of gpus_per_replica: auto, and each task's GPU group."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpcgpu.errors import EnvironmentError_, SpecError
from hpcgpu.launch.replicas import resolve_gpus_per_replica
from hpcgpu.launch.sbatch import render_sbatch
from hpcgpu.runtime.env import DistEnv, bind_gpu_group
from hpcgpu.spec import load_spec

# a Llama-3-8B-shaped config: 8.03e9 parameters, 14.96 GiB in bfloat16
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


def infer_spec(tmp_path: Path, gpus: int, **infer: object) -> Path:
    (tmp_path / "p.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    model = tmp_path / "llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    doc = {"name": "big", "task": "infer", "model": {"name_or_path": str(model)},
           "resources": {"gpus": gpus, "cpus_per_gpu": 3}, "infer": {"input": "p.jsonl", **infer},
           "runs_dir": str(tmp_path / "runs")}
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(doc))
    return path


def test_sbatch_runs_one_task_per_model_copy(tmp_path: Path) -> None:
    spec = load_spec(infer_spec(tmp_path, gpus=4, gpus_per_replica=2), nodes=2)
    assert (spec.gpus_per_task, spec.tasks_per_node, spec.world_size) == (2, 2, 4)
    text = render_sbatch(spec, tmp_path / "run", tmp_path / "run" / "spec.yaml")
    assert "#SBATCH --ntasks-per-node=2\n" in text and "#SBATCH --gres=gpu:4\n" in text
    assert "#SBATCH --cpus-per-task=6\n" in text  # the cores of both GPUs go to the task that drives them
    assert "srun --kill-on-bad-exit=1 --label --ntasks-per-node=2 --cpus-per-task=6" in text
    assert "4 rank(s): 2 node(s) x 4 GPU(s), 4 model copies of 2 GPUs" in text.splitlines()[1]
    assert "one task per model copy of 2 GPUs" in text


@pytest.mark.parametrize("max_memory, gpus, expect", [
    ("40GiB", 4, 1),  # 15 GiB of weights fit one GPU of 40
    ("12GiB", 4, 2),  # not one of 12, two
    ("5GiB", 4, 4),
    ("5GiB,cpu=20GiB", 4, 1),  # the rest offloaded to CPU memory
])
def test_auto_takes_the_fewest_gpus_the_weights_fit(tmp_path: Path, max_memory: str, gpus: int, expect: int) -> None:
    said: list[str] = []
    spec = resolve_gpus_per_replica(load_spec(infer_spec(tmp_path, gpus=gpus, max_memory=max_memory)), local=False,
                                    say=said.append)
    assert spec.infer.gpus_per_replica == expect and spec.world_size == gpus // expect
    assert (f"auto is {expect}" in said[0]) if expect > 1 else not said


def test_auto_that_nothing_fits_names_what_would(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        resolve_gpus_per_replica(load_spec(infer_spec(tmp_path, gpus=2, max_memory="5GiB")), local=False)
    assert "do not fit on the 2 GPU(s) of a node" in str(err.value) and "int8 or int4" in str(err.value)
    # int4 weights (about 4.5 GiB) fit where bf16 did not
    spec = load_spec(infer_spec(tmp_path, gpus=2, max_memory="5GiB"), ["model.quantization=int4"])
    assert resolve_gpus_per_replica(spec, local=False).infer.gpus_per_replica == 2


def test_auto_without_a_known_gpu_size_is_one_and_says_how_to_split(tmp_path: Path) -> None:
    said: list[str] = []
    spec = resolve_gpus_per_replica(load_spec(infer_spec(tmp_path, gpus=4)), local=False, say=said.append)
    assert spec.infer.gpus_per_replica == 1 and spec.world_size == 4
    assert "not visible from here" in said[0] and "set infer.gpus_per_replica" in said[0]


def env_of(local_rank: int, local_world: int, visible: str | None, g: int, own_group: bool = True) -> DistEnv:
    environ = {"HPCGPU_LAUNCHER": "local", "SLURM_PROCID": str(local_rank), "SLURM_LOCALID": str(local_rank),
               "SLURM_NTASKS": str(local_world), "SLURM_TASKS_PER_NODE": str(local_world), "SLURM_NNODES": "1",
               "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "1", "MASTER_PORT": "29999"}
    if visible is not None:
        environ["CUDA_VISIBLE_DEVICES"] = visible
    return DistEnv.from_environ(environ, gpus_per_task=g, own_group=own_group)


def test_each_task_sees_only_its_group_of_gpus() -> None:
    target: dict[str, str] = {}
    env = bind_gpu_group(env_of(1, 2, "4,5,6,7", 2), target)
    assert target["CUDA_VISIBLE_DEVICES"] == "6,7" and target["HPCGPU_NODE_GPUS"] == "4,5,6,7"
    assert env.visible_devices == ("6", "7") and env.device_index(2) == 0
    # SLURM bound the task to its two GPUs already: it keeps them
    target = {}
    bind_gpu_group(env_of(1, 2, "2,3", 2), target)
    assert target["CUDA_VISIBLE_DEVICES"] == "2,3"
    # nothing set: the node's GPUs in order
    target = {}
    bind_gpu_group(env_of(1, 2, None, 2), target, node_gpus=lambda: 4)
    assert target["CUDA_VISIBLE_DEVICES"] == "2,3"
    # nothing set and no GPU on the node (CPU ranks): nothing to narrow
    target = {}
    bind_gpu_group(env_of(1, 2, None, 2), target, node_gpus=lambda: 0)
    assert target == {}


def test_too_few_gpus_for_the_groups_is_one_clear_error() -> None:
    with pytest.raises(EnvironmentError_) as err:
        bind_gpu_group(env_of(0, 2, "0,1,2", 2), {})
    assert "2 model copies of 2 GPUs on this node need 4 GPUs, but 3 are visible" in str(err.value)


def test_a_training_rank_keeps_the_nodes_gpus() -> None:
    target: dict[str, str] = {}
    env = env_of(1, 2, "0,1", 1, own_group=False)
    assert bind_gpu_group(env, target) is env and target == {}
    assert env.device_index(2) == 1
    assert os.environ.get("HPCGPU_NODE_GPUS") is None


def test_an_infer_replica_of_one_gpu_sees_only_its_own(tmp_path: Path) -> None:
    # seeing the node's GPUs, it asked each for free memory: a CUDA context on every GPU and their
    # memory summed into its batch budget
    spec = load_spec(infer_spec(tmp_path, gpus=4), ["infer.gpus_per_replica=1"])
    assert spec.own_gpu_group and spec.gpus_per_task == 1
    target: dict[str, str] = {}
    env = bind_gpu_group(env_of(2, 4, "4,5,6,7", spec.gpus_per_task, spec.own_gpu_group), target)
    assert target == {"CUDA_VISIBLE_DEVICES": "6", "HPCGPU_NODE_GPUS": "4,5,6,7"}
    assert env.visible_devices == ("6",) and env.device_index(1) == 0
    # a train spec's ranks do not own their GPUs
    (tmp_path / "t.txt").write_text("text")
    assert not load_spec(infer_spec(tmp_path, gpus=4), ["task=train", f"data.train={tmp_path / 't.txt'}"]).own_gpu_group


def test_the_placement_line_gives_layers_as_ranges() -> None:
    from hpcgpu.runtime.model import compact_names

    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.5",
             "model.norm", "lm_head"]
    assert compact_names(names) == "model.embed_tokens, model.layers.0-2, model.layers.5, model.norm, lm_head"
    assert compact_names([""]) == "(whole model)"


# ---------------------------------------------------------------- the loop's stop, one rank in-process

class StopAt:
    """An engine whose batches give one row each; sets the stop flag while running batch `at`. It runs
    the batch engine's loop (BatchRunner.loop): the queue, the stop checks, the sink are the job's."""

    store_every_s = 0.0

    def __init__(self, ctx, at: int | None):
        from hpcgpu.runtime.tasks.infer import BatchRunner

        self.ctx, self.at, self.ran = ctx, at, 0
        self.loop = BatchRunner.loop.__get__(self)

    def run(self, number: int, batch: list[int]):
        from hpcgpu.runtime.tasks.infer import BatchResult

        self.ran += 1
        if self.ran == self.at:
            self.ctx.run.signals.signum = 10
        return BatchResult([{"id": i, "index": i, "text": "x"} for i in batch], 1, 1)


@pytest.mark.parametrize("stop_at, outcome, batches_run", [
    (None, "finished", 5),
    (2, "stopped", 2),  # the rank that got the signal runs no further batch
    (4, "stopped", 4),  # the last batch not run: a stop, not the end
    (5, "finished", 5),  # the signal came during the last batch: everything ran
])
def test_a_stop_ends_the_loop_at_once_and_only_a_complete_run_finishes(tmp_path: Path, stop_at: int | None,
                                                                      outcome: str, batches_run: int) -> None:
    import torch

    from hpcgpu.contract import RunPaths
    from hpcgpu.infer_inputs import Row
    from hpcgpu.runtime.context import Context
    from hpcgpu.runtime.metrics import MetricsWriter
    from hpcgpu.runtime.tasks.infer import infer_loop

    spec = load_spec(infer_spec(tmp_path, gpus=1))
    ctx = Context(env=DistEnv(), spec=spec, run_dir=tmp_path, device=torch.device("cpu"))
    rows = [Row(index=i, id=i, line=i + 1, prompt="p") for i in range(5)]
    engine = StopAt(ctx, stop_at)
    metrics = MetricsWriter(tmp_path / "metrics.jsonl", enabled=True)
    result, progress = infer_loop(ctx, RunPaths(tmp_path), engine, [[i] for i in range(5)], metrics, rows)
    metrics.close()
    assert (result, engine.ran, progress.done) == (outcome, batches_run, batches_run)


def test_a_small_model_gets_no_word_about_splitting(tmp_path: Path) -> None:
    path = infer_spec(tmp_path, gpus=2)
    doc = json.loads(path.read_text())
    doc["model"] = {"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256}}
    path.write_text(json.dumps(doc))
    said: list[str] = []
    spec = resolve_gpus_per_replica(load_spec(path), local=False, say=said.append)
    assert spec.infer.gpus_per_replica == 1 and said == []


def test_weights_that_cannot_fit_the_copys_gpus_are_one_line_naming_the_setting_that_would(monkeypatch) -> None:
    """In the job, before loading: 15 GiB of bf16 weights on one GPU with 10 GiB free (a stand-in for
    CUDA's memory readings: no GPU here)."""
    import torch

    from hpcgpu.errors import HpcgpuError
    from hpcgpu.gpu.estimate import MaxMemory
    from hpcgpu.runtime.tasks.infer import check_replica_fits
    from hpcgpu.spec.schema import Infer, Model, Resources, Spec

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # a 24 GiB card of which another process holds 14: the advice goes by the 10 free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (10 << 30, 24 << 30))
    spec = Spec(name="big", task="infer", model=Model(config=LLAMA_8B), resources=Resources(gpus=4),
                infer=Infer(input="p.jsonl", gpus_per_replica=1))
    with pytest.raises(HpcgpuError) as err:
        check_replica_fits(spec, LLAMA_8B, "bf16", torch.device("cuda", 0), MaxMemory())
    assert "15.0 GiB of bfloat16 weights do not fit on this model copy's 1 GPU(s)" in str(err.value)
    assert "set infer.gpus_per_replica: 2" in str(err.value)
    check_replica_fits(spec, LLAMA_8B, "bf16", torch.device("cuda", 0), MaxMemory(cpu=8 << 30))  # offload: fits


def test_replicas_take_batches_from_one_queue_each_once_the_faster_more() -> None:
    """Two replicas on one TCPStore (as the rendezvous makes): replica 0 runs three batches in the
    time replica 1 runs one, so it takes three times as many; every batch is taken exactly once; the
    numbers each records add up for rank 0's progress line; a stop one raises the other sees."""
    import torch
    import torch.distributed as dist

    from hpcgpu.runtime.agree import StopAgreement
    from hpcgpu.runtime.signals import StopSignals
    from hpcgpu.runtime.tasks.infer import WorkQueue

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    fast, slow = WorkQueue(server, 16, 2, 0), WorkQueue(client, 16, 2, 1)
    taken: dict[int, list[int]] = {0: [], 1: []}
    while True:
        got = [fast.take(), fast.take(), fast.take(), slow.take()]
        for q, k in zip((0, 0, 0, 1), got):
            if k is not None:
                taken[q].append(k)
        if None in got:
            break
    assert sorted(taken[0] + taken[1]) == list(range(16))
    assert (len(taken[0]), len(taken[1])) == (12, 4)
    assert fast.take() is None and slow.taken() == 16
    fast.record(rows=8, prompt_tokens=100, completion_tokens=40, peak_bytes=5 << 30)
    slow.record(rows=4, prompt_tokens=50, completion_tokens=20, peak_bytes=3 << 30)
    fast.record(rows=8, prompt_tokens=100, completion_tokens=40, peak_bytes=4 << 30)  # its peak stays 5 GiB
    assert slow.totals() == ([20, 250, 100], [5 << 30, 3 << 30])
    # the stop agreement among replicas lives in the same store (runtime/agree.py)
    signals = [StopSignals(), StopSignals()]
    agree = [StopAgreement(s, torch.device("cpu")) for s in signals]
    for agreement, store in zip(agree, (server, client)):
        agreement.among_replicas(store, 0.0)
    assert not agree[0].replica_poll() and not agree[1].replica_poll()
    signals[1].signum = 10  # the slow replica got the signal: it stops, and posts it for the other
    assert agree[1].replica_poll() and agree[0].replica_poll()


def test_one_replica_has_its_queue_in_memory() -> None:
    from hpcgpu.runtime.tasks.infer import WorkQueue

    queue = WorkQueue.for_job(3, 1, 0)
    assert [queue.take() for _ in range(4)] == [0, 1, 2, None] and queue.taken() == 3
