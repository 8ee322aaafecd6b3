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


def test_varlen_attention_reads_each_slots_own_columns() -> None:
    """decode_attention's flash varlen path (flat slot rows, per-slot start and length) against sdpa
    with the 4D mask over the same columns: grouped-query heads, slots starting mid-row, a free slot."""
    from hpcgpu.runtime.slots import VARLEN, decode_attention

    torch.manual_seed(0)
    n, width, heads, kv, dim = 6, 128, 8, 2, 64
    dev, dt = torch.device("cuda"), torch.bfloat16
    k = torch.randn(n, width, kv, dim, device=dev, dtype=dt)
    v = torch.randn(n, width, kv, dim, device=dev, dtype=dt)
    q = torch.randn(n, heads, 1, dim, device=dev, dtype=dt)
    start = torch.tensor([0, 5, 64, 0, 100, 0], device=dev)
    col = torch.tensor([0, 90, 127, 63, 101, 1], device=dev)
    VARLEN["args"] = (torch.arange(n + 1, device=dev, dtype=torch.int32),
                      torch.cat([(torch.arange(n, device=dev) * width + start).int(),
                                 torch.tensor([n * width], device=dev, dtype=torch.int32)]),
                      (col - start + 1).int(), width)
    got, _ = decode_attention(None, q, k.view(n * width, kv, dim), v.view(n * width, kv, dim), None, scaling=0.125)
    cols = torch.arange(width, device=dev)[None, :]
    mask = torch.where((cols >= start[:, None]) & (cols <= col[:, None]), 0.0, float("-inf")).to(dt)[:, None, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2).repeat_interleave(heads // kv, 1), v.transpose(1, 2).repeat_interleave(heads // kv, 1),
        attn_mask=mask, scale=0.125).transpose(1, 2)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_half_precision_engine_takes_the_varlen_kernel_and_gives_generates_tokens(kind: str) -> None:
    rows, ids = rows_and_ids()
    model = tiny_model(kind, eos=7).cuda().half()
    codec = Codec(ByteTokenizer(), "tiny")
    device = torch.device("cuda")
    sp = spec()
    want = BatchRunner(sp, model, codec, ids, rows, device)
    want = {i: want.run(i, [i]).records[0] for i in range(ROWS)}
    runner = SlotRunner(sp, model, codec, ids, rows, device, slots=6)
    assert runner.engine.mode == "varlen", runner.engine.mode_why
    got = run(runner)
    assert len(runner.engine.graphs) == 1 and runner.engine.graphs_off_why is None, runner.engine.graphs_off_why
    same = sum(got[i] == want[i] for i in range(ROWS))
    assert same >= ROWS - 3, [(got[i], want[i]) for i in range(ROWS) if got[i] != want[i]][:3]
