"""The slot engine (runtime/slots.py) against model.generate row by row, in process on the CPU (fp32):
tiny Llama, GPT-2, Qwen2 and Mistral models with random weights, 44 rows of mixed lengths through fewer
slots than rows (so slots refill), some rows ending on EOS, some on a stop string, others at
max_new_tokens. The reference is the batch engine with batches of one row: model.generate with the
same stop criteria and record rules. Records are compared with their completion's token ids (the
token_ids fixture), not the text alone."""
from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcgpu.infer_inputs import Row
from hpcgpu.runtime.data import ByteTokenizer
from hpcgpu.runtime.tasks import infer as infer_task
from hpcgpu.runtime.tasks.infer import BatchResult, BatchRunner, Chunk, Codec, SlotRunner, pick_engine
from hpcgpu.spec import spec_from_raw

ROWS = 44
NEW = 12
REFILL_SLOTS = 16  # 1/8 of them is 2: the refill rule differs from "any free slot"
CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "gpt2": dict(model_type="gpt2", n_layer=2, n_head=2, n_embd=32, n_positions=128, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "qwen2": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "mistral": dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
}


def tiny_model(kind: str, eos: int | None) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(vocab_size=256, initializer_range=0.5, **CONFIGS[kind])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


def rows_and_ids(seed: int = 1) -> tuple[list[Row], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 256, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
           for _ in range(ROWS)]
    rows = [Row(index=i, id=f"r{i}", line=i + 1, prompt="") for i in range(ROWS)]
    return rows, ids


def spec(**infer: Any) -> Any:
    raw = {"name": "slots", "task": "infer", "model": {"config": {"model_type": "gpt2"}},
           "infer": {"input": "rows.jsonl", "max_new_tokens": NEW, "batch_size": 5, **infer}}
    return spec_from_raw(raw, need_data=False)


def run(runner: Any, ids: list[list[int]], chunk: int = 3) -> dict[int, dict]:
    """Every row through the runner's loop, chunks of `chunk` rows; the records by row index."""
    chunks = collections.deque(Chunk(k, list(range(i, min(i + chunk, ROWS))), list(range(i, min(i + chunk, ROWS))))
                               for k, i in enumerate(range(0, ROWS, chunk)))
    out: dict[int, dict] = {}

    def emit(result: BatchResult) -> None:
        for r in result.records:
            assert r["index"] not in out
            out[r["index"]] = r

    held = runner.loop(lambda: chunks.popleft() if chunks else None, emit, lambda: False)
    assert held == 0 and sorted(out) == list(range(ROWS))
    return out


def reference(sp: Any, model: Any, ids: list[list[int]], rows: list[Row]) -> dict[int, dict]:
    codec = Codec(ByteTokenizer(), "tiny")
    runner = BatchRunner(sp, model, codec, ids, rows, torch.device("cpu"))
    return {i: runner.run(i, [i]).records[0] for i in range(ROWS)}


def frequent_token(model: Any, ids: list[list[int]], rows_with_it: int = 4) -> int:
    """A token greedy decoding produces in about `rows_with_it` of 16 rows: as EOS, it ends those early."""
    counts: collections.Counter[int] = collections.Counter()
    with torch.no_grad():
        for x in ids[:16]:
            out = model.generate(torch.tensor([x]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            counts.update(set(out[0, len(x) + 1:].tolist()))
    return min(counts, key=lambda t: abs(counts[t] - rows_with_it))


@pytest.fixture
def token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every generate record also carries its completion's token ids: the byte tokenizer decodes with
    errors="replace", so completions that differ in a byte >= 128 can decode to the same text. Both
    engines build their records through completion_record."""
    plain = infer_task.completion_record

    def with_ids(row: Row, index: int, prompt_tokens: int, tokens: Any, reason: str, stops: Any,
                 codec: Codec) -> dict[str, Any]:
        return {**plain(row, index, prompt_tokens, tokens, reason, stops, codec), "token_ids": list(tokens)}

    monkeypatch.setattr(infer_task, "completion_record", with_ids)


class RefillWatch:
    """What the engine's loop did: each prefill as (rows prefilled, slots still running an earlier row),
    and each decode call's free slots while rows were still waiting for one."""

    def __init__(self, engine: Any) -> None:
        self.prefills: list[tuple[int, int]] = []
        self.free_while_waiting: list[int] = []
        self.started = 0
        prefill, decode = engine.prefill, engine.decode

        def watched_prefill(pairs: list[tuple[int, int]]) -> Any:
            self.prefills.append((len(pairs), sum(r >= 0 for r in engine.row)))
            self.started += len(pairs)
            return prefill(pairs)

        def watched_decode() -> Any:
            if self.started < ROWS:
                self.free_while_waiting.append(sum(r < 0 for r in engine.row))
            return decode()

        engine.prefill, engine.decode = watched_prefill, watched_decode


@pytest.mark.usefixtures("token_ids")
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_slots_give_model_generates_tokens_row_by_row(kind: str) -> None:
    rows, ids = rows_and_ids()
    model = tiny_model(kind, None)
    eos = frequent_token(model, ids)
    model.generation_config.eos_token_id = eos
    codec = Codec(ByteTokenizer(), "tiny")
    probe = reference(spec(), model, ids, rows)  # a stop string that some completions hold
    held = collections.Counter(x for r in probe.values() for x in {r["text"][k:k + 2] for k in range(2, len(r["text"]) - 1)})
    stop = min(held, key=lambda x: abs(held[x] - ROWS // 5))
    sp = spec(stop=[stop])
    assert pick_engine(sp, model, ids) is None  # the slot engine takes it
    want = reference(sp, model, ids, rows)
    got = run(SlotRunner(sp, model, codec, ids, rows, torch.device("cpu"), slots=5), ids)
    assert got == want  # token ids, not only the (lossy) text
    reasons = collections.Counter(r["finish_reason"] for r in want.values())
    assert reasons["length"] >= 3 and reasons["stop"] >= 3, reasons
    assert any(r["completion_tokens"] < NEW and stop not in r["text"] and r["finish_reason"] == "stop"
               for r in want.values())  # some end on EOS


@pytest.mark.usefixtures("token_ids")
def test_sampling_depends_on_the_seed_and_row_not_the_slots() -> None:
    rows, ids = rows_and_ids(2)
    model = tiny_model("llama", None)
    codec = Codec(ByteTokenizer(), "tiny")
    sp = spec(temperature=0.9, top_k=40, top_p=0.9, seed=3)
    three = run(SlotRunner(sp, model, codec, ids, rows, torch.device("cpu"), slots=3), ids, chunk=2)
    eight = run(SlotRunner(sp, model, codec, ids, rows, torch.device("cpu"), slots=8), ids, chunk=5)
    assert three == eight
    greedy = run(SlotRunner(spec(), model, codec, ids, rows, torch.device("cpu"), slots=8), ids)
    assert sum(three[i]["text"] != greedy[i]["text"] for i in range(ROWS)) > ROWS // 2
    other = run(SlotRunner(spec(temperature=0.9, top_k=40, top_p=0.9, seed=4), model, codec, ids, rows,
                           torch.device("cpu"), slots=8), ids)
    assert sum(three[i]["text"] != other[i]["text"] for i in range(ROWS)) > ROWS // 2


def test_a_stop_drops_the_unfinished_rows_and_says_how_many() -> None:
    rows, ids = rows_and_ids()
    model = tiny_model("gpt2", None)
    runner = SlotRunner(spec(), model, Codec(ByteTokenizer(), "tiny"), ids, rows, torch.device("cpu"), slots=4)
    chunks = collections.deque(Chunk(k, [k * 2, k * 2 + 1], [k * 2, k * 2 + 1]) for k in range(ROWS // 2))
    got: list[dict] = []
    calls = iter(range(1000))
    held = runner.loop(lambda: chunks.popleft() if chunks else None, lambda r: got.extend(r.records),
                       lambda: next(calls) >= 20)
    assert 0 < held <= 4 + 4 and got and len(got) + held + 2 * len(chunks) == ROWS


def test_models_the_slot_engine_does_not_take_run_on_batches(tmp_path: Path) -> None:
    rows, ids = rows_and_ids()
    model = tiny_model("llama", None)
    assert pick_engine(spec(engine="batches"), model, ids) == "infer.engine: batches"
    assert "score" in pick_engine(spec(mode="score"), model, ids)
    from transformers import AutoConfig, AutoModelForCausalLM

    opt = AutoModelForCausalLM.from_config(AutoConfig.for_model("opt", vocab_size=256, hidden_size=16, num_hidden_layers=1,
                                                                ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16))
    assert "model type 'opt'" in pick_engine(spec(), opt, ids)
    json.dumps(pick_engine(spec(), opt, ids))


@pytest.mark.usefixtures("token_ids")
def test_the_jobs_engine_prepared_before_the_loop_gives_the_same_rows() -> None:
    from hpcgpu.runtime.tasks.infer import make_engine

    rows, ids = rows_and_ids()
    model = tiny_model("llama", 7)
    codec = Codec(ByteTokenizer(), "tiny")
    lazy = run(SlotRunner(spec(), model, codec, ids, rows, torch.device("cpu"), slots=5), ids)
    prepared = make_engine(spec(), model, codec, ids, rows, torch.device("cpu"), 5, None)
    assert prepared.engine.cache is not None  # allocated at start-up, before any row
    assert run(prepared, ids) == lazy


@pytest.mark.usefixtures("token_ids")
def test_refill_waits_for_an_eighth_of_the_slots_and_off_waits_for_every_slot() -> None:
    """16 slots: the refill rule (prefill once 1/8 of the slots, here 2, are free) differs from "any
    free slot", which 8 slots or fewer could not tell apart."""
    rows, ids = rows_and_ids()
    model = tiny_model("gpt2", None)
    # rows must end at different steps: ended all at max_new_tokens, they free their slots together and
    # refill on and off run the very same steps; half of them end early, or 16 slots would rarely refill
    model.generation_config.eos_token_id = frequent_token(model, ids, rows_with_it=8)
    codec = Codec(ByteTokenizer(), "tiny")
    on = SlotRunner(spec(), model, codec, ids, rows, torch.device("cpu"), slots=REFILL_SLOTS)
    off = SlotRunner(spec(refill=False), model, codec, ids, rows, torch.device("cpu"), slots=REFILL_SLOTS)
    watch_on, watch_off = RefillWatch(on.engine), RefillWatch(off.engine)
    got = run(on, ids, chunk=4)
    assert run(off, ids, chunk=4) == got  # the same rows either way
    assert len({r["completion_tokens"] for r in got.values()}) > 2, "no rows of unlike lengths: nothing to refill"
    share = REFILL_SLOTS // 8
    # fixed batches, each into empty slots
    assert watch_off.prefills == [(16, 0), (16, 0), (ROWS - 32, 0)], watch_off.prefills
    assert any(busy for _, busy in watch_on.prefills), watch_on.prefills  # rows entered beside rows decoding
    assert all(REFILL_SLOTS - busy >= share for _, busy in watch_on.prefills), watch_on.prefills
    # and a freed slot did wait while fewer than 1/8 were free (rows still to go)
    assert any(0 < free < share for free in watch_on.free_while_waiting), watch_on.free_while_waiting
    # the freed slots did not idle until every slot was free: fewer decode calls for the same rows
    assert on.engine.replays < off.engine.replays, (on.engine.replays, off.engine.replays)


@pytest.mark.usefixtures("token_ids")
@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_rows_past_one_block_give_generates_tokens(attention: str) -> None:
    """Rows longer than one 64-column block, refilling 5 slots, against model.generate row by row. flex:
    each slot reads its own live blocks (flex_attention's reference on the CPU; a GPU compiles it). sdpa:
    the steps move from the narrow view width to the wide one as rows grow (a row's column once stuck
    at the narrow view's last one, overwriting its keys: wrong tokens)."""
    from dataclasses import replace

    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcgpu.runtime.slots import SlotEngine

    config = AutoConfig.for_model(vocab_size=256, initializer_range=0.5, **{**CONFIGS["llama"], "hidden_size": 64})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    rows, ids = rows_and_ids(3)
    ids = [x * 2 for x in ids]  # rows past one 64-column block
    sp = spec()
    runner = SlotRunner(sp, model, Codec(ByteTokenizer(), "tiny"), ids, rows, torch.device("cpu"), slots=5)
    runner.engine = SlotEngine(model, torch.device("cpu"), ids, replace(runner.engine.s, attention=attention))
    assert runner.engine.mode == attention, runner.engine.mode_why
    assert attention == "flex" or len(runner.engine.widths) >= 2
    assert run(runner, ids) == reference(sp, model, ids, rows)


def test_infer_attention_reaches_the_engine_and_its_start_up_words() -> None:
    """infer.attention: sdpa is the engine's choice, said as asked; auto on a CPU says why not varlen."""
    rows, ids = rows_and_ids()
    model = tiny_model("llama", None)
    codec = Codec(ByteTokenizer(), "tiny")
    asked = SlotRunner(spec(attention="sdpa"), model, codec, ids, rows, torch.device("cpu"), slots=4).engine
    assert (asked.mode, asked.mode_why) == ("sdpa", "asked") and asked.attention.endswith("(asked)")
    auto = SlotRunner(spec(), model, codec, ids, rows, torch.device("cpu"), slots=4).engine
    assert (auto.mode, auto.mode_why) == ("sdpa", "not on a GPU")
