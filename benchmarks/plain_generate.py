"""The baselines of benchmarks/infer_throughput.py: batch generation as a user writes it by hand.

    python benchmarks/plain_generate.py --model DIR --input rows.jsonl --output out.jsonl \
        --batch-size 64 --max-new-tokens 128 [--sort] [--device cuda|cpu] [--cache static] [--stop STR]

Loads DIR (a folder save_pretrained wrote) with AutoModelForCausalLM.from_pretrained (bf16 on a GPU,
fp32 on the CPU, the dtypes hpcgpu's `task: infer` picks for model.dtype auto) and its tokenizer;
reads the {"id", "prompt"} rows of the input jsonl; cuts them into batches in input order (--sort:
by (prompt tokens, input position) first, the order hpcgpu's batches engine uses); left padding;
model.generate greedy with max_new_tokens and pad_token_id; decodes each completion up to its end;
writes {"id", "index", "text", "prompt_tokens", "completion_tokens"} rows to --output (--save-tokens:
"tokens" too, the completion's ids).

--cache static ("hf static" in infer_throughput.py): the same batches through
generate(cache_implementation="static", max_cache_len=L), L = the longest prompt of the input +
max_new_tokens, so that every batch has the same cache shape: transformers then compiles the decode
step once (torch.compile, mode reduce-overhead: CUDA graphs; on CUDA only) and reuses it for every
batch (the prefill runs uncompiled). Before the timed loop, a warmup generate on the first batch
(--warmup-tokens new tokens, default 8) pays the compile and capture; its time is reported apart
(warmup_s), not in elapsed_s. --warmup-tokens 0: no warmup, the compile lands in the first batch.

--stop STR (repeatable): transformers' StopStringCriteria (what generate's stop_strings builds), given the
completion alone, as hpcgpu's infer.stop sees it (generate's own stop_strings would also match a string
begun in the prompt): a row ends with the token that completes a stop string (finished rows are padded
while the batch goes on); the text is cut before the stop string as hpcgpu does; completion_tokens
counts the tokens up to and including that one (hpcgpu counts the same). One difference remains: a stop
string wholly inside one token that goes on past it is not caught by transformers (by design), and is
by hpcgpu (it decodes the completion's tail).

Prints one JSON line: rows, generated tokens (each row's up to its end: end-of-sequence token or stop
string), prompt tokens, the prompt tokens with their padding, and elapsed_s: the generation loop
alone (padding, generate, decoding, writing), after the model loaded (and after the warmup), between
two torch.cuda.synchronize(); and outputs_at, the wall clock (time.time()) once the output file is
closed: the benchmark's end-to-end time runs from this process's spawn to it. Needs only torch and
transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def completion_length(tokens: list[int], eos: int | None, pad: int | None) -> int:
    """Tokens a row generated: up to its first end-of-sequence token, and without the padding generate
    appends to a row that finished (on a stop string) while others went on."""
    n = tokens.index(eos) if eos is not None and eos in tokens else len(tokens)
    if pad is not None and pad != eos:
        while n > 0 and tokens[n - 1] == pad:
            n -= 1
    return n


def cut_at_stop(text: str, stops: list[str]) -> str:
    cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model dir (save_pretrained) with its tokenizer")
    ap.add_argument("--input", required=True, help='jsonl of {"id", "prompt"} rows')
    ap.add_argument("--output", required=True, help="jsonl to write")
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--sort", action="store_true", help="batch rows sorted by prompt length (else input order)")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when there is one)")
    ap.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                    help="generate's KV cache: dynamic (the default of generate) or static (one max_cache_len for "
                         "every batch: one compiled decode step on CUDA)")
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="--cache static: new tokens of the untimed warmup generate on the first batch (0: none)")
    ap.add_argument("--stop", action="append", default=[], metavar="STR",
                    help="stop string (generate's stop_strings); repeatable")
    ap.add_argument("--save-tokens", action="store_true", help="write each completion's token ids too")
    ap.add_argument("--no-cudnn-attention", action="store_true",
                    help="torch.backends.cuda.enable_cudnn_sdp(False): SDPA without its cuDNN backend (which builds "
                         "a plan per new shape on Hopper); to isolate that cost, not what a user writes")
    ap.add_argument("--verbose", action="store_true", help="each batch's width and time on stderr (synchronizes)")
    args = ap.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers may import deepspeed, which would warn
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    on_gpu = device.type == "cuda"
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    with open(args.input, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows])["input_ids"]]
    order = list(range(len(rows)))
    if args.sort:
        order.sort(key=lambda i: (lengths[i], i))
    batches = [order[i: i + args.batch_size] for i in range(0, len(order), args.batch_size)]
    gen_kwargs: dict = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "pad_token_id": pad}
    if args.cache == "static":
        gen_kwargs.update(cache_implementation="static", max_cache_len=max(lengths) + args.max_new_tokens)
    stop_criterion = None
    if args.stop:
        from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

        class CompletionStop(StoppingCriteria):
            """transformers' StopStringCriteria on the completion alone (as hpcgpu's infer.stop): generate's
            own stop_strings would also match a string that begins in the prompt."""

            def __init__(self) -> None:
                self.inner, self.width = StopStringCriteria(tokenizer=tokenizer, stop_strings=list(args.stop)), 0

            def __call__(self, input_ids, scores, **kwargs):
                return self.inner(input_ids[:, self.width:], scores, **kwargs)

        stop_criterion = CompletionStop()

    def generate(batch: list[int], **over) -> tuple[list[list[int]], int, int, int]:
        enc = tokenizer([rows[i]["prompt"] for i in batch], return_tensors="pt", padding=True).to(device)
        width = enc["input_ids"].shape[1]
        extra = {}
        if stop_criterion is not None:
            stop_criterion.width = width
            extra["stopping_criteria"] = StoppingCriteriaList([stop_criterion])
        out = model.generate(**enc, **{**gen_kwargs, **extra, **over})[:, width:].tolist()
        return out, width, int(enc["attention_mask"].sum()), enc["input_ids"].numel()

    warmup_s = None
    if args.cache == "static" and args.warmup_tokens > 0 and batches:
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            generate(batches[0], max_new_tokens=min(args.warmup_tokens, args.max_new_tokens))
        if on_gpu:
            torch.cuda.synchronize()
        warmup_s = time.perf_counter() - t0

    gen_tokens = prompt_tokens = padded_tokens = 0
    batch_s: list[float] = []
    if on_gpu:
        torch.cuda.synchronize()
    t0 = last = time.perf_counter()
    with open(args.output, "w", encoding="utf-8") as out, torch.inference_mode():
        for batch in batches:
            generated, width, real, padded = generate(batch)
            if args.verbose:
                if on_gpu:
                    torch.cuda.synchronize()
                now = time.perf_counter()
                batch_s.append(now - last)
                last = now
                print(f"batch of {len(batch)} rows, width {width}: {now - t0:.2f} s so far",
                      file=sys.stderr, flush=True)
            prompt_tokens += real
            padded_tokens += padded
            for i, tokens in zip(batch, generated):
                n = completion_length(tokens, eos, pad)
                gen_tokens += n
                text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
                if args.stop:
                    text = cut_at_stop(text, args.stop)
                rec = {"id": rows[i].get("id"), "index": i, "text": text, "prompt_tokens": lengths[i],
                       "completion_tokens": n}
                if args.save_tokens:
                    rec["tokens"] = tokens[:n]
                out.write(json.dumps(rec) + "\n")
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    outputs_at = time.time()  # the output file is closed: where benchmarks/infer_throughput.py's end to end ends
    print(json.dumps({"rows": len(rows), "tokens": gen_tokens, "prompt_tokens": prompt_tokens,
                      "padded_prompt_tokens": padded_tokens, "batches": len(batches), "elapsed_s": elapsed,
                      "rows_per_s": len(rows) / elapsed, "tokens_per_s": gen_tokens / elapsed,
                      "sorted": args.sort, "cache": args.cache, "warmup_s": warmup_s,
                      "no_cudnn_attention": args.no_cudnn_attention, "device": str(device),
                      "dtype": str(dtype).replace("torch.", ""), "slots": args.batch_size, "outputs_at": outputs_at,
                      **({"batch_s": batch_s} if args.verbose else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
