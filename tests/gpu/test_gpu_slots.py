"""The slot engine on a GPU: its decode step is captured as a CUDA graph, and the captured steps give
model.generate's greedy tokens row by row (fp32, TF32 off: the same tokens up to a rare near-tie), for
a tiny Llama and GPT-2 through fewer slots than rows; sampling is the same at any slot count."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

from hpcgpu.runtime.data import ByteTokenizer
from hpcgpu.runtime.tasks.infer import BatchRunner, Chunk, Codec, SlotRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from test_slots import ROWS, rows_and_ids, spec, tiny_model  # noqa: E402  (the CPU test's models and rows)


def run(runner, chunk: int = 3) -> dict[int, dict]:
    chunks = collections.deque(Chunk(k, list(range(i, min(i + chunk, ROWS))), list(range(i, min(i + chunk, ROWS))))
                               for k, i in enumerate(range(0, ROWS, chunk)))
    out: dict[int, dict] = {}
    held = runner.loop(lambda: chunks.popleft() if chunks else None,
                       lambda res: out.update({r["index"]: r for r in res.records}), lambda: False)
    assert held == 0 and sorted(out) == list(range(ROWS))
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_captured_decode_gives_generates_tokens(kind: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows, ids = rows_and_ids()
    model = tiny_model(kind, eos=7).cuda()
    codec = Codec(ByteTokenizer(), "tiny")
    device = torch.device("cuda")
    sp = spec()
    want = BatchRunner(sp, model, codec, ids, rows, device)
    want = {i: want.run(i, [i]).records[0] for i in range(ROWS)}
    runner = SlotRunner(sp, model, codec, ids, rows, device, slots=6)
    got = run(runner)
    assert runner.engine.graphs and runner.engine.graphs_off_why is None, runner.engine.graphs_off_why
    same = sum(got[i] == want[i] for i in range(ROWS))
    assert same >= ROWS - 2, [(got[i], want[i]) for i in range(ROWS) if got[i] != want[i]][:3]


def test_sampling_is_the_same_at_any_slot_count_on_a_gpu() -> None:
    rows, ids = rows_and_ids(2)
    model = tiny_model("llama", None).cuda()
    codec = Codec(ByteTokenizer(), "tiny")
    sp = spec(temperature=0.8, top_p=0.9, seed=5)
    a = run(SlotRunner(sp, model, codec, ids, rows, torch.device("cuda"), slots=4), chunk=2)
    b = run(SlotRunner(sp, model, codec, ids, rows, torch.device("cuda"), slots=16), chunk=5)
    assert sum(a[i] == b[i] for i in range(ROWS)) >= ROWS - 2
