"""LoRA fine-tuning (train.lora, through peft) on CPU ranks: the loss falls, ranks do not change the
curve, a preempted run resumes bitwise from checkpoints that hold only what changes, model/ is the
adapter peft loads on its base and merged/ the full model; bad input is one line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import TINY_GPT2, job_env, merge, step_losses, submit, submit_all, train_spec, write_spec_file
from resumes import assert_resumed

TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
              "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
WIDER_GPT2 = {**TINY_GPT2, "n_layer": 2, "n_embd": 64}  # big enough for the checkpoint's ratio to mean something
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}
DROPOUT_CKPT: dict[str, Any] = {"lora": {"dropout": 0.1}, "gradient_checkpointing": True}


def lora_spec(name: str, **extra: Any) -> dict:
    return train_spec(name, model={"config": dict(WIDER_GPT2)},
                      train=merge({"lora": dict(LORA), "max_steps": 6, "lr": 1e-2, "warmup_steps": 1}, extra))


def run_dir_of(folder: Path) -> Path:
    (run_dir,) = (folder / "runs").glob("*/*")
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    specs = {
        "lora2": lora_spec("lora2", merge=True),
        "lora1": merge(lora_spec("lora1"), {"resources": {"gpus": 1}}),
        "full": train_spec("full", model={"config": dict(WIDER_GPT2)}, checkpoint={"every_steps": 2},
                           train={"max_steps": 4}),
        "llama": merge(lora_spec("llama", merge=True), {"model": {"config": dict(TINY_LLAMA)},
                                                       "resources": {"gpus": 1}}),
        # what a user's run has and the rank comparison cannot: dropout draws, recomputed activations
        "lorad": lora_spec("lorad", **DROPOUT_CKPT),
    }
    folders = {key: tmp_path_factory.mktemp(key) for key in specs}
    paths = {key: (write_spec_file(folders[key], spec), ()) for key, spec in specs.items()}
    results = submit_all(paths, timeout=240)
    for key, proc in results.items():
        assert proc.returncode == 0, (key, proc.stderr[-3000:])
    out = {key: run_dir_of(folders[key]) for key in specs}
    # the same run as lorad, stopped by its preemption signal after step 4, then resumed
    folder = tmp_path_factory.mktemp("resumed")
    path = write_spec_file(folder, lora_spec("lorad", **DROPOUT_CKPT))
    first = submit(path, env=job_env(HPCGPU_SIGNAL_AT="3"), timeout=120)
    assert first.returncode == 75, first.stderr[-3000:]
    out["stopped_checkpoint"] = max((run_dir_of(folder) / "checkpoints").glob("step-*"))
    out["stopped_checkpoint_bytes"] = folder_bytes(out["stopped_checkpoint"])  # type: ignore[assignment]
    second = submit(path, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    out["resumed"] = run_dir_of(folder)
    return out


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def adapter(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "adapter_model.safetensors"))


def test_lora_learns_and_ranks_do_not_change_the_curve(runs: dict) -> None:
    two, one = step_losses(runs["lora2"]), step_losses(runs["lora1"])
    assert two[6] < two[1] - 0.05, two
    assert two.keys() == one.keys() and all(one[s] == pytest.approx(two[s], rel=1e-5) for s in two), (one, two)
    llama = step_losses(runs["llama"])
    assert llama[6] < llama[1], llama
    plan = json.loads((runs["lora2"] / "plan.json").read_text())
    assert plan["train"]["adapter"]["r"] == 4 and plan["train"]["adapter"]["base"]["seed"] == 1


def test_a_preempted_lora_run_resumes_bitwise_from_a_small_checkpoint(runs: dict) -> None:
    """With LoRA dropout and gradient checkpointing on, 2 ranks: the resumed run draws the same masks."""
    plan = json.loads((runs["resumed"] / "plan.json").read_text())["train"]
    assert plan["gradient_checkpointing"] is True and plan["adapter"]["dropout"] == 0.1, plan
    assert_resumed(runs["resumed"])
    assert step_losses(runs["resumed"]) == step_losses(runs["lorad"])
    assert step_losses(runs["lorad"]) != step_losses(runs["lora2"])  # the dropout draws count
    a, b = adapter(runs["resumed"]), adapter(runs["lorad"])
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # the checkpoint holds the adapters and their optimizer state, not the frozen base
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(runs["stopped_checkpoint"])).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    full = folder_bytes(max((runs["full"] / "checkpoints").glob("step-*")))
    assert runs["stopped_checkpoint_bytes"] < 0.2 * full, (runs["stopped_checkpoint_bytes"], full)


@pytest.mark.parametrize("which", ["lora2", "llama"])
def test_the_adapter_loads_on_its_base_and_merged_gives_the_same_logits(runs: dict, which: str) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpcgpu.runtime.model import build_model
    from hpcgpu.spec import spec_from_raw

    run_dir = runs[which]
    spec = spec_from_raw(yaml.safe_load((run_dir / "spec.yaml").read_text()), need_data=False)
    base = build_model(spec, spec.train.seed).eval()  # the run's base: model.config, seeded (CPU, as trained)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(ids).logits
        tuned = PeftModel.from_pretrained(base, str(run_dir / "model")).eval()
        tuned_logits = tuned(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(run_dir / "merged").eval()(ids).logits
    assert not torch.allclose(tuned_logits, base_logits, atol=1e-4)  # the adapters learned something
    torch.testing.assert_close(merged_logits, tuned_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    ({"train": {"lora": {"target_modules": ["q_proj"]}}},
     "train.lora.target_modules: q_proj is not a linear layer of this gpt2 model (did you mean c_proj?); its linear "
     "layers: c_attn, c_fc, c_proj"),
    ({"model": {"quantization": "int4"}, "train": {"lora": None}}, "add train.lora (QLoRA"),
    ({"train": {"lora": None, "merge": True}}, "train.merge: merges LoRA adapters into the base: it needs train.lora"),
    ({"distributed": {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}}},
     "train.lora trains under DDP or DeepSpeed ZeRO-1/2, not ZeRO-3"),
    ({"model": {"config": dict(TINY_LLAMA)},  # untied: GPT-2's tied head is refused for that first
      "train": {"fused_loss": True, "lora": {"target_modules": ["q_proj", "lm_head"]}}},
     "train.lora.target_modules: names lm_head, whose forward train.fused_loss skips"),
])
def test_bad_lora_input_is_one_line_and_exit_2(tmp_path: Path, change: dict, message: str) -> None:
    spec = merge(lora_spec("bad"), change)
    if spec["train"].get("lora", "x") is None:
        del spec["train"]["lora"]
    proc = submit(write_spec_file(tmp_path, spec), timeout=120)
    text = proc.stdout + proc.stderr  # rank 0's output is the console's stdout
    assert proc.returncode == 2, text[-2000:]
    errors = [line for line in text.splitlines() if message in line]
    assert len(errors) == 1 and "Traceback" not in text, text[-2000:]


def test_one_step_trains_only_the_adapters_and_leaves_the_base_bitwise_unchanged() -> None:
    """The train task's own pieces (build_model, add_adapters, build_optimizer), one optimizer step: a base
    weight left trainable would get a gradient and move; an adapter left frozen would get none."""
    import torch

    from hpcgpu.runtime.lora import add_adapters
    from hpcgpu.runtime.model import build_model
    from hpcgpu.runtime.tasks.train import build_optimizer
    from hpcgpu.spec import spec_from_raw

    spec = spec_from_raw(lora_spec("step"), need_data=False)
    assert spec.train.lora is not None
    model = add_adapters(build_model(spec, spec.train.seed), spec.train.lora).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, spec, torch.device("cpu"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = dict(model.named_parameters())
    base = [name for name in params if "lora_" not in name]
    adapters = [name for name in params if "lora_" in name]
    assert base and adapters
    moved = [name for name in base if params[name].grad is not None or not torch.equal(params[name], before[name])]
    assert not moved, moved
    assert all(params[name].grad is not None for name in adapters), [n for n in adapters if params[n].grad is None]
    assert any(not torch.equal(params[name], before[name]) for name in adapters)  # the step did update them


def test_validate_refuses_quantization_without_a_gpu_before_any_job(tmp_path: Path) -> None:
    """QLoRA on a machine where bitsandbytes cannot run: one line, before the queue wait."""
    spec = merge(lora_spec("q"), {"model": {"quantization": "int4", "name_or_path": str(tmp_path)}})
    del spec["model"]["config"]
    proc = submit(write_spec_file(tmp_path, spec), timeout=60)
    assert proc.returncode == 2 and "model.quantization: int4" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("logs"))


def test_infer_with_the_adapter_on_its_base_gives_the_merged_model_s_outputs(runs: dict, tmp_path: Path) -> None:
    """task: infer's model.adapter: the base folder plus the trained adapter (merged at load) generates
    what merged/ generates, greedy, row for row."""
    import shutil

    from hpcgpu.runtime.model import build_model
    from hpcgpu.spec import spec_from_raw

    run_dir = runs["lora2"]
    spec = spec_from_raw(yaml.safe_load((run_dir / "spec.yaml").read_text()), need_data=False)
    base_dir, merged_dir = tmp_path / "base", tmp_path / "merged"
    build_model(spec, spec.train.seed).save_pretrained(base_dir)  # the run's base, as trained (CPU, seeded)
    shutil.copytree(run_dir / "merged", merged_dir)  # with the run's tokenizer: it runs as it is
    shutil.copy(run_dir / "model" / "hpcgpu_tokenizer.json", base_dir)  # the base saved here has none
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(x):"}) + "\n" for i in range(6)))

    def infer(name: str, **model: str) -> tuple[Path, tuple[str, ...]]:
        doc = {"name": name, "task": "infer", "resources": {"gpus": 1, "cpus_per_gpu": 1}, "model": model,
               "infer": {"input": str(rows), "max_new_tokens": 8, "temperature": 0.0}}
        return write_spec_file(tmp_path / name, doc), ()

    results = submit_all({"adapter": infer("adapter", name_or_path=str(base_dir), adapter=str(run_dir / "model")),
                          "merged": infer("merged", name_or_path=str(merged_dir))}, timeout=180)
    for key, proc in results.items():
        assert proc.returncode == 0, (key, proc.stderr[-3000:])
    texts = {key: [json.loads(line)["text"] for line in (run_dir_of(tmp_path / key) / "outputs.jsonl")
                   .read_text().splitlines()] for key in results}
    assert texts["adapter"] == texts["merged"] and len(texts["adapter"]) == 6, texts


# ---------------------------------------------------------------- configs/tiny-lora-chat.yaml, as shipped

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_lora_chat_config_fine_tunes_a_saved_base(tmp_path: Path) -> None:
    """configs/tiny-lora-chat.yaml on the model scripts/make_tiny_model.py makes (only paths made absolute
    and fewer steps): the loss falls, the plan records the base folder's digest, and merged/ (merged from
    the base loaded again from its folder) gives what peft gives with model/ on that base."""
    import importlib.util

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    maker = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    assert maker and maker.loader
    module = importlib.util.module_from_spec(maker)
    maker.loader.exec_module(module)
    base_dir = tmp_path / "tiny-gpt2"
    module.make(base_dir)
    doc = yaml.safe_load((REPO / "configs" / "tiny-lora-chat.yaml").read_text())
    doc["model"]["name_or_path"] = str(base_dir)
    doc["data"]["train"] = str(REPO / "configs" / "data" / "chat.jsonl")
    doc["train"].update({"max_steps": 8, "log_every": 1})
    path = write_spec_file(tmp_path, doc)
    stopped = submit(path, env=job_env(HPCGPU_SIGNAL_AT="2"), timeout=240)  # stops after step 3
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    # adapters resume only on their own base: a base whose files changed is refused, in one line
    config = base_dir / "config.json"
    original = config.read_text()
    config.write_text(json.dumps({**json.loads(original), "initializer_range": 0.5}))
    refused = submit(path, timeout=240)
    text = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "its files changed since the run started" in text, text[-3000:]
    config.write_text(original)
    proc = submit(path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path)
    curve = step_losses(run_dir)
    assert curve[8] < curve[1], curve
    base = json.loads((run_dir / "plan.json").read_text())["train"]["adapter"]["base"]
    assert base["name_or_path"] == str(base_dir) and len(base["sha256"]) == 16
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(run_dir / "model"))
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged")
        torch.testing.assert_close(merged.eval()(ids).logits, tuned.eval()(ids).logits, rtol=1e-4, atol=1e-4)
