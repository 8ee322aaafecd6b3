"""train.fused_loss: the one-line errors where `true` cannot run, the memory it frees for an auto
micro batch, and the wrapper's loss and gradients against Hugging Face's
own (on CPU, with torch's cross entropy in place of Liger's GPU kernel: the same sum the kernel
computes; tests/gpu runs the kernel itself)."""
from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_GPT2, train_spec
from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime.data import IGNORE
from hpcgpu.runtime.fused_loss import FusedLossLM
from hpcgpu.runtime.plan import FUSABLE_MODEL_TYPES, plan_train
from hpcgpu.spec import spec_from_raw
from hpcgpu.spec.schema import Train

TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 64}
H100 = 80 * 2**30


def gpu_plan(fused: Any, config: dict, monkeypatch: pytest.MonkeyPatch, liger: bool = True, **spec: Any) -> Any:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if liger else None) if name == "liger_kernel" else real(name, *a))
    raw = train_spec("fused", resources={"gpus": 1}, model={"config": config},
                     train={"fused_loss": fused, "micro_batch_size": "auto", "global_batch_size": 256,
                            "max_steps": 4}, **spec)
    return plan_train(spec_from_raw(raw), 1, device_type="cuda", gpu_memory=H100, bf16_supported=True,
                      count_model=lambda: (None, config)).training


def test_it_frees_the_logits_memory_for_an_auto_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    big_vocab = dict(TINY_LLAMA, vocab_size=128256, hidden_size=2048, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, num_hidden_layers=16)
    fused = gpu_plan(True, big_vocab, monkeypatch, data={"seq_len": 2048})
    plain = gpu_plan(False, big_vocab, monkeypatch, data={"seq_len": 2048})
    assert fused.fused_loss and not plain.fused_loss
    assert fused.micro_batch > plain.micro_batch  # 128k logits of every token are not held
    assert not gpu_plan(False, dict(TINY_LLAMA, model_type="gemma2"), monkeypatch, liger=False).fused_loss


@pytest.mark.parametrize(("why", "config", "liger", "extra"), [
    ("needs liger-kernel (pip install 'hpcgpu[fused]')", TINY_LLAMA, False, {}),
    ("cannot fuse the head of model type 'gemma2'", dict(TINY_LLAMA, model_type="gemma2"), True, {}),
    ("not under DeepSpeed", TINY_LLAMA, True, {"distributed": {"strategy": "deepspeed"}}),
])
def test_true_where_it_cannot_run_is_one_line_naming_why(why: str, config: dict, liger: bool, extra: dict,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HpcgpuError) as exc:
        gpu_plan(True, config, monkeypatch, liger=liger, **extra)
    msg = str(exc.value)
    assert msg.startswith("train.fused_loss: true") and why in msg and "\n" not in msg


def test_cpu_ranks_never_fuse_and_true_says_it_needs_gpus() -> None:
    raw = train_spec("fused", train={"max_steps": 2})
    assert not plan_train(spec_from_raw(raw), 1, device_type="cpu", gpu_memory=None, bf16_supported=False,
                          count_model=lambda: (None, TINY_GPT2)).training.fused_loss
    raw["train"]["fused_loss"] = True
    with pytest.raises(HpcgpuError, match=r"train.fused_loss: true needs GPU ranks"):
        plan_train(spec_from_raw(raw), 1, device_type="cpu", gpu_memory=None, bf16_supported=False,
                   count_model=lambda: (None, TINY_GPT2))


def test_the_spec_help_names_the_fusable_model_types() -> None:
    from dataclasses import fields

    help_text = next(f for f in fields(Train) if f.name == "fused_loss").metadata["help"]
    assert all(t in help_text for t in FUSABLE_MODEL_TYPES)


def torch_sum_loss(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("config", [TINY_GPT2, TINY_LLAMA], ids=["gpt2", "llama"])
def test_the_wrapper_gives_hugging_faces_loss_and_gradients(config: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    ids = torch.randint(0, 256, (3, 16))
    labels = ids.clone()
    labels[0, :10] = IGNORE  # a prompt that does not count
    mask = torch.ones_like(ids)
    expected = lm(input_ids=ids, labels=labels, attention_mask=mask).loss
    expected.backward()
    want = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    got = FusedLossLM(lm, torch_sum_loss)(ids, labels, mask)
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    for name, p in lm.named_parameters():
        assert torch.allclose(p.grad, want[name], rtol=1e-4, atol=1e-6), name
    nothing = torch.full_like(ids, IGNORE)
    assert FusedLossLM(lm, torch_sum_loss)(ids, nothing).item() == 0.0  # as causal_lm_loss: 0, not NaN


def test_the_wrapper_takes_a_peft_model_and_trains_only_its_adapters() -> None:
    """train.fused_loss with train.lora: the wrapped LM is peft's PeftModel (its base_model is the causal LM,
    not the body); the loss is Hugging Face's and only the adapters get gradients."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_LLAMA)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    peft_lm = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    ids = torch.randint(0, 256, (2, 16))
    expected = peft_lm(input_ids=ids, labels=ids).loss
    got = FusedLossLM(peft_lm, torch_sum_loss)(ids, ids)
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    grads = {n for n, p in peft_lm.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
