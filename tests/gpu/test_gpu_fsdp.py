"""CUDA only: FSDP2 training (distributed.strategy: fsdp, #36) on 2 GPUs, through `hpcgpu submit --executor local`.

A tiny Llama (random weights from a config: 4 layers, 256 wide, 8 heads, 4 KV heads, tied embeddings,
the byte vocabulary), bf16, not compiled (the runs are seconds of steps; compile is the benchmark's
business), global batch 32 = micro 8 x accum 2 x 2 GPUs (x accum 4 at 1 GPU), 30 steps, the final eval
on configs/data/pydocs-eval.txt:
- (a) fsdp at 2 GPUs follows the DDP run of the same spec: every step's loss within BF16_REL (2%)
  relative of DDP's. The arithmetic differs, not only the order of the sums: fsdp gathers the weights in
  bf16 (MixedPrecisionPolicy), so the norms' weights and the residual stream are bf16, where DDP's
  autocast keeps fp32 weights and computes only the matmuls in bf16;
- (b) an fsdp run stopped at 2 GPUs (HPCGPU_SIGNAL_AT, exit 75, a checkpoint at the stop) and resumed at
  1 GPU, and another one resumed at 2: each step's loss equals the uninterrupted fsdp run's, within
  SAME_WIDTH_ATOL (5e-3) before the stop and after a resume at 2 (the same kernels on the same shards;
  GPU kernels are not bitwise deterministic: ZeRO-3's round trip differed by 5e-5), within
  OTHER_WIDTH_ATOL (0.02) after the resume at 1 (DCP reshards; one rank accumulates 4 micro batches
  where two reduced 2 each, so bf16 sums group differently), and the resumed steps' mean difference
  within OTHER_WIDTH_MEAN (0.01);
- (c) model/ of the fsdp run loads with transformers' from_pretrained (no missing or unexpected keys;
  the weights in the dtype of the DDP run's model/) on the CPU, its logits are finite, and its fp32 loss
  over the eval sequences the run's final eval read is within EVAL_REL (2%) of that eval loss (bf16 on
  the GPUs).

Skipped where CUDA is absent or a GPU is missing (tests/gpu/conftest.py). This process never touches a
GPU (hpcgpu's busy check would see it): the model check runs in a child process that sees none.
HPCGPU_FSDP_TEST_DIR=DIR keeps the runs there (default: a temporary dir).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

torch = pytest.importorskip("torch")

two_gpus = pytest.mark.two_gpus  # tests/gpu/conftest.py: gpu marker and the CUDA skips

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "configs" / "data" / "pydocs.txt"
EVAL_TEXT = REPO / "configs" / "data" / "pydocs-eval.txt"  # 108 sequences of 256 bytes
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 256,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": True,
         "rope_theta": 500000.0}
STEPS = 30
SEQ_LEN, GLOBAL_BATCH, MICRO, EVAL_BATCHES = 256, 32, 8, 2
STOP_SIGNAL_AT = 14  # the signal at step 14: the ranks agree on it a step later and stop there with a checkpoint
BF16_REL = 0.02  # (a) |loss(fsdp) / loss(ddp) - 1| of every step
SAME_WIDTH_ATOL = 5e-3  # (b) |loss(resumed) - loss(uninterrupted)|, the same width
OTHER_WIDTH_ATOL, OTHER_WIDTH_MEAN = 0.02, 0.01  # (b) after the resume at 1 GPU: each step, and the mean
EVAL_REL = 0.02  # (c) the saved model's fp32 eval loss against the run's bf16 one
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def root(work_root: Callable[[str, str], Path]) -> Path:
    return work_root("HPCGPU_FSDP_TEST_DIR", "fsdp")


def train_spec(name: str, strategy: str, cache: Path) -> dict[str, Any]:
    distributed: dict[str, Any] = {"strategy": strategy}
    if strategy == "fsdp":  # the schema's defaults, written out: what this test means by fsdp
        distributed["fsdp"] = {"reshard_after_forward": True, "cpu_offload": False, "reduce_dtype": "fp32"}
    return {
        "name": name, "task": "train",
        "resources": {"gpus": 2, "cpus_per_gpu": 2},
        "distributed": distributed,
        "model": {"config": dict(LLAMA)},
        "data": {"train": str(TEXT), "eval": str(EVAL_TEXT), "seq_len": SEQ_LEN, "cache_dir": str(cache)},
        "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO, "max_steps": STEPS, "lr": 1e-3,
                  "warmup_steps": 5, "log_every": 1, "precision": "bf16", "compile": False, "seed": 0,
                  "eval_batches": EVAL_BATCHES, "gradient_checkpointing": False},
        "checkpoint": {"every_steps": 10},
    }


def write_spec(spec: dict[str, Any], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump({"runs_dir": str(folder / "runs"), **spec}))
    return path


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    # NVLink multicast stays off in the ranks too (the device machines' rule; gpu_session.sh sets them)
    return {**os.environ, "PYTHONPATH": path, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1", **(extra or {})}


def submit(path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, Path | None]:
    """`hpcgpu submit PATH --executor local ARGS`: (exit code, stdout + stderr, run dir). Past TIMEOUT_S the
    local executor gets SIGTERM (it stops its ranks, each in a session of its own), then SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env(env))
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        err += f"\n[test] hpcgpu submit ran past {TIMEOUT_S} s: stopped"
    with (path.parent / "submit.log").open("a") as f:  # kept beside the spec, for a failure's full log
        f.write(f"$ hpcgpu submit {path} --executor local {' '.join(args)}\n{out}\n{err}\n")
    log = out + "\n" + err
    run_dir = None
    for marker in ("unfinished run ", "run dir "):
        if marker in err:
            run_dir = Path(err.split(marker)[1].split()[0].rstrip(","))
            break
    return proc.returncode, log, run_dir


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss; a step logged by two starts (none should be) keeps the later start's."""
    return {r["step"]: r["loss"] for r in records(run_dir) if r.get("kind") == "train"}


def eval_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir) if r.get("kind") == "eval"]


def plan_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "plan.json").read_text())


def full_run(root: Path, strategy: str) -> tuple[str, Path]:
    folder = root / f"{strategy}-full"
    code, log, run_dir = submit(write_spec(train_spec(f"fsdptest-{strategy}", strategy, root / "data-cache"), folder),
                                "--new")
    assert code == 0 and run_dir is not None, log[-4000:]
    return log, run_dir


@pytest.fixture(scope="module")
def fsdp_run(root: Path) -> tuple[str, Path]:
    return full_run(root, "fsdp")


@pytest.fixture(scope="module")
def ddp_run(root: Path) -> tuple[str, Path]:
    return full_run(root, "ddp")


def diffs(got: dict[int, float], want: dict[int, float], steps: list[int]) -> list[float]:
    return [abs(got[s] - want[s]) for s in steps]


@two_gpus
def test_fsdp_on_two_gpus_follows_the_ddp_curve(fsdp_run, ddp_run):
    log, run_dir = fsdp_run
    assert "x 2 (fsdp)" in log, log[-3000:]
    t = plan_of(run_dir)["train"]
    assert t["strategy"] == "fsdp" and t["micro_batch"] * t["accum"] * 2 == GLOBAL_BATCH, t
    assert plan_of(run_dir)["precision"] == "bf16"
    got, want = losses(run_dir), losses(ddp_run[1])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    rel = [abs(got[s] / want[s] - 1) for s in want]
    print(f"\n[fsdp vs ddp, 2 GPUs, bf16] loss {got[1]:.4f} -> {got[STEPS]:.4f} (ddp {want[1]:.4f} -> "
          f"{want[STEPS]:.4f}); max |relative diff| {max(rel):.4f} at step {1 + rel.index(max(rel))}, mean "
          f"{sum(rel) / len(rel):.4f}; eval {eval_losses(run_dir)[-1:]} vs {eval_losses(ddp_run[1])[-1:]}")
    assert got[STEPS] < got[1] - 1.0, got  # it learns
    assert max(rel) <= BF16_REL, [(s, round(got[s], 4), round(want[s], 4)) for s in want]


@two_gpus
@pytest.mark.parametrize("after", [1, 2])
def test_fsdp_stopped_at_two_gpus_resumes_on_the_same_curve(root, fsdp_run, after):
    folder = root / f"stop-resume-at-{after}"
    path = write_spec(train_spec("fsdptest-stop", "fsdp", root / "data-cache"), folder)
    code, log, run_dir = submit(path, "--new", "--gpus", "2", env={"HPCGPU_SIGNAL_AT": str(STOP_SIGNAL_AT)})
    assert code == 75 and run_dir is not None, log[-4000:]
    stopped_at = max(losses(run_dir))
    assert STOP_SIGNAL_AT <= stopped_at < STEPS, stopped_at
    code, log, resumed_dir = submit(path, "--gpus", str(after))  # no --new: the unfinished run goes on
    assert code == 0 and resumed_dir is not None and resumed_dir.resolve() == run_dir.resolve(), log[-4000:]
    assert f"from step {stopped_at}" in log, log[-3000:]
    if after == 1:
        assert f"at 1 GPUs (it ran at 2; the global batch stays {GLOBAL_BATCH})" in log, log[-3000:]
    resume = [r for r in records(run_dir) if r.get("kind") == "resume"]
    assert resume and resume[-1]["step"] == stopped_at, resume
    plan = plan_of(run_dir)
    assert plan["world_size"] == after and plan["train"]["strategy"] == "fsdp", plan
    if after == 1:
        assert plan.get("widths") == [2, 1], plan
    got, want = losses(run_dir), losses(fsdp_run[1])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    before = diffs(got, want, list(range(1, stopped_at + 1)))
    resumed = diffs(got, want, list(range(stopped_at + 1, STEPS + 1)))
    print(f"\n[fsdp stopped at 2 GPUs after step {stopped_at}, resumed at {after}] max |diff| vs uninterrupted: "
          f"{max(before):.2e} before the stop, {max(resumed):.2e} after (mean {sum(resumed) / len(resumed):.2e}); "
          f"final {got[STEPS]:.4f} vs {want[STEPS]:.4f}")
    pairs = [(s, round(got[s], 5), round(want[s], 5)) for s in want]
    assert max(before) <= SAME_WIDTH_ATOL, pairs
    if after == 2:
        assert max(resumed) <= SAME_WIDTH_ATOL, pairs
    else:
        assert max(resumed) <= OTHER_WIDTH_ATOL and sum(resumed) / len(resumed) <= OTHER_WIDTH_MEAN, pairs


CHECK_MODELS = """
import json, pathlib, sys, torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from hpcgpu.runtime.data import causal_lm_loss_sum, load_blocks, load_tokenizer
eval_path, seq_len, sequences, cache, *model_dirs = sys.argv[1:]
blocks = load_blocks(eval_path, load_tokenizer(None), int(seq_len), cache_dir=cache)
ids = blocks[0:min(int(sequences), len(blocks))]
def file_dtypes(folder):
    out = set()
    for f in pathlib.Path(folder).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out |= {str(h.get_slice(k).get_dtype()) for k in h.keys()}
    return sorted(out)
result = {}
for model_dir in model_dirs:
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    model = model.float().eval()
    cfg = model.config
    total = count = 0.0
    finite = True
    with torch.no_grad():
        for i in range(0, len(ids), 8):
            logits = model(input_ids=ids[i:i + 8]).logits
            finite = finite and bool(torch.isfinite(logits).all())
            t, c = causal_lm_loss_sum(logits, ids[i:i + 8])
            total, count = total + t.item(), count + c.item()
    result[model_dir] = {
        "missing": list(info["missing_keys"]), "unexpected": list(info["unexpected_keys"]),
        "mismatched": [str(m) for m in info.get("mismatched_keys", [])],
        "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
        "tied": bool(getattr(cfg, "tie_word_embeddings", False)), "logits_shape": list(logits.shape),
        "finite": finite, "eval_loss": total / count, "sequences": len(ids),
        "params": sum(p.numel() for p in model.parameters()), "dtypes": file_dtypes(model_dir)}
print(json.dumps(result))
"""


def check_models(cache: Path, *model_dirs: Path) -> list[dict[str, Any]]:
    """CHECK_MODELS in a process that sees no GPU: per model folder, what it found."""
    proc = subprocess.run([sys.executable, "-c", CHECK_MODELS, str(EVAL_TEXT), str(SEQ_LEN),
                           str(EVAL_BATCHES * GLOBAL_BATCH), str(cache), *map(str, model_dirs)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=child_env({"CUDA_VISIBLE_DEVICES": ""}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return [found[str(d)] for d in model_dirs]


@two_gpus
def test_fsdp_final_model_loads_with_from_pretrained_and_gives_the_runs_eval_loss(root, fsdp_run, ddp_run):
    _, run_dir = fsdp_run
    assert (run_dir / "model" / "config.json").exists(), sorted(p.name for p in (run_dir / "model").glob("*"))
    got, ddp = check_models(root / "data-cache", run_dir / "model", ddp_run[1] / "model")
    run_eval = eval_losses(run_dir)
    print(f"\n[fsdp model/] {got['params']:,} params, dtypes {got['dtypes']} (ddp's {ddp['dtypes']}); eval loss on the "
          f"CPU in fp32 {got['eval_loss']:.4f} over {got['sequences']} sequences, the run's last (bf16) "
          f"{run_eval[-1:]}")
    assert not got["missing"] and not got["unexpected"] and not got["mismatched"], got
    assert (got["hidden"], got["layers"], got["vocab"], got["tied"]) == (256, 4, 256, True), got
    assert got["params"] == ddp["params"], (got["params"], ddp["params"])
    assert got["dtypes"] == ddp["dtypes"], (got["dtypes"], ddp["dtypes"])  # saved as the DDP run saves
    assert got["logits_shape"][-1] == 256 and got["finite"], got
    assert run_eval, "the run wrote no eval record"
    assert got["eval_loss"] == pytest.approx(run_eval[-1], rel=EVAL_REL), (got["eval_loss"], run_eval)
    assert got["eval_loss"] < 5.0, got  # trained: a random init is near ln(256) = 5.55
