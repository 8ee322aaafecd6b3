"""ctx.prepare, ctx.data_loader, ctx.save/ctx.resume for the user's own loop (task: callable).

In-process: the loader's order, split and mid-epoch resume; the recommendation and the keyword
arguments over it; DDP options on the wrapper (a one-rank gloo group); sync_batchnorm on CPU; a
save/resume round trip. Through the local executor, the shipped example (configs/cnn-callable.yaml,
examples/cnn.py): 1 and 2 ranks follow the same loss curve, and a run stopped mid-epoch and resumed is
bitwise the uninterrupted one.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import REPO, job_env, kill_leftovers, only_run_dir, train_records
from resumes import assert_resumed
from hpcgpu.runtime.context import Context
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.loader import ResumableLoader, merged_options, recommended_options
from hpcgpu.spec import spec_from_raw

CONFIG = REPO / "configs" / "cnn-callable.yaml"


def spec_of(**extra: object):  # type: ignore[no-untyped-def]
    return spec_from_raw({"name": "t", "task": "callable", "entry": "m:f", "runs_dir": "/tmp", **extra})


def loader(n: int, rank: int, world: int, batch: int, seed: int = 3, drop_last: bool = False) -> ResumableLoader:
    data = TensorDataset(torch.arange(n))
    return ResumableLoader(data, batch_size=batch, rank=rank, world=world, seed=seed, shuffle=True,
                           drop_last=drop_last, options={})


def batches(ld: ResumableLoader, count: int | None = None) -> list[list[int]]:
    """The next `count` batches (None: the rest of the epoch), in one iteration of the loader."""
    out = []
    for (x,) in ld:
        out.append(x.tolist())
        if count is not None and len(out) == count:
            break
    return out


# ---------------------------------------------------------------- the loader, in-process

def test_global_batches_are_the_same_at_one_and_two_ranks() -> None:
    one = batches(loader(40, 0, 1, 8, drop_last=True))
    ranks = [batches(loader(40, r, 2, 4, drop_last=True)) for r in range(2)]
    assert len(one) == len(ranks[0]) == 5
    for k, global_batch in enumerate(one):
        assert sorted(ranks[0][k] + ranks[1][k]) == sorted(global_batch)
    assert sorted(sum(one, [])) == list(range(40))  # an epoch is a permutation


def test_each_iteration_is_the_next_epoch_and_the_order_depends_on_seed_and_epoch_only() -> None:
    a = loader(10, 0, 1, 5)
    epochs = [batches(a) for _ in range(3)]
    assert a.epoch == 2
    assert epochs[0] != epochs[1] != epochs[2]
    b = loader(10, 0, 1, 5)
    b.load_state_dict({"epoch": 2, "batches": 0})
    assert batches(b) == epochs[2]
    assert batches(loader(10, 0, 1, 5, seed=4)) != epochs[0]


def test_padding_and_length_without_drop_last() -> None:
    ranks = [loader(7, r, 2, 3) for r in range(2)]
    assert [len(r) for r in ranks] == [2, 2]  # 4 samples each (one repeated), batches of 3 and 1
    got = [batches(r) for r in ranks]
    assert [len(b) for b in got[0]] == [3, 1]
    assert set(sum(got[0] + got[1], [])) == set(range(7))


def test_state_dict_resumes_mid_epoch_exactly() -> None:
    ref = loader(30, 1, 2, 4)  # rank 1 of 2: 15 samples, 4 batches an epoch
    reference = [b for _ in range(3) for b in batches(ref)]
    live = loader(30, 1, 2, 4)
    seen = batches(live)  # epoch 0
    it = iter(live)
    seen += [next(it)[0].tolist() for _ in range(2)]  # two batches of epoch 1, the iteration under way
    state = live.state_dict()
    assert state == {"epoch": 1, "batches": 2}
    resumed = loader(30, 1, 2, 4)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # it goes through a checkpoint file
    rest = batches(resumed) + batches(resumed)
    assert seen + rest == reference
    assert [b[0].tolist() for b in it] == rest[:2]  # and the live iterator goes on the same way


def test_leaving_the_loop_and_iterating_again_goes_on_with_the_epoch() -> None:
    """A `break` (on a stop, say) then a save must resume where the live run would go on."""
    ref = loader(30, 0, 1, 4)
    reference = batches(ref) + batches(ref)
    live = loader(30, 0, 1, 4)
    head = batches(live, count=3)
    assert live.state_dict() == {"epoch": 0, "batches": 3}
    assert head + batches(live) + batches(live) == reference  # the rest of epoch 0, then epoch 1
    at_end = loader(30, 0, 1, 4)
    at_end.load_state_dict({"epoch": 0, "batches": len(at_end)})  # saved after the epoch's last batch
    assert batches(at_end) == reference[len(at_end):] and at_end.epoch == 1


def test_too_few_samples_for_a_batch_is_one_clear_error() -> None:
    from hpcgpu.errors import HpcgpuError

    with pytest.raises(HpcgpuError, match="no batch of 4"):
        loader(7, 1, 2, 4, drop_last=True)


def test_the_global_torch_rng_is_not_touched_by_iterating() -> None:
    """A DataLoader draws its workers' seed from the global RNG at every iter(); a resumed run (one
    iter() fewer) would then go on with another RNG stream."""
    ld = loader(8, 0, 1, 4)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    batches(ld)
    batches(ld)
    assert torch.equal(torch.get_rng_state(), before)


# ---------------------------------------------------------------- the recommendation

def test_recommendation_is_what_hpcgpu_hw_prints_and_keywords_win() -> None:
    from hpcgpu.gpu.recommend import recommend

    rec = recommend(None, None, world=2, global_batch=16, cpus_per_gpu=4)  # what `hpcgpu hw SPEC` prints
    on_gpu = recommended_options(4, on_gpu=True)
    assert on_gpu == {"num_workers": rec.workers, "pin_memory": True, "prefetch_factor": 2,
                      "persistent_workers": True} and rec.workers == 3
    assert recommended_options(1, on_gpu=False) == {"num_workers": 0, "pin_memory": False}
    assert merged_options(on_gpu, {"num_workers": 0, "pin_memory": False}) == {"num_workers": 0,
                                                                               "pin_memory": False}
    assert merged_options(on_gpu, {"prefetch_factor": 8})["prefetch_factor"] == 8
    from hpcgpu.errors import HpcgpuError

    with pytest.raises(HpcgpuError, match="makes its own sampler"):
        merged_options(on_gpu, {"sampler": None})


def context(tmp_path: Path, spec, rank: int = 0, world: int = 1) -> Context:  # type: ignore[no-untyped-def]
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    return Context(env=env, spec=spec, run_dir=tmp_path, device=torch.device("cpu"))


def test_data_loader_takes_the_spec_and_keyword_arguments(tmp_path: Path) -> None:
    spec = spec_of(resources={"gpus": 2, "cpus_per_gpu": 5}, train={"global_batch_size": 12, "seed": 7})
    ctx = context(tmp_path, spec, rank=1, world=2)
    data = TensorDataset(torch.arange(48))
    recommended = ctx.data_loader(data)
    assert recommended.batch_size == 6 and recommended.sampler.seed == 7  # global 12 / 2 ranks
    assert (recommended.loader.num_workers, recommended.loader.pin_memory) == (4, False)  # CPU: no pinning
    assert recommended.loader.persistent_workers and recommended.loader.prefetch_factor == 2
    mine = ctx.data_loader(data, batch_size=5, num_workers=1, prefetch_factor=3, persistent_workers=False, seed=1)
    assert (mine.batch_size, mine.loader.num_workers, mine.loader.prefetch_factor) == (5, 1, 3)
    assert not mine.loader.persistent_workers and mine.sampler.seed == 1
    assert ctx.loaders == [recommended, mine]


# ---------------------------------------------------------------- the strategy, in-process

@pytest.fixture
def one_rank_group():  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ddp_options_reach_the_wrapper(one_rank_group: None) -> None:
    from hpcgpu.runtime.plan import plan_own_loop
    from hpcgpu.runtime.strategies.ddp import ddp_options, wrap_ddp

    def choose_strategy(spec, world: int) -> str:  # type: ignore[no-untyped-def]
        return plan_own_loop(spec, world, device_type="cpu", bf16_supported=False).training.strategy

    spec = spec_of(distributed={"ddp": {"bucket_cap_mb": 7, "gradient_as_bucket_view": True,
                                        "static_graph": True, "find_unused_parameters": True}})
    assert (choose_strategy(spec, 2), choose_strategy(spec, 1)) == ("ddp", "none")
    ddp = wrap_ddp(torch.nn.Linear(3, 2), torch.device("cpu"), ddp_options(spec))
    assert ddp.bucket_bytes_cap == 7 * 2**20
    assert (ddp.gradient_as_bucket_view, ddp.static_graph, ddp.find_unused_parameters) == (True, True, True)
    plain = wrap_ddp(torch.nn.Linear(3, 2), torch.device("cpu"), ddp_options(spec_of()))
    assert plain.bucket_bytes_cap == 25 * 2**20 and not plain.find_unused_parameters
    assert not plain.gradient_as_bucket_view  # auto: the user's loop may replace a gradient in place


@pytest.mark.parametrize("compiled", [True, False])
def test_prepare_gives_a_compiled_model_large_buckets(tmp_path: Path, one_rank_group: None, compiled: bool,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """README: bucket_cap_mb auto is 100 MiB when the model given to ctx.prepare is compiled (torch's DDP
    splits it into a graph per bucket), else torch's 25; the log line names the size."""
    net = torch.nn.Linear(3, 2)
    model = torch.compile(net) if compiled else net  # nothing runs: no compile happens here
    ctx = context(tmp_path, spec_of(), world=2)  # two ranks' strategy, DDP over a one-rank group
    with caplog.at_level(logging.INFO, logger="hpcgpu"):
        wrapped, _ = ctx.prepare(model, torch.optim.SGD(net.parameters(), lr=0.1))
    mib = 100 if compiled else 25
    assert wrapped.bucket_bytes_cap == mib * 2**20
    assert f"ctx.prepare: ddp (buckets {mib} MiB)" in caplog.text


def bn_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))


@pytest.mark.parametrize("setting", ["auto", True])
def test_sync_batchnorm_on_cpu_says_so_and_keeps_batchnorm(setting: object,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from hpcgpu.runtime.training import CPU_SYNC_BN, sync_batchnorm

    with caplog.at_level(logging.INFO, logger="hpcgpu"):
        model = sync_batchnorm(bn_model(), setting, torch.device("cpu"), world=2)  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == [CPU_SYNC_BN]
    assert type(model[1]) is torch.nn.BatchNorm2d


def test_sync_batchnorm_converts_on_gpu_ranks_only_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    from hpcgpu.runtime.training import sync_batchnorm

    gpu = torch.device("cuda", 0)  # conversion only swaps modules: no GPU needed to check it
    model = bn_model()
    weight = model[1].weight
    synced = sync_batchnorm(model, "auto", gpu, world=2)
    assert type(synced[1]) is torch.nn.SyncBatchNorm and synced[1].weight is weight  # the optimizer's
    assert type(sync_batchnorm(bn_model(), False, gpu, world=2)[1]) is torch.nn.BatchNorm2d
    assert type(sync_batchnorm(bn_model(), "auto", gpu, world=1)[1]) is torch.nn.BatchNorm2d
    with caplog.at_level(logging.INFO, logger="hpcgpu"):
        sync_batchnorm(torch.nn.Linear(2, 2), True, torch.device("cpu"), world=2)  # no BatchNorm: quiet
    assert not caplog.records


@pytest.fixture
def strategy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """none: one rank without a process group; deepspeed: ZeRO-2 on a one-rank gloo group."""
    if request.param == "none":
        yield {}
        return
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("LOCAL_RANK", "0")  # what export_rendezvous sets in a job; DeepSpeed asserts it
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        # DeepSpeed's CPU communication op is compiled once into torch's cache; under conftest's private
        # XDG_CACHE_HOME it would be compiled again in every session (~30 s on 2 cores)
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    yield from one_rank_group.__wrapped__()  # type: ignore[attr-defined]


@pytest.mark.parametrize("strategy", ["none", "deepspeed"], indirect=True)
def test_save_and_resume_restore_everything_registered(tmp_path: Path, strategy: None, request) -> None:
    """Model, optimizer, scheduler, RNG (dropout) and a loader made after resume; through DCP, or
    DeepSpeed's own checkpoint (the user's optimizer and scheduler handed to the engine)."""
    from hpcgpu.runtime.context import make_checkpoint_manager

    name = request.node.callspec.params["strategy"]
    spec = spec_of(resources={"cpus_per_gpu": 1}, train={"global_batch_size": 4, "grad_clip": 0.5},
                   distributed={"strategy": name, "deepspeed": {"zero_stage": 2}})

    def start() -> tuple[Context, torch.nn.Module, ResumableLoader]:
        ctx = context(tmp_path, spec)
        ctx.checkpoint = make_checkpoint_manager(spec, tmp_path, ctx.env)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, _ = ctx.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
        ctx.resume()  # before the loader is made: it takes its position when it is
        ld = ctx.data_loader(TensorDataset(torch.randn(10, 2, generator=torch.Generator().manual_seed(1))))
        return ctx, model, ld

    def train(ctx: Context, model: torch.nn.Module, ld: ResumableLoader, steps: int) -> list[float]:
        losses = []
        for (x,) in ld:
            with ctx.autocast():
                loss = model(x).pow(2).mean()
            ctx.backward(loss)
            ctx.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
        return losses

    ctx, model, ld = start()
    assert ctx.training is not None and (ctx.training.strategy.name, ctx.training.plan.precision) == (name, "fp32")
    train(ctx, model, ld, 1)
    ctx.save(1)
    after = train(ctx, model, ld, 2)  # the rest of epoch 0 (3 batches from 10 samples: 4, 4, 2)
    ctx.checkpoint.close()
    ctx2, model2, ld2 = start()
    assert (ctx2.checkpoint.last_saved_step, ld2.state_dict()) == (1, {"epoch": 0, "batches": 1})
    assert train(ctx2, model2, ld2, 2) == after
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert ctx2.training is not None and ctx2.training.scheduler.get_last_lr() == [0.1 * 0.5 ** 3]
    ctx2.checkpoint.close()


def test_prepare_first(tmp_path: Path) -> None:
    from hpcgpu.errors import HpcgpuError

    ctx = context(tmp_path, spec_of())
    for call in (ctx.autocast, ctx.resume, ctx.step, lambda: ctx.save(1)):
        with pytest.raises(HpcgpuError, match="needs ctx.prepare"):
            call()


# ---------------------------------------------------------------- the shipped example, 2 CPU ranks

STEPS = 20  # 12 steps an epoch (192 images, global batch 16): the stop at 15 is mid-epoch 1
STOP_AT = 15


def submit_cmd(runs: Path, name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpcgpu", "submit", str(CONFIG), "--executor", "local", "--set",
            f"runs_dir={runs}", "--set", f"name={name}", "--set", f"train.max_steps={STEPS}", *args]


def run_all(runs: Path, jobs: dict[str, tuple[tuple[str, ...], dict[str, str]]]) -> dict[str, int]:
    """Submit the shipped config as written, from the repository root (where `entry` is imported
    from), several at once: most of a run is start-up."""
    procs = {}
    for name, (args, env) in jobs.items():
        out = open(runs / f"{name}.out", "w")
        procs[name] = subprocess.Popen(submit_cmd(runs, name, *args), stdout=out, stderr=subprocess.STDOUT,
                                       text=True, env=job_env(**env), cwd=REPO, start_new_session=True)
        out.close()
    try:
        return {name: proc.wait(timeout=240) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        kill_leftovers(str(runs))


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("cnn")
    group = {"CNN_NORM": "group", "CNN_DROPOUT": "0"}
    codes = run_all(runs, {
        "gn1": (("--new", "--gpus", "1"), group), "gn2": (("--new",), group),
        "bn2": (("--new",), {}), "stop": (("--new",), {"CNN_STOP_AT": f"{STOP_AT}:1"}),
    })
    logs = {name: (runs / f"{name}.out").read_text()[-3000:] for name in codes}
    assert codes == {"gn1": 0, "gn2": 0, "bn2": 0, "stop": 75}, logs
    again = run_all(runs, {"stop": ((), {})})  # the same command, without --new: resumes the stopped run
    assert again == {"stop": 0}, (runs / "stop.out").read_text()[-3000:]
    return runs


def losses(runs: Path, name: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(only_run_dir(runs, name))}


@pytest.mark.slow
def test_one_and_two_ranks_follow_the_same_loss_curve(example_runs: Path) -> None:
    """Same global batches (16 = 1 x 16 = 2 x 8), so the same gradients up to float summation order.
    GroupNorm and no dropout for this comparison: BatchNorm's batch statistics on CPU ranks (no
    SyncBatchNorm) are each rank's 8 images, not the 16, and dropout masks are drawn per rank."""
    one, two = losses(example_runs, "gn1"), losses(example_runs, "gn2")
    assert list(one) == list(two) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step  # measured: 1.5e-7 at most
    assert two[STEPS] < two[1]


@pytest.mark.slow
def test_stopped_mid_epoch_and_resumed_is_bitwise_the_uninterrupted_run(example_runs: Path) -> None:
    """BatchNorm and dropout (RNG) as shipped; rank 1 gets the stop signal after step 15 (epoch 1,
    batch 3 of 12): both ranks stop there with a checkpoint and the next start goes on from it."""
    run_dir = only_run_dir(example_runs, "stop")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (stop,) = [r for r in records if r["kind"] == "stop"]
    (resume,) = [r for r in records if r["kind"] == "resume"]
    assert stop["step"] == resume["step"] == STOP_AT and resume["checkpoint"] == f"step-{STOP_AT:08d}"
    assert_resumed(run_dir)
    by_step = {r["step"]: r for r in records if r["kind"] == "train"}
    assert (by_step[STOP_AT]["epoch"], by_step[STOP_AT + 1]["epoch"]) == (1, 1)  # resumed mid-epoch
    assert losses(example_runs, "stop") == losses(example_runs, "bn2")  # exactly, every step
    a = torch.load(run_dir / "model.pt")
    b = torch.load(only_run_dir(example_runs, "bn2") / "model.pt")
    assert a.keys() == b.keys() and any("running_mean" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
