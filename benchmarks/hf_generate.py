"""transformers' own continuous batching (`model.generate_batch`), the "hf continuous" variant of
benchmarks/infer_throughput.py.

    python benchmarks/hf_generate.py --model DIR --input rows.jsonl --output out.jsonl \
        --max-new-tokens 128 [--device cuda|cpu] [--stop STR] [--no-warmup] [--attn paged|sdpa] \
        [--num-blocks N] [--max-batch-tokens N] [--max-requests N]

Loads DIR as plain_generate.py does (bf16 on a GPU, fp32 on the CPU), with --attn as its
attn_implementation (default "paged|sdpa": the paged SDPA kernel of transformers' continuous batching
docs, which needs neither flash-attn nor a download of a hub kernel: the GPU machines reach no hub),
tokenizes every {"id", "prompt"} row and hands them all to the continuous batching manager, greedy
(do_sample False), max_new_tokens, its ContinuousBatchingConfig as the docs leave it (the paged cache
sized from free memory, the batch and CUDA graphs chosen by transformers) but for --num-blocks,
--max-batch-tokens and --max-requests where given (on the CPU small defaults: the automatic size
there comes from the host's RAM) and auto_switch_to_flash off where the field exists (the switch can
pick a hub kernel). generate_batch's own steps are taken one by one so that the start-up is timed
apart from the loop: `continuous_batching_context_manager(..., warmup=True, workload_hints=...)` (the
hints generate_batch computes: the longest prompt, max_new_tokens, the row count) builds the
manager, pre-captures its CUDA graphs and starts its thread: warmup_s; then add_requests and
get_result until every row is back: elapsed_s, between two torch.cuda.synchronize(). Where this
transformers lacks those pieces (but has generate_batch), one generate_batch call is timed whole
(warmup_s null, the warmup in elapsed_s). Without generate_batch at all (transformers older than
4.54): exit 3 with one line saying so.

Why it failed on the GPU before (issue #46): this script ran the manager inside
`torch.inference_mode()`. The manager's warmup runs in the calling thread and makes the cache's static
input tensors there, so they were inference tensors; the generation loop runs in a background thread,
and grad modes are thread-local: transformers 5.17 (the GPU machine's) runs that loop under
torch.no_grad() only, and its first reset of the static tensors (`_bulk_input_tensor[...].zero_()`)
raised "RuntimeError: Inplace update to inference tensor outside InferenceMode is not allowed". The
thread recorded that as its fatal error and failed every request: the first run saw every row back
"finished" with no token ("0 tokens in 0.03 s"), the second (a fallback to generate_batch, in the same
inference mode) "The background thread died with a fatal error" from add_requests, the root cause
only in transformers' ERROR log. Reproduced here on the CPU with transformers 5.17.0; the same bug,
hit by TRL's generate_batch call: https://github.com/huggingface/trl/pull/5818 (transformers
https://github.com/huggingface/transformers/pull/45943 moved the loop from inference_mode to no_grad;
transformers 5.25 carries the caller's inference mode into the thread). So the manager runs under
torch.no_grad() here, as generate_batch itself does. Docs:
https://huggingface.co/docs/transformers/v5.17.0/continuous_batching.

A failure says why: the background thread's fatal error (the manager's own record of it, else the
last ERROR record of transformers' "ContinuousBatchingLogger", traceback included) goes to stderr and
its last line reads "hf continuous failed: <Type>: <message>", exit 4; the same when any request comes
back with an error or no row generated a token.

Continuous batching takes no stop strings: with --stop the rows run to the end-of-sequence token or
max_new_tokens, and the text is cut before the first stop string afterwards; completion_tokens counts
the tokens up to the one that completed it (what hpcgpu and the plain loop count), "generated_tokens"
in the summary all that was generated. Writes {"id", "index", "text", "prompt_tokens",
"completion_tokens"} rows; prints one JSON line like plain_generate.py's, with "slots": the
manager's max_requests_per_batch (what the benchmark's bandwidth bound models as its slot count), and
"outputs_at": the wall clock (time.time()) once the output file is closed (the benchmark's end to end
runs from this process's spawn to it).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import os
import sys
import time
import traceback


def stop_position(tokens: list[int], stops: list[str], decode) -> int | None:
    """The fewest leading tokens whose text holds a stop string (None: none does)."""
    if not any(s in decode(tokens) for s in stops):
        return None
    lo, hi = 1, len(tokens)  # the text of tokens[:hi] holds one; find the least such hi
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(tokens[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


class ErrorRecords(logging.Handler):
    """Keeps the ERROR records of transformers' continuous batching logger: the background thread's
    exception is logged there (with its traceback) and, in 5.17, nowhere the caller sees it."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str | None:
        if not self.records:
            return None
        r = self.records[0]  # the first: later ones are consequences (dropped requests, a dead thread)
        tb = "".join(traceback.format_exception(*r.exc_info)) if r.exc_info else ""
        return f"{r.getMessage()}\n{tb}".strip()


def fatal_error(manager) -> BaseException | None:
    """The background thread's recorded exception, wherever this transformers keeps it."""
    status = getattr(manager, "background_thread_status", None)
    return getattr(status, "fatal_error", None) or getattr(manager, "fatal_error", None)


def fail(why: str, detail: str | None = None) -> int:
    """The reason on stderr, its last line one the benchmark quotes; exit 4."""
    if detail:
        print(detail, file=sys.stderr)
    print(f"hf continuous failed: {why}", file=sys.stderr, flush=True)
    return 4


def cb_config(cls, args: argparse.Namespace, on_gpu: bool, inputs: list[list[int]]):
    """ContinuousBatchingConfig with the sizes given (on the CPU: small ones that fit these rows) and
    auto_switch_to_flash off, among the fields this transformers has; None where it has no such class."""
    if cls is None:
        return None
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) \
        else set(inspect.signature(cls).parameters)
    want = {"num_blocks": args.num_blocks, "max_batch_tokens": args.max_batch_tokens,
            "max_requests_per_batch": args.max_requests, "auto_switch_to_flash": False}
    if not on_gpu:  # sized from the host's RAM otherwise: gigabytes for a smoke run
        block = 256
        need = sum(-(-(len(x) + args.max_new_tokens) // block) for x in inputs)
        want["num_blocks"] = want["num_blocks"] or need + 4
        want["max_batch_tokens"] = want["max_batch_tokens"] or 256
        want["use_cuda_graph"] = False
    return cls(**{k: v for k, v in want.items() if v is not None and k in fields})


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model dir (save_pretrained) with its tokenizer")
    ap.add_argument("--input", required=True, help='jsonl of {"id", "prompt"} rows')
    ap.add_argument("--output", required=True, help="jsonl to write")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when there is one)")
    ap.add_argument("--stop", action="append", default=[], metavar="STR",
                    help="stop string, applied to the finished texts (continuous batching takes none); repeatable")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no CUDA graph pre-capture (generate_batch's warmup=False)")
    ap.add_argument("--attn", default="paged|sdpa",
                    help='attn_implementation of the model (default "paged|sdpa"; "sdpa", "flash_attention_2" where '
                         "flash-attn is installed)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from free memory)")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="tokens a step (default: transformers')")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="max_requests_per_batch (default: transformers', from the workload hints)")
    args = ap.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    errors = ErrorRecords()
    logging.getLogger("ContinuousBatchingLogger").addHandler(errors)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn)
    model = model.to(device).eval()
    if not hasattr(model, "generate_batch"):
        print(f"transformers {transformers.__version__} has no model.generate_batch (continuous batching)",
              file=sys.stderr)
        return 3
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    with open(args.input, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    inputs = [list(ids) for ids in tokenizer([r["prompt"] for r in rows])["input_ids"]]
    gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                                  pad_token_id=pad)
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None  # noqa: N806
    cbc = cb_config(ContinuousBatchingConfig, args, on_gpu, inputs)
    cb_kw = {"continuous_batching_config": cbc} if cbc is not None else {}
    warmup = not args.no_warmup

    how, warmup_s, slots, cfg_note = "manager", None, None, None
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = WorkloadHints(max_prompt_length=max(len(x) for x in inputs),
                              max_generated_length=args.max_new_tokens, num_requests=len(inputs))
        cm_factory = model.continuous_batching_context_manager
    except (ImportError, AttributeError):
        how = "generate_batch"

    results: dict[str, object] = {}
    request_ids: list[str] = []
    outputs: list = []
    died: BaseException | None = None
    # no_grad, as generate_batch itself: NOT inference_mode (see the doc: the background thread would
    # meet inference tensors made by the warmup in this thread)
    with torch.no_grad():
        try:
            if how == "manager":
                if on_gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                # generate_batch's own call, as it makes it (block, timeout 5, not persistent)
                cm = cm_factory(generation_config=gen_config, block=True, timeout=5, warmup=warmup,
                                workload_hints=hints, **cb_kw)
                manager = cm.__enter__()
                if on_gpu:
                    torch.cuda.synchronize()
                warmup_s = time.perf_counter() - t0
                cb = getattr(manager, "continuous_batching_config", None)
                slots = getattr(cb, "max_requests_per_batch", None)
                cfg_note = {k: str(getattr(cb, k, None)) for k in ("max_requests_per_batch", "max_batch_tokens",
                                                                     "num_blocks", "block_size", "use_cuda_graph",
                                                                     "use_async_batching")}
                cfg_note["attn_implementation"] = str(getattr(model.config, "_attn_implementation", None))
                t0 = time.perf_counter()
                try:
                    request_ids = manager.add_requests(inputs=inputs, max_new_tokens=args.max_new_tokens)
                    while len(results) < len(request_ids):
                        result = manager.get_result(timeout=1)
                        if result is not None:
                            if result.is_finished():
                                results[result.request_id] = result
                        elif fatal_error(manager) is not None or not manager.is_running():
                            break
                    if on_gpu:
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - t0
                    died = fatal_error(manager)
                finally:
                    cm.__exit__(None, None, None)
                if died is None and None in request_ids:
                    died = RuntimeError("the manager dropped requests (add_requests returned no id)")
                outputs = [results[r] for r in request_ids if r in results]
            else:
                kw = {"warmup": warmup} if "warmup" in inspect.signature(model.generate_batch).parameters else {}
                if on_gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = model.generate_batch(inputs, generation_config=gen_config, **kw, **cb_kw)
                if on_gpu:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                outputs = list(got.values())
        except Exception as exc:  # raised in this thread (the manager's construction, its warmup)
            return fail(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                        traceback.format_exc())
    bad = [r for r in outputs if getattr(r, "error", None)]
    if died is not None or bad or len(outputs) != len(rows):
        why = (f"{type(died).__name__}: {str(died).splitlines()[0][:300]}" if died is not None
               else f"{len(bad)} of {len(rows)} requests failed: {str(bad[0].error)[:300]}" if bad
               else f"{len(outputs)} results for {len(rows)} rows")
        return fail(f"{why} (transformers {transformers.__version__}, {how})", errors.text())

    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    gen_tokens = all_tokens = 0
    with open(args.output, "w", encoding="utf-8") as out:
        for i, (row, res) in enumerate(zip(rows, outputs)):
            tokens = list(res.generated_tokens)
            all_tokens += len(tokens)
            n = tokens.index(eos) if eos in tokens else len(tokens)
            if args.stop:
                at = stop_position(tokens[:n], args.stop, decode)
                n = at if at is not None else n
            text = decode(tokens[:n])
            if args.stop:
                cut = min((p for p in (text.find(s) for s in args.stop) if p >= 0), default=-1)
                text = text[:cut] if cut >= 0 else text
            gen_tokens += n
            out.write(json.dumps({"id": row.get("id"), "index": i, "text": text, "prompt_tokens": len(inputs[i]),
                                  "completion_tokens": n}) + "\n")
    outputs_at = time.time()  # the output file is closed: where the benchmark's end to end ends
    if outputs and all_tokens == 0:
        return fail(f"no token generated for {len(outputs)} rows (transformers {transformers.__version__}, {how})",
                    errors.text())
    prompt_tokens = sum(len(x) for x in inputs)
    print(json.dumps({"rows": len(rows), "tokens": gen_tokens, "generated_tokens": all_tokens,
                      "prompt_tokens": prompt_tokens, "padded_prompt_tokens": prompt_tokens, "elapsed_s": elapsed,
                      "rows_per_s": len(rows) / elapsed, "tokens_per_s": gen_tokens / elapsed,
                      "warmup_s": warmup_s, "outputs_at": outputs_at, "how": how, "slots": slots, "config": cfg_note,
                      "transformers": transformers.__version__, "device": str(device),
                      "dtype": str(dtype).replace("torch.", "")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
