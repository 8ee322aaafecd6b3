"""transformers' own continuous batching (`model.generate_batch`), the "hf continuous" variant of
benchmarks/infer_throughput.py.

    python benchmarks/hf_generate.py --model DIR --input rows.jsonl --output out.jsonl \
        --max-new-tokens 128 [--device cuda|cpu] [--stop STR] [--no-warmup]

Loads DIR as plain_generate.py does (bf16 on a GPU, fp32 on the CPU), tokenizes every {"id", "prompt"}
row and hands them all to transformers' continuous batching manager, greedy, max_new_tokens, with
the defaults of `generate_batch` (its ContinuousBatchingConfig() as is: the paged cache sized from
free memory, the batch and CUDA graphs chosen by transformers, flash attention where installed).
generate_batch's own steps are taken one by one so that the start-up is timed apart from the loop:
`continuous_batching_context_manager(..., warmup=True, workload_hints=...)` (the hints generate_batch
computes: the longest prompt, max_new_tokens, the row count) builds the manager, pre-captures its CUDA
graphs and starts its thread: warmup_s; then add_requests and get_result until every row is back:
elapsed_s, between two torch.cuda.synchronize(). Where this transformers lacks those pieces (but has
generate_batch), one generate_batch call is timed whole (warmup_s null, the warmup in elapsed_s).
Without generate_batch at all (transformers older than 4.54): exit 3 with one line saying so.

Continuous batching takes no stop strings: with --stop the rows run to the end-of-sequence token or
max_new_tokens, and the text is cut before the first stop string afterwards; completion_tokens counts
the tokens up to the one that completed it (what hpcgpu and the plain loop count), "generated_tokens"
in the summary all that was generated. Writes {"id", "index", "text", "prompt_tokens",
"completion_tokens"} rows; prints one JSON line like plain_generate.py's, with "slots": the
manager's max_requests_per_batch (what the benchmark's bandwidth bound models as its slot count).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time


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
                    help="no CUDA graph pre-capture (generate_batch's warmup=False; for a CPU smoke run)")
    args = ap.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
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
    with torch.inference_mode():
        if how == "manager":
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            # generate_batch's own call, as it makes it (block, timeout 5, not persistent)
            cm = cm_factory(generation_config=gen_config, block=True, timeout=5, warmup=warmup,
                            workload_hints=hints)
            manager = cm.__enter__()
            if on_gpu:
                torch.cuda.synchronize()
            warmup_s = time.perf_counter() - t0
            cb = getattr(manager, "continuous_batching_config", None)
            slots = getattr(cb, "max_requests_per_batch", None)
            cfg_note = {k: str(getattr(cb, k, None)) for k in ("max_requests_per_batch", "max_batch_tokens",
                                                                 "num_blocks", "use_cuda_graph", "use_async_batching")}
            cfg_note["attn_implementation"] = str(getattr(model.config, "_attn_implementation", None))
            t0 = time.perf_counter()
            try:
                request_ids = manager.add_requests(inputs=inputs, max_new_tokens=args.max_new_tokens)
                while len(results) < len(request_ids):
                    result = manager.get_result(timeout=1)
                    if result is not None:
                        if result.is_finished():
                            results[result.request_id] = result
                    elif not manager.is_running():
                        raise SystemExit("the continuous batching thread ended with "
                                         f"{len(request_ids) - len(results)} rows not done")
                if on_gpu:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
            finally:
                cm.__exit__(None, None, None)
            outputs = [results[r] for r in request_ids]
        if how == "generate_batch" or not any(len(r.generated_tokens) for r in outputs):
            # transformers 5.17's manager handed every request back finished with no token (an H200,
            # 2026-11-28): the one call a user makes, timed whole, its warm-up inside
            how, warmup_s, slots, cfg_note = "generate_batch", None, None, None
            kw = {"warmup": warmup} if "warmup" in inspect.signature(model.generate_batch).parameters else {}
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = model.generate_batch(inputs, generation_config=gen_config, **kw)
            if on_gpu:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            outputs = list(got.values())
    if len(outputs) != len(rows):
        raise SystemExit(f"continuous batching returned {len(outputs)} results for {len(rows)} rows")

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
    if outputs and all_tokens == 0:
        # seen with transformers 5.17 on an H200: every request back "finished" at once with nothing
        # generated (a failed request); no figure, the reason instead
        first = outputs[0]
        why = {k: str(getattr(first, k, None)) for k in ("status", "error", "request_id")}
        print(f"continuous batching generated no token for {len(outputs)} rows ({how}): {json.dumps(why)}",
              file=sys.stderr)
        return 4
    prompt_tokens = sum(len(x) for x in inputs)
    print(json.dumps({"rows": len(rows), "tokens": gen_tokens, "generated_tokens": all_tokens,
                      "prompt_tokens": prompt_tokens, "padded_prompt_tokens": prompt_tokens, "elapsed_s": elapsed,
                      "rows_per_s": len(rows) / elapsed, "tokens_per_s": gen_tokens / elapsed,
                      "warmup_s": warmup_s, "how": how, "slots": slots, "config": cfg_note,
                      "transformers": transformers.__version__, "device": str(device),
                      "dtype": str(dtype).replace("torch.", "")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
