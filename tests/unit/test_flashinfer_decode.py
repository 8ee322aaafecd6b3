"""infer.attention on the CPU (the FlashInfer path itself runs in tests/gpu/test_gpu_slots.py): which
decode attention the slot engine takes and why, in the words of its start-up line; a FlashInfer asked
for where it cannot run is one line, not another kernel; the page lists a captured step writes for
FlashInfer are each slot's live columns, a free slot's and a slot starting mid-row included."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime import slots
from hpcgpu.runtime.flashinfer_decode import page_lists
from hpcgpu.runtime.slots import EngineSettings, Sampler, attention_mode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_slots import tiny_model  # noqa: E402


def settings(attention: str) -> EngineSettings:
    return EngineSettings(slots=4, width=64, max_new_tokens=4, eos=[], pad=0, sampler=Sampler(0, 0, 1.0), seed=0,
                          stop_at=None, attention=attention)


def test_page_lists_are_each_slots_live_columns_in_slot_order() -> None:
    width = 128
    start = torch.tensor([0, 5, 64, 0, 100, 0])
    col = torch.tensor([0, 90, 127, 63, 101, 1])  # slot 0: a free slot (its first column only)
    ends, indices = page_lists(start, col, width, torch.arange(6 * width, dtype=torch.int32))
    want = [s * width + c for s in range(6) for c in range(int(start[s]), int(col[s]) + 1)]
    assert ends.tolist() == [1, 87, 151, 215, 217, 219]
    assert indices[:len(want)].tolist() == want
    assert ends.dtype == indices.dtype == torch.int32  # what FlashInfer's plan buffers hold


def test_on_a_cpu_auto_takes_sdpa_and_flashinfer_asked_for_is_one_line() -> None:
    model = tiny_model("llama", None)
    assert attention_mode(model, torch.device("cpu"), settings("auto")) == ("sdpa", "not on a GPU")
    with pytest.raises(HpcgpuError) as caught:
        attention_mode(model, torch.device("cpu"), settings("flashinfer"))
    assert str(caught.value).startswith("infer.attention: flashinfer cannot run here: not on a GPU; use auto")


def test_auto_without_flashinfer_takes_varlen_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU where FlashInfer is absent or cannot take the model, auto runs the varlen kernel and the
    reason reaches the start-up line; varlen asked for by name says so."""
    monkeypatch.setattr(slots, "gpu_problem", lambda device: None)  # as on an sm80+ GPU
    model = tiny_model("llama", None).to(torch.bfloat16)  # head dim 8: FlashInfer's kernels take 64, 128, 256
    mode, why = attention_mode(model, torch.device("cpu"), settings("auto"))
    assert (mode, why) == ("varlen", "head dim 8 (FlashInfer's decode takes 64, 128, 256)")
    assert attention_mode(model, torch.device("cpu"), settings("varlen")) == ("varlen", "asked")
    with pytest.raises(HpcgpuError, match="infer.attention: flashinfer cannot run here: head dim 8"):
        attention_mode(model, torch.device("cpu"), settings("flashinfer"))
    fp32 = tiny_model("llama", None)
    assert attention_mode(fp32, torch.device("cpu"), settings("auto"))[1].startswith("float32 weights")
