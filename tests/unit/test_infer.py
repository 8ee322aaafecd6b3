"""task: infer on CPU ranks through the local executor (real processes, gloo): data-parallel replicas
give the same outputs as one, a stopped and resumed run (also after a kill -9 cut a row in half, also
with another replica count) gives exactly the uninterrupted run's outputs.jsonl, score mode's
perplexity is the model's own, sampling is reproducible; bad inputs are one line, exit 2.

The runs share one module-scoped fixture and start together (they are mostly start-up time). The
model is a tiny GPT-2 (byte tokenizer, random weights with a large init so that rows differ), or the
same saved to a local dir with a BPE tokenizer trained here in memory (no hub).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_GPT2, job_env, kill_leftovers, merge, only_run_dir, submit_cmd, write_spec_file
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.estimate import infer_dims, row_bytes_per_gpu
from hpcgpu.runtime.plan import RunPlan, check_recorded, plan_infer, with_replicas
from hpcgpu.spec import spec_from_raw

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
ROWS = 48
BATCH = 4  # 12 batches: 6 per replica with 2
MODEL = dict(TINY_GPT2, n_positions=128, initializer_range=0.5)


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 7))


def write_input(folder: Path, name: str, rows: list[dict]) -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def infer_spec(name: str, input_path: Path, **extra: object) -> dict:
    base = {"name": name, "task": "infer", "resources": {"gpus": 2, "cpus_per_gpu": 1},
            "model": {"config": dict(MODEL)},
            "infer": {"input": str(input_path), "max_new_tokens": 8, "batch_size": BATCH}}
    return merge(base, extra)


def make_model_dir(folder: Path) -> Path:
    """A GPT-2 saved with a BPE tokenizer (BOS added to every text, a chat template), no hub."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([prompt(i) * 3 for i in range(60)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    config = AutoConfig.for_model("gpt2", n_layer=1, n_head=2, n_embd=32, n_positions=128, vocab_size=len(fast),
                                  bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                                  initializer_range=0.3)
    torch.manual_seed(0)
    out = folder / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    fast.save_pretrained(out)
    return out


# ---------------------------------------------------------------- running jobs

def start(path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    out = path.with_suffix(f".{len(list(path.parent.glob('*.out')))}.out")
    fh = open(out, "w")
    proc = subprocess.Popen(submit_cmd(path, *args), stdout=fh, stderr=subprocess.STDOUT, text=True,
                            env=env or job_env(), cwd=path.parent, start_new_session=True)
    fh.close()
    return proc, out


def finish(jobs: dict[str, tuple[subprocess.Popen, Path]], timeout: float = 240) -> dict[str, tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = {}
    try:
        for key, (proc, out) in jobs.items():
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            results[key] = (code, out.read_text())
    finally:
        for key, (proc, out) in jobs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                kill_leftovers(str(out.parent))
    return results


def run_dir(folder: Path, name: str) -> Path:
    return only_run_dir(folder / "runs", name)


def outputs(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "outputs.jsonl").read_text().splitlines()]


def records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def ok(result: tuple[int, str], code: int = 0) -> str:
    rc, text = result
    assert rc == code, f"exit {rc} (expected {code})\n{text[-3000:]}"
    return text


# imported at the start of every interpreter whose PYTHONPATH has it: replica 1 (rank 1) raises at its
# second batch, as a model that hits a bad row or a CUDA error would
CRASHING_REPLICA = """
import os
if os.environ.get("SLURM_PROCID") == "1" and os.environ.get("HPCGPU_LAUNCHER"):
    from hpcgpu.runtime import slots

    prefill = slots.SlotEngine.prefill
    ran = []

    def failing_prefill(self, pairs):
        ran.append(pairs)
        if len(ran) == 2:
            raise RuntimeError("replica 1 fails on purpose")
        return prefill(self, pairs)

    slots.SlotEngine.prefill = failing_prefill
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every run of this module. greedy2/greedy1: 48 rows, 2 replicas vs 1; stopA/stopB: the same
    spec stopped after 2 (3) batches by a signal to one rank; sample2/sample1: sampling, 2 vs 1;
    score/chat: the saved model dir with its BPE tokenizer; nochat/notok: bad inputs."""
    base = tmp_path_factory.mktemp("infer")
    rows = [{"id": f"r{i}", "prompt": prompt(i)} for i in range(ROWS)]
    data = write_input(base, "prompts.jsonl", rows)
    model_dir = make_model_dir(base)
    notok = base / "notok"
    notok.mkdir()
    for f in ("config.json", "model.safetensors"):
        (notok / f).write_bytes((model_dir / f).read_bytes())
    truncated = base / "truncated"  # a download cut short: its weights file ends after 1000 bytes
    truncated.mkdir()
    for f in model_dir.iterdir():
        (truncated / f.name).write_bytes(f.read_bytes()[:1000] if f.name == "model.safetensors" else f.read_bytes())
    score_rows = [{"id": i, "text": prompt(i) + " " + prompt(i + 3)} for i in range(20)] + [{"id": 20, "text": ""}]
    chat_rows = [{"id": "c0", "messages": [{"role": "user", "content": "alpha beta"}]},
                 {"id": "c1", "prompt": "gamma delta"},
                 {"id": "c2", "messages": [{"role": "system", "content": "iota"},
                                           {"role": "user", "content": "kappa lambda mu"}]}]
    specs = {
        "greedy2": infer_spec("greedy", data),
        "stopA": infer_spec("greedy", data),
        "stopB": infer_spec("greedy", data),
        # one model copy over both "GPUs" (gpus_per_replica 2): one rank, as one replica of one GPU
        "greedy1": infer_spec("greedy", data, resources={"gpus": 2}, infer={"gpus_per_replica": 2}),
        "static1": infer_spec("greedy", data, resources={"gpus": 1}, infer={"kv_cache": "static", "engine": "batches"}),
        "sample2": infer_spec("sample", data, infer={"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7}),
        "sample1": infer_spec("sample", data, resources={"gpus": 1},
                              infer={"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7}),
        "score": infer_spec("score", write_input(base, "texts.jsonl", score_rows),
                            model={"name_or_path": str(model_dir)}, infer={"mode": "score", "batch_size": "auto"}),
        "chat": infer_spec("chat", write_input(base, "chat.jsonl", chat_rows), model={"name_or_path": str(model_dir)},
                           resources={"gpus": 1}, infer={"max_new_tokens": 6}),
        "nochat": infer_spec("nochat", write_input(base, "nochat.jsonl", chat_rows), resources={"gpus": 1}),
        "notok": infer_spec("notok", data, model={"name_or_path": str(notok)}, resources={"gpus": 1}),
        "truncated": infer_spec("truncated", data, model={"name_or_path": str(truncated)}),
        "crash": infer_spec("crash", data, env={"PYTHONPATH": str(base / "crashing")}),
    }
    (base / "crashing").mkdir()
    (base / "crashing" / "sitecustomize.py").write_text(CRASHING_REPLICA)
    for key in ("score", "chat"):
        specs[key]["model"].pop("config")
    specs["notok"]["model"].pop("config")
    specs["truncated"]["model"].pop("config")
    folders = {key: tmp_path_factory.mktemp(key) for key in specs}
    paths = {key: write_spec_file(folders[key], spec) for key, spec in specs.items()}
    signal_at = {"stopA": "6:1", "stopB": "6:0"}
    jobs = {key: start(paths[key], env=job_env(HPCGPU_SIGNAL_AT=signal_at[key]) if key in signal_at else None)
            for key in specs}
    results = finish(jobs)
    return {"results": results, "folders": folders, "paths": paths, "model_dir": model_dir, "notok": notok,
            "score_rows": score_rows, "chat_rows": chat_rows}


@pytest.fixture(scope="module")
def greedy2(world: dict) -> Path:
    ok(world["results"]["greedy2"])
    return run_dir(world["folders"]["greedy2"], "greedy")


# ---------------------------------------------------------------- the tests

def test_two_replicas_and_one_give_the_same_greedy_outputs(world: dict, greedy2: Path) -> None:
    ok(world["results"]["greedy1"])
    one = run_dir(world["folders"]["greedy1"], "greedy")
    assert sorted(p.name for p in (one / "logs").iterdir()) == ["rank-0.log"]  # 2 GPUs, one copy: one rank
    assert RunPlan.from_json((one / "plan.json").read_text()).world_size == 1
    rows = outputs(greedy2)
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(ROWS)]  # every row once, in input order
    assert [r["index"] for r in rows] == list(range(ROWS))
    assert (greedy2 / "outputs.jsonl").read_bytes() == (one / "outputs.jsonl").read_bytes()
    assert len({r["text"] for r in rows}) > ROWS // 2  # the rows really differ (not one repeated output)
    for r in rows:
        assert r["completion_tokens"] <= 8 and r["finish_reason"] in ("stop", "length")
        assert r["prompt_tokens"] == len(prompt(r["index"]).encode())
    # both replicas ran rows taken from one queue, together each row once (the slot engine takes chunks of
    # one row, so how many each wrote depends on its speed, not on the batch size)
    written = [len((greedy2 / "outputs" / f"replica-{n}.jsonl").read_text().splitlines()) for n in (0, 1)]
    assert sum(written) == ROWS and all(n > 0 for n in written), written
    assert (greedy2 / "FINISHED").exists()


def test_a_static_kv_cache_gives_the_dynamic_caches_outputs(world: dict, greedy2: Path) -> None:
    ok(world["results"]["static1"])
    run = run_dir(world["folders"]["static1"], "greedy")
    assert [r["engine"] for r in records(run, "engine")] == ["batches"]  # kv_cache is the batch engine's
    static = outputs(run)
    dynamic = outputs(greedy2)
    assert [r["id"] for r in static] == [r["id"] for r in dynamic]
    # fp32 on the CPU: the same tokens, up to a rare near-tie flipped by another summation order
    assert sum(a["text"] == b["text"] for a, b in zip(static, dynamic)) >= 0.9 * ROWS


def test_a_replica_that_crashes_fails_the_job_named_as_the_rank_that_failed(world: dict) -> None:
    from hpcgpu.contract import first_failure

    code, text = world["results"]["crash"]
    assert code == 1, text[-3000:]  # rank 1's own exit code, not the stop of replica 0
    run = run_dir(world["folders"]["crash"], "crash")
    failure = first_failure(run)
    assert failure is not None and failure.rank == 1 and failure.exit_code == 1, failure
    assert "rank 1 on" in text and "replica 1 fails on purpose" in text  # submit says who failed and why
    assert not (run / "outputs.jsonl").exists() and not (run / "FINISHED").exists()  # nothing looks complete
    assert not records(run, "stop")  # a crash, not a preemption
    listed = json.loads(subprocess.run([sys.executable, "-m", "hpcgpu", "list", "--json"], capture_output=True,
                                       text=True, timeout=60, env=job_env(), check=True).stdout)
    job = next(j for j in listed if j["name"] == "crash")
    assert job["state"] == "FAILED" and job["failure"]["rank"] == 1, job


def test_plan_progress_and_metrics_are_recorded(greedy2: Path) -> None:
    plan = RunPlan.from_json((greedy2 / "plan.json").read_text())
    p = plan.inference
    assert (plan.task, plan.world_size, plan.precision) == ("infer", 2, "fp32")
    # the slot engine: BATCH slots a replica, the queue's chunks a quarter of them
    assert (p.mode, p.replicas, p.batch_size, p.rows, p.batches, p.max_new_tokens, p.sampling, p.engine) == (
        "generate", 2, BATCH, ROWS, ROWS // max(1, BATCH // 4), 8, False, "slots")
    log0 = (greedy2 / "logs" / "rank-0.log").read_text()
    assert "run plan: generate (greedy, max_new_tokens 8), 2 replica(s)" in log0
    assert f"rows {ROWS}/{ROWS} (100.0%)" in log0 and "rows/s" in log0 and "ETA" in log0
    for rank in (0, 1):
        assert "Traceback" not in (greedy2 / "logs" / f"rank-{rank}.log").read_text()
    progress = records(greedy2, "infer")
    assert progress[-1]["rows"] == ROWS and progress[-1]["rows_total"] == ROWS
    assert progress[-1]["rows_per_s"] > 0 and progress[-1]["tokens_per_s"] > 0
    (end,) = records(greedy2, "end")
    assert end["rows"] == ROWS and end["tokens"] == sum(r["completion_tokens"] for r in outputs(greedy2))
    # where each replica's loop time went, one value per replica: batches, the cold first one, writing
    # the rows, waiting for the other replica
    for key in ("loop_s", "batches_s", "first_batch_s", "write_s", "wait_s"):
        assert len(end[f"replica_{key}"]) == 2, key
    for r in range(2):
        assert 0 < end["replica_first_batch_s"][r] <= end["replica_batches_s"][r] < end["replica_loop_s"][r]
        parts = end["replica_batches_s"][r] + end["replica_write_s"][r] + end["replica_wait_s"][r]
        assert parts <= end["replica_loop_s"][r] + 0.01
    assert "replica loops " in log0 and "waiting for the others" in log0


def test_stopped_and_resumed_after_a_kill_mid_write_gives_the_uninterrupted_outputs(world: dict, greedy2: Path
                                                                                    ) -> None:
    ok(world["results"]["stopA"], 75)
    run = run_dir(world["folders"]["stopA"], "greedy")
    (stop,) = records(run, "stop")
    # replica 1 got the signal as it took its 6th chunk and stopped at its next step; replica 0 saw
    # its stop flag: every row they finished is written, the rows in their slots are not
    assert stop["reason"] == "interrupted" and 2 <= stop["rows"] < ROWS
    assert not (run / "outputs.jsonl").exists() and not (run / "FINISHED").exists()
    # a kill -9 in the middle of writing: the last row of replica 1's last batch is cut in half
    replica1 = run / "outputs" / "replica-1.jsonl"
    data = replica1.read_bytes()
    assert data  # replica 1 finished rows before its stop
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    replica1.write_bytes(data[: last + (len(data) - last) // 2])

    ok(finish({"resume": start(world["paths"]["stopA"])})["resume"])  # the same command resumes the run
    assert run_dir(world["folders"]["stopA"], "greedy") == run
    assert (run / "outputs.jsonl").read_bytes() == (greedy2 / "outputs.jsonl").read_bytes()
    (resume,) = records(run, "resume")
    assert resume["rows"] == stop["rows"] - 1  # the cut row was redone
    written = [json.loads(x)["index"] for n in (0, 1)
               for x in (run / "outputs" / f"replica-{n}.jsonl").read_text().splitlines()]
    assert sorted(written) == list(range(ROWS))  # never a duplicate, never a dropped row


def test_a_run_resumed_with_another_replica_count_skips_every_row_written(world: dict, greedy2: Path) -> None:
    ok(world["results"]["stopB"], 75)
    run = run_dir(world["folders"]["stopB"], "greedy")
    replica0 = run / "outputs" / "replica-0.jsonl"
    replica0.write_bytes(replica0.read_bytes() + b'{"id": "r4')  # and a partial row
    # 1 replica instead of 2: the same spec with --gpus 1 goes on in the stopped run's dir
    code, out = finish({"one": start(world["paths"]["stopB"], "--gpus", "1")})["one"]
    assert code == 0, out[-3000:]
    assert f"resuming the unfinished run {run}" in out
    assert (run / "outputs.jsonl").read_bytes() == (greedy2 / "outputs.jsonl").read_bytes()
    assert "goes on with 1" in out
    assert RunPlan.from_json((run / "plan.json").read_text()).inference.replicas == 1
    written = [json.loads(x)["index"] for n in (0, 1)
               for x in (run / "outputs" / f"replica-{n}.jsonl").read_text().splitlines()]
    assert sorted(written) == list(range(ROWS))


def test_sampling_with_a_seed_is_the_same_with_one_and_two_replicas(world: dict, greedy2: Path) -> None:
    ok(world["results"]["sample2"])
    ok(world["results"]["sample1"])
    two, one = run_dir(world["folders"]["sample2"], "sample"), run_dir(world["folders"]["sample1"], "sample")
    assert (two / "outputs.jsonl").read_bytes() == (one / "outputs.jsonl").read_bytes()
    assert [r["text"] for r in outputs(two)] != [r["text"] for r in outputs(greedy2)]
    assert RunPlan.from_json((two / "plan.json").read_text()).inference.sampling


def test_score_perplexity_is_the_models_own(world: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ok(world["results"]["score"])
    run = run_dir(world["folders"]["score"], "score")
    got = outputs(run)
    assert [r["id"] for r in got] == [r["id"] for r in world["score_rows"]]
    model = AutoModelForCausalLM.from_pretrained(world["model_dir"]).eval()
    tok = AutoTokenizer.from_pretrained(world["model_dir"])
    for row, out in zip(world["score_rows"], got):
        ids = tok(row["text"])["input_ids"]
        assert ids[0] == tok.bos_token_id and out["tokens"] == len(ids) - 1  # every text token scored
        if len(ids) < 2:
            assert out["log_likelihood"] == 0 and out["perplexity"] is None
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        ll = float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).sum())
        assert out["log_likelihood"] == pytest.approx(ll, rel=1e-5, abs=1e-4)
        assert out["perplexity"] == pytest.approx(math.exp(-ll / (len(ids) - 1)), rel=1e-5)
    assert RunPlan.from_json((run / "plan.json").read_text()).inference.batch_size == 8  # auto on CPU


def test_chat_rows_go_through_the_tokenizers_template(world: dict) -> None:
    from transformers import AutoTokenizer

    ok(world["results"]["chat"])
    got = outputs(run_dir(world["folders"]["chat"], "chat"))
    tok = AutoTokenizer.from_pretrained(world["model_dir"])
    for row, out in zip(world["chat_rows"], got):
        if "messages" in row:
            text = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
            expected = len(tok(text, add_special_tokens=False)["input_ids"])
        else:
            expected = len(tok(row["prompt"])["input_ids"])
        assert out["id"] == row["id"] and out["prompt_tokens"] == expected
        assert 0 <= out["completion_tokens"] <= 6 and "<s>" not in out["text"]


def test_bad_inputs_are_one_line_and_exit_2(world: dict) -> None:
    text = ok(world["results"]["nochat"], 2)
    assert "chat template" in text and "nochat.jsonl:1" in text and "Traceback" not in text
    text = ok(world["results"]["notok"], 2)  # refused by submit's own check, else by the job
    assert "tokenizer" in text and "notok" in text and "Traceback" not in text
    text = ok(world["results"]["truncated"], 2)  # weights that do not read: one line for both ranks
    errors = [line for line in text.splitlines() if "hpcgpu: error: model.name_or_path: cannot load" in line]
    assert len(errors) == 1 and "truncated" in errors[0], text
    assert "Traceback" not in text
    from hpcgpu.runtime.tasks.infer import load_infer_tokenizer  # the job's check, for a folder that got past

    with pytest.raises(HpcgpuError, match="no usable tokenizer"):
        load_infer_tokenizer(spec_from_raw({**infer_raw(), "model": {"name_or_path": str(world["notok"])}}))


# ---------------------------------------------------------------- in-process: stop strings, the plan

def test_stop_strings_cut_the_completion() -> None:
    import torch

    from hpcgpu.infer_inputs import Row
    from hpcgpu.runtime.data import ByteTokenizer
    from hpcgpu.runtime.model import build_model
    from hpcgpu.runtime.tasks.infer import BatchRunner, Codec, encode_rows

    rows = [Row(i, i, i + 1, prompt=prompt(i)) for i in range(4)]

    def texts(**infer: object) -> list[dict]:
        spec = spec_from_raw({"name": "s", "task": "infer", "model": {"config": dict(MODEL)},
                              "infer": {"input": "x.jsonl", "max_new_tokens": 12, **infer}})
        codec = Codec(ByteTokenizer(), "model.config")
        model = build_model(spec, 0).eval()
        engine = BatchRunner(spec, model, codec, encode_rows(rows, codec, "generate", "x.jsonl"), rows,
                        torch.device("cpu"))
        return engine.run(0, list(range(4))).records

    free = texts()
    assert all(r["completion_tokens"] == 12 for r in free)
    stop = free[0]["text"][3:5]  # a string the first row generates
    assert stop
    cut = texts(stop=[stop])
    assert cut[0]["text"] == free[0]["text"][: free[0]["text"].find(stop)] and cut[0]["finish_reason"] == "stop"
    assert cut[0]["completion_tokens"] < 12
    for a, b in zip(free, cut):  # every row: cut before its first stop string, or left whole
        pos = a["text"].find(stop)
        assert b["text"] == (a["text"][:pos] if pos >= 0 else a["text"])


def infer_raw(**infer: object) -> dict:
    return {"name": "p", "task": "infer", "resources": {"gpus": 2}, "model": {"config": dict(MODEL)},
            "infer": {"input": "x.jsonl", **infer}}


@pytest.mark.parametrize("change, refused", [
    ({"infer": {"stop": ["a"]}}, r'infer.stop \[\] but the spec now says \["a"\]'),
    ({"infer": {"temperature": 0.9}}, "infer.temperature 0.7 but the spec now says 0.9"),
    ({"infer": {"seed": 1}}, "infer.seed 0 but the spec now says 1"),
    ({"infer": {"top_p": 0.5}}, "infer.top_p 1.0 but the spec now says 0.5"),
    ({"model": {"dtype": "bfloat16"}}, 'model.dtype "auto" but the spec now says "bfloat16"'),
    ({"model": {"config": {**MODEL, "n_layer": 3}}}, "model.config"),
])
def test_a_resume_refuses_settings_that_change_the_rows_output(change: dict, refused: str) -> None:
    """A stopped run resumed with another stop string, temperature, seed or model would leave
    outputs.jsonl a mix of two runs, marked complete."""
    def raw(extra: dict) -> dict:
        doc = infer_raw(temperature=0.7)
        for section, values in extra.items():
            doc[section] = {**doc[section], **values}
        return doc

    plan = RunPlan.from_json(plan_infer(spec_from_raw(raw({})), 2, device_type="cpu", precision="fp32", rows=45,
                                        max_tokens=40).to_json())
    check_recorded(plan, Path("plan.json"), spec_from_raw(raw({})), 2)
    with pytest.raises(HpcgpuError, match=refused):
        check_recorded(plan, Path("plan.json"), spec_from_raw(raw(change)), 2)


def test_a_greedy_resume_ignores_the_sampling_keys() -> None:
    plan = plan_infer(spec_from_raw(infer_raw()), 2, device_type="cpu", precision="fp32", rows=45, max_tokens=40)
    check_recorded(plan, Path("plan.json"), spec_from_raw(infer_raw(seed=5, top_k=3)), 2)


def test_infer_plan_batch_from_memory_and_resume_with_other_replicas() -> None:
    spec = spec_from_raw(infer_raw())
    cpu = plan_infer(spec, 2, device_type="cpu", precision="fp32", rows=45, max_tokens=40)
    assert (cpu.inference.batch_size, cpu.inference.batches, cpu.inference.gpus_per_replica) == (8, 6, 0)
    assert RunPlan.from_json(cpu.to_json()) == cpu
    llama_8b = infer_dims({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                           "vocab_size": 128256})
    per_row = row_bytes_per_gpu(llama_8b, "generate", 2048, 2)
    assert per_row > 2 * 32 * 8 * 128 * 2048 * 2  # the KV cache of one row, and more
    gpu = plan_infer(spec, 4, device_type="cuda", precision="bf16", rows=100_000, max_tokens=2048,
                     budget_bytes=50 * 2**30, bytes_per_row=per_row)
    b = gpu.inference.batch_size
    assert b & (b - 1) == 0 and b * per_row <= 50 * 2**30 < 2 * b * per_row  # the largest power of two
    assert gpu.inference.fits and "power of two" in gpu.reason
    assert plan_infer(spec, 4, device_type="cuda", precision="bf16", rows=1000, max_tokens=2048,
                      budget_bytes=50 * 2**30, bytes_per_row=per_row).inference.batch_size == 32  # 16+ batches
    tight = plan_infer(spec, 4, device_type="cuda", precision="bf16", rows=10, max_tokens=2048,
                       budget_bytes=per_row // 2, bytes_per_row=per_row)
    assert tight.inference.batch_size == 1 and tight.inference.fits is False
    huge = plan_infer(spec, 1, device_type="cuda", precision="bf16", rows=100_000, max_tokens=8,
                      budget_bytes=70 * 2**30, bytes_per_row=1000)
    assert huge.inference.batch_size == 256  # capped
    # a resume may change the replica count (only that); other settings are refused with both named
    check_recorded(cpu, Path("plan.json"), spec, 3)
    assert with_replicas(cpu, 3).inference.replicas == 3 and with_replicas(cpu, 3).inference.batch_size == 8
    with pytest.raises(HpcgpuError, match="infer.mode generate but the spec now says score"):
        check_recorded(cpu, Path("plan.json"), spec_from_raw(infer_raw(mode="score")), 2)
    with pytest.raises(HpcgpuError, match="batch size 8 but the spec now fixes infer.batch_size: 4"):
        check_recorded(cpu, Path("plan.json"), spec_from_raw(infer_raw(batch_size=4)), 2)


def test_a_row_with_both_prompt_and_messages_is_refused(tmp_path: Path) -> None:
    from hpcgpu.infer_inputs import read_rows

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b", "messages": [{"role": "user", '
                    '"content": "c"}]}\n')
    with pytest.raises(HpcgpuError, match=rf'{rows}:2: has both "prompt" and "messages"'):
        read_rows(rows)
