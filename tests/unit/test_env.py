"""DistEnv.from_environ over the environments a rank really starts in: srun, torchrun, the local
executor, a batch script, a plain process; and the inconsistent ones, which must fail with one clear
error before any process group starts."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcgpu.errors import EnvironmentError_, HpcgpuError
from hpcgpu.hostlist import port_for_job
from hpcgpu.runtime import env as launchers
from hpcgpu.runtime.env import DistEnv

# srun -N1 --ntasks-per-node=4 --gpus-per-node=4, as task 2 sees it
SRUN_1x4 = {
    "SLURM_PROCID": "2", "SLURM_LOCALID": "2", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4",
    "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu07", "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}
# srun -N2 --ntasks-per-node=4, task 5 (second node, local rank 1)
SRUN_2x4 = {
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "900123",
    "SLURM_STEP_ID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}
# srun -n3 over two nodes: 2 tasks on the first, 1 on the second
SRUN_HETERO = {
    "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "cn[7,9]", "SLURM_JOB_ID": "55", "SLURM_STEP_ID": "0",
}
TORCHRUN = {
    "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    "MASTER_ADDR": "node-a", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "0",
}

CASES = {
    "srun-1-node-4-tasks": (SRUN_1x4, dict(
        rank=2, local_rank=2, world_size=4, local_world_size=4, node_rank=0, num_nodes=1,
        master_addr="gpu07", master_port=port_for_job("4242"), launcher=launchers.SLURM, job_id="4242",
        hosts=("gpu07",), visible_devices=("0", "1", "2", "3"), requeue_target="4242", is_main=False,
        distributed=True, restart_count=0)),
    "srun-2-nodes-rank-5": (SRUN_2x4, dict(
        rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="gpu01", hosts=("gpu01", "gpu02"), launcher=launchers.SLURM)),
    "srun-hetero-first-node": ({**SRUN_HETERO, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0"},
                               dict(rank=1, local_rank=1, world_size=3, local_world_size=2, node_rank=0,
                                    num_nodes=2, master_addr="cn7")),
    "srun-hetero-second-node": ({**SRUN_HETERO, "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1"},
                                dict(rank=2, local_rank=0, world_size=3, local_world_size=1, node_rank=1,
                                     num_nodes=2, master_addr="cn7", hosts=("cn7", "cn9"))),
    "array-task": ({**SRUN_1x4, "SLURM_JOB_ID": "130", "SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "4"},
                   dict(job_id="130", array_job_id="123", array_task_id="4", requeue_target="123_4",
                        master_port=port_for_job("130"))),
    "requeued-twice": ({**SRUN_1x4, "SLURM_RESTART_COUNT": "2"}, dict(restart_count=2, rank=2)),
    "torchrun": (TORCHRUN, dict(
        rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="node-a", master_port=29400, launcher=launchers.TORCHRUN, is_main=False, requeue_target=None)),
    # srun starts one torchrun per node; torchrun's own variables describe the rank
    "torchrun-inside-slurm": ({**SRUN_2x4, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
                               "SLURM_TASKS_PER_NODE": "1(x2)", **TORCHRUN, "MASTER_ADDR": "gpu01"},
                              dict(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                                   master_addr="gpu01", master_port=29400, launcher=launchers.TORCHRUN,
                                   job_id="900123")),
    # the batch script itself (no srun): SLURM_PROCID=0 of an 8-task job, but it is one process
    "batch-script-without-srun": ({k: v for k, v in SRUN_2x4.items() if k != "SLURM_STEP_ID"}
                                  | {"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"},
                                  dict(rank=0, world_size=1, local_world_size=1, launcher=launchers.SINGLE,
                                       distributed=False, is_main=True)),
    "local-executor": ({"HPCGPU_LAUNCHER": "local", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                        "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "3", "SLURM_NNODES": "1",
                        "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "77",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "45678"},
                       dict(rank=1, local_rank=1, world_size=3, local_world_size=3, launcher=launchers.LOCAL,
                            master_addr="127.0.0.1", master_port=45678, job_id="77")),
    "single-named": ({"HPCGPU_LAUNCHER": "single", "MASTER_ADDR": "10.0.0.5"},
                     dict(rank=0, world_size=1, launcher=launchers.SINGLE, master_addr="127.0.0.1")),
    "plain-process": ({}, dict(rank=0, local_rank=0, world_size=1, local_world_size=1, launcher=launchers.SINGLE,
                               master_addr="127.0.0.1", master_port=29500, job_id=None, distributed=False,
                               is_main=True, visible_devices=None)),
}


@pytest.mark.parametrize("environ,expected", list(CASES.values()), ids=list(CASES))
def test_from_environ(environ: dict[str, str], expected: dict) -> None:
    env = DistEnv.from_environ(environ)
    got = {key: getattr(env, key) for key in expected}
    assert got == expected


ERRORS = {
    "more-tasks-than-gpus": ({**SRUN_1x4, "CUDA_VISIBLE_DEVICES": "0,1"},
                             r"4 tasks on this node but only 2 GPUs visible.*CUDA_VISIBLE_DEVICES=0,1"),
    "port-out-of-range": ({**SRUN_1x4, "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a port"),
    "port-not-a-number": ({**SRUN_1x4, "MASTER_PORT": "abc"}, r"MASTER_PORT='abc' is not a number"),
    "torchrun-port-not-a-number": ({**TORCHRUN, "MASTER_PORT": "abc"}, r"MASTER_PORT='abc'"),
    "tasks-do-not-add-up": ({**SRUN_2x4, "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "1"},
                            r"SLURM_NTASKS=3 but tasks per node '2\(x2\)'.*make 4"),
    "slurm-rank-outside-world": ({**SRUN_1x4, "SLURM_PROCID": "4", "SLURM_LOCALID": "3"},
                                 r"rank 4 is outside the world of 4"),
    "torchrun-rank-outside-world": ({**TORCHRUN, "RANK": "4"}, r"rank 4 is outside the world of 4"),
    "unreadable-tasks-per-node": ({**SRUN_1x4, "SLURM_TASKS_PER_NODE": "four"}, r"tasks per node 'four'"),
    "bad-nodelist": ({**SRUN_1x4, "SLURM_JOB_NODELIST": "gpu[01-"}, r"SLURM_JOB_NODELIST"),
    "unknown-launcher": ({"HPCGPU_LAUNCHER": "mpirun"}, r"HPCGPU_LAUNCHER='mpirun'"),
}


@pytest.mark.parametrize("environ,message", list(ERRORS.values()), ids=list(ERRORS))
def test_inconsistent_environment_is_one_clear_error(environ: dict[str, str], message: str) -> None:
    with pytest.raises(EnvironmentError_, match=message) as info:
        DistEnv.from_environ(environ)
    assert isinstance(info.value, HpcgpuError) and info.value.exit_code == 2
    assert "\n" not in str(info.value)


# A hand-written job script that runs two single-node steps side by side in a 2-node allocation
# (`srun -N1 -n4 ... &` twice): the second step runs on gpu02. srun rewrites SLURM_NTASKS/NNODES/
# TASKS_PER_NODE for the step, but SLURM_JOB_NODELIST stays the whole allocation.
SECOND_STEP_ON_GPU02 = {
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "4", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_STEP_NODELIST": "gpu02", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_JOB_ID": "500", "SLURM_STEP_ID": "1", "MASTER_PORT": "23456",
}
# `srun --preserve-env -N1 -n2` in an 8-task job: only the SLURM_STEP_* variables describe the step
PRESERVE_ENV_STEP = {
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_STEP_NODELIST": "gpu01", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "501", "SLURM_STEP_ID": "0",
}


@pytest.mark.parametrize("environ,expected", [
    (SECOND_STEP_ON_GPU02, dict(world_size=4, local_world_size=4, master_addr="gpu02", hosts=("gpu02",))),
    (PRESERVE_ENV_STEP, dict(world_size=2, local_world_size=2, master_addr="gpu01", num_nodes=1)),
], ids=["second-step-on-gpu02", "srun-preserve-env"])
def test_a_step_on_part_of_the_allocation(environ: dict[str, str], expected: dict) -> None:
    env = DistEnv.from_environ(environ)
    assert {key: getattr(env, key) for key in expected} == expected


def test_master_port_derived_from_job_id_when_unset() -> None:
    a = DistEnv.from_environ(SRUN_1x4)
    b = DistEnv.from_environ({**SRUN_1x4, "SLURM_JOB_ID": "4243"})
    assert a.master_port == port_for_job("4242") and b.master_port == port_for_job("4243")
    assert a.master_port != b.master_port  # two jobs sharing a node do not collide
    assert 1024 < a.master_port < 32768  # below the ephemeral range


def test_master_port_from_environment_wins() -> None:
    assert DistEnv.from_environ({**SRUN_1x4, "MASTER_PORT": "23456"}).master_port == 23456
    assert DistEnv.from_environ({**SRUN_1x4, "MASTER_ADDR": "10.0.0.5"}).master_addr == "10.0.0.5"


def test_local_executor_environment_round_trips(tmp_path: Path) -> None:
    """What the local executor exports is exactly what the job reads back (one code path)."""
    from hpcgpu.launch.local import rank_environ
    from hpcgpu.spec import load_spec

    spec_path = tmp_path / "s.yaml"
    spec_path.write_text("name: s\ntask: command\ncommand: [echo]\nresources: {gpus: 3}\n")
    spec = load_spec(spec_path)
    for rank in range(3):
        environ = rank_environ(spec, rank, 3, "777", 23456, ["0", "1", "4"], tmp_path)
        env = DistEnv.from_environ(environ)
        assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (rank, rank, 3, 3)
        assert (env.launcher, env.master_addr, env.master_port, env.job_id) == (launchers.LOCAL, "127.0.0.1", 23456, "777")
        assert env.visible_devices == ("0", "1", "4")
        assert env.device_index(3) == rank


def test_device_index_takes_the_local_ranks_visible_gpu() -> None:
    environ = {**SRUN_1x4, "CUDA_VISIBLE_DEVICES": "0,1,4,7"}
    assert [DistEnv.from_environ({**environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}).device_index(4)
            for r in range(4)] == [0, 1, 2, 3]


def test_device_index_with_one_gpu_bound_per_task() -> None:
    env = DistEnv.from_environ({**SRUN_1x4, "SLURM_PROCID": "3", "SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "7"})
    assert env.device_index(1) == 0


def test_device_index_without_gpus_is_cpu() -> None:
    assert DistEnv.from_environ(SRUN_1x4).device_index(0) is None
    assert DistEnv.from_environ({}).device_index(0) is None


def test_device_index_rank_without_gpu_is_an_error() -> None:
    env = DistEnv.from_environ({**SRUN_1x4, "CUDA_VISIBLE_DEVICES": ""})  # visibility unknown: check passes
    with pytest.raises(EnvironmentError_, match="local rank 2 has no GPU"):
        env.device_index(2)


def test_torchrun_vars() -> None:
    env = DistEnv.from_environ(SRUN_2x4)
    assert env.torchrun_vars() == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu01", "MASTER_PORT": str(port_for_job("900123")),
    }
    # exported and read back as torchrun variables, they describe the same rank
    again = DistEnv.from_environ(env.torchrun_vars())
    assert (again.rank, again.local_rank, again.world_size, again.local_world_size, again.node_rank,
            again.num_nodes, again.master_addr, again.master_port) == (
        env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank, env.num_nodes,
        env.master_addr, env.master_port)


def _compress(per_node: list[int]) -> str:
    """SLURM's run-length form: [2, 2, 2, 1] -> '2(x3),1'."""
    parts: list[str] = []
    i = 0
    while i < len(per_node):
        j = i
        while j < len(per_node) and per_node[j] == per_node[i]:
            j += 1
        parts.append(f"{per_node[i]}(x{j - i})" if j - i > 1 else str(per_node[i]))
        i = j
    return ",".join(parts)


@settings(max_examples=60, deadline=None)
@given(per_node=st.lists(st.integers(1, 8), min_size=1, max_size=6), data=st.data())
def test_every_rank_of_any_layout_is_consistent(per_node: list[int], data: st.DataObject) -> None:
    world = sum(per_node)
    rank = data.draw(st.integers(0, world - 1))
    node = next(n for n in range(len(per_node)) if rank < sum(per_node[: n + 1]))
    local = rank - sum(per_node[:node])
    env = DistEnv.from_environ({
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(world), "SLURM_TASKS_PER_NODE": _compress(per_node), "SLURM_NNODES": str(len(per_node)),
        "SLURM_JOB_NODELIST": f"n[{0:02d}-{len(per_node) - 1:02d}]", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0",
    })
    assert (env.rank, env.local_rank, env.node_rank) == (rank, local, node)
    assert (env.world_size, env.local_world_size, env.num_nodes) == (world, per_node[node], len(per_node))
    assert env.master_addr == "n00" and len(env.hosts) == len(per_node)
