"""LoRA targets and adapters decided before the queue, by the function the job asks too: the host reads a
model's linear layers (full paths, sizes, a tied head) from its config and must find what the built model
has, name for name as peft matches them; `hpcgpu validate` refuses in one line what the job would refuse;
model.adapter alone takes its base from adapter_config.json, and an adapter of another base's shapes is
refused in one line on the host and in the job."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO, submit, write_spec_file
from hpcgpu.gpu.estimate import LINEAR_NAMES

# small enough to build every family on the meta device in a blink; gpt_neo wants a layer pattern per layer
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "head_dim": 8, "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 0,
         "eos_token_id": 0}
FAMILY_EXTRA = {"gpt_neo": {"attention_types": [[["global"], 2]]}}
CONFIGS = [{"model_type": m, **SMALL, **FAMILY_EXTRA.get(m, {})} for m in LINEAR_NAMES] + [
    {"model_type": "gpt2", **SMALL, "add_cross_attention": True},  # layers a config option adds
    {"model_type": "opt", **SMALL, "word_embed_proj_dim": 16},
    {"model_type": "gpt2", **SMALL, "n_inner": 48, "tie_word_embeddings": False},  # the config's own width, untied
    {"model_type": "llama", **SMALL, "tie_word_embeddings": True},
]
UNKNOWN = ["nope", "c_atn", "q_porj", "attn.c_fc", "mlp.q_proj", "self_attn.c_attn", "layers.9.mlp"]


def built(cfg: dict) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))


def names_to_try(model: Any) -> list[str]:
    """Every module's name and every dotted ending of its path (linear or not), unknown names, lm_head."""
    paths = [name for name, _ in model.named_modules() if name]
    endings = {".".join(p.split(".")[i:]) for p in paths for i in range(len(p.split(".")))}
    return sorted(endings | set(UNKNOWN) | {"lm_head"})


def peft_accepts(model: Any, name: str, tied: bool) -> bool:
    """What the job can adapt for this name: peft's own matching over the built model's modules finds
    something, all of it layers LoRA takes (nn.Linear, Conv1D), and not a head tied to the embedding."""
    import torch
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers.pytorch_utils import Conv1D

    config = LoraConfig(target_modules=[name])
    matched = [(key, module) for key, module in model.named_modules() if key and
               check_target_module_exists(config, key)]
    linear = all(isinstance(module, (torch.nn.Linear, Conv1D)) for _, module in matched)
    return bool(matched) and linear and not (tied and any(key == "lm_head" for key, _ in matched))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda cfg: "-".join(
    [cfg["model_type"], *(k for k in ("add_cross_attention", "word_embed_proj_dim", "n_inner", "tie_word_embeddings")
                          if k in cfg)]))
def test_the_host_reads_the_layers_the_job_builds_and_decides_each_name_as_peft_and_the_job_do(cfg: dict) -> None:
    from hpcgpu.gpu.estimate import linear_layers, target_modules_problem
    from hpcgpu.runtime.lora import model_layers

    model = built(cfg)
    job = model_layers(model)
    host = linear_layers(cfg)
    if cfg["model_type"] == "gpt_neox":  # its head's name changed with transformers 5: left to the job
        assert host is None
        return
    assert host is not None
    assert host.paths == job.paths and host.tied_head == job.tied_head and host.hidden == job.hidden, cfg
    for name in names_to_try(model):
        on_host, in_job = target_modules_problem([name], host), target_modules_problem([name], job)
        assert on_host == in_job, name
        assert (on_host is None) == peft_accepts(model, name, job.tied_head), (name, on_host)


# --- what `hpcgpu validate` says, before any job ---------------------------------------------------------

TINY = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256}
GPT2_LAYERS = "its linear layers: c_attn, c_fc, c_proj, lm_head"


def hpcgpu(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("HPCGPU_DEBUG", "HF_TOKEN")}
    environ.update({"CUDA_VISIBLE_DEVICES": "", "HPCGPU_REGISTRY": str(cwd / "jobs.db")})
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True, cwd=cwd,
                          env=environ, timeout=120)


def lora_spec(tmp_path: Path, targets: Any = "auto", **model: Any) -> Path:
    doc = {"name": "t", "task": "train", "resources": {"gpus": 1, "cpus_per_gpu": 1},
           "model": model or {"config": dict(TINY)},
           "data": {"train": str(REPO / "configs" / "data" / "pydocs-eval.txt"), "seq_len": 32},
           "train": {"global_batch_size": 2, "max_steps": 1, "lora": {"target_modules": targets}},
           "runs_dir": str(tmp_path / "runs")}
    return write_spec_file(tmp_path, doc)


def refusal(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize("targets, line", [
    # issue #45 point 1: the job failed on this after the queue; the host matched the last part only
    ("[attn.c_fc]", "train.lora.target_modules: attn.c_fc is not a linear layer of this gpt2 model (did you mean "
                    f"mlp.c_fc?); {GPT2_LAYERS}"),
    ("c_atn", f"train.lora.target_modules: c_atn is not a linear layer of this gpt2 model (did you mean c_attn?); "
              f"{GPT2_LAYERS}"),
    ("[c_attn, attn]", "train.lora.target_modules: attn is not a linear layer of this gpt2 model but a module "
                       "holding c_attn, c_proj: name those"),
    ("[lm_head]", "train.lora.target_modules: lm_head is this gpt2 model's output head, whose weight is its input "
                  "embedding's (tied): an adapter there would change both; drop lm_head (auto adapts every linear "
                  "layer of the blocks)"),
    (".*attn", "train.lora.target_modules: '.*attn' is not a layer name or dotted path (c_attn, attn.c_attn): layers "
               "are named, not matched by a regular expression; list the names, or use auto for every linear layer"),
])
def test_validate_refuses_what_the_job_would_in_one_line(tmp_path: Path, targets: str, line: str) -> None:
    done = hpcgpu("validate", str(lora_spec(tmp_path)), "--set", f"train.lora.target_modules={targets}", cwd=tmp_path)
    assert refusal(done).endswith(line), done.stderr


def test_one_name_written_alone_is_the_one_element_list(tmp_path: Path) -> None:
    """`target_modules: c_attn` was refused as neither auto nor a list; it is the list [c_attn]."""
    from hpcgpu.spec import load_spec

    path = lora_spec(tmp_path, "attn.c_attn")
    done = hpcgpu("validate", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lora = load_spec(path).train.lora
    assert lora is not None and lora.target_modules == ["attn.c_attn"]


def test_the_job_refuses_in_the_host_s_line() -> None:
    """The train task's add_adapters asks the same function on the built model."""
    from hpcgpu.errors import HpcgpuError
    from hpcgpu.gpu.estimate import linear_layers, target_modules_problem
    from hpcgpu.runtime.lora import add_adapters
    from hpcgpu.spec.schema import Lora

    model = built({**TINY})
    with pytest.raises(HpcgpuError) as job:
        add_adapters(model, Lora(target_modules=["attn.c_fc"]))
    assert str(job.value) == target_modules_problem(["attn.c_fc"], linear_layers(TINY))
    untied = built({**TINY, "model_type": "llama", "hidden_size": 32, "num_attention_heads": 2})
    with pytest.raises(HpcgpuError, match="names lm_head, whose forward train.fused_loss skips"):
        add_adapters(untied, Lora(target_modules=["q_proj", "lm_head"]), fused_loss=True)


# --- model.adapter -----------------------------------------------------------------------------------------

def make_base(folder: Path, n_embd: int) -> Path:
    import importlib.util

    maker = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    assert maker and maker.loader
    module = importlib.util.module_from_spec(maker)
    maker.loader.exec_module(module)
    module.make(folder, n_embd=n_embd, n_layer=1)
    return folder


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny saved bases of other widths, and an adapter trained (its B set, as training would) on one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bases")
    base, other = make_base(root / "base", 64), make_base(root / "other", 32)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(root / "adapter")
    return {"base": base, "other": other, "adapter": root / "adapter"}


def infer_spec(folder: Path, **model: str) -> Path:
    rows = folder / "prompts.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
    doc = {"name": "adapted", "task": "infer", "resources": {"gpus": 1, "cpus_per_gpu": 1}, "model": model,
           "infer": {"input": str(rows), "max_new_tokens": 4, "temperature": 0.0}}
    return write_spec_file(folder, doc)


def test_model_adapter_alone_runs_on_the_base_its_adapter_config_names(bases: dict, tmp_path: Path) -> None:
    """`model: {adapter: DIR}` was refused ("needs model.name_or_path"); the base is taken once, on the host,
    from adapter_config.json and written into the run's spec.yaml, which the job loads."""
    assert json.loads((bases["adapter"] / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(bases["base"])
    proc = submit(infer_spec(tmp_path, adapter=str(bases["adapter"])), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").glob("*/*")
    model = yaml.safe_load((run_dir / "spec.yaml").read_text())["model"]
    assert model["name_or_path"] == str(bases["base"]) and model["adapter"] == str(bases["adapter"])
    assert len((run_dir / "outputs.jsonl").read_text().splitlines()) == 3


def test_an_adapter_on_a_base_of_other_shapes_is_one_line_on_the_host_and_in_the_job(bases: dict,
                                                                                      tmp_path: Path) -> None:
    """It gave ~95 lines of "size mismatch" in the job, after the queue."""
    from transformers import AutoModelForCausalLM

    from hpcgpu.errors import HpcgpuError
    from hpcgpu.runtime.lora import load_adapter

    other = str(bases["other"])
    line = (f"model.adapter: {bases['adapter']} was trained on {bases['base']} (transformer.h.0.attn.c_attn "
            f"64 -> 192), not on this base {other} (gpt2, hidden size 32, has transformer.h.0.attn.c_attn 32 -> 96); "
            "give model.name_or_path the base it was trained on")
    done = hpcgpu("validate", str(infer_spec(tmp_path, name_or_path=other, adapter=str(bases["adapter"]))),
                  cwd=tmp_path)
    assert refusal(done) == f"hpcgpu: error: {line}"
    with pytest.raises(HpcgpuError) as job:
        load_adapter(AutoModelForCausalLM.from_pretrained(other), str(bases["adapter"]), merge=True, base_name=other)
    assert str(job.value) == line


def test_an_adapter_an_earlier_job_writes_needs_its_base_named(tmp_path: Path) -> None:
    """`submit --after JOB` with model.adapter in JOB's run dir: no adapter_config.json names a base yet."""
    from hpcgpu.launch.checks import check_host
    from hpcgpu.spec import load_spec

    upstream = tmp_path / "runs" / "train" / "1"
    spec = load_spec(infer_spec(tmp_path, adapter=str(upstream / "model")))
    with pytest.raises(Exception, match=r"^model\.adapter: an earlier job \(--after\) writes it, .*give "
                                        r"model\.name_or_path, the base$"):
        check_host(spec, pending=(str(upstream),))
