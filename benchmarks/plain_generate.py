"""The baseline of benchmarks/infer_throughput.py: batch generation as a user writes it by hand.

    python benchmarks/plain_generate.py --model DIR --input rows.jsonl --output out.jsonl \
        --batch-size 64 --max-new-tokens 128 [--sort] [--device cuda|cpu]

Loads DIR (a folder save_pretrained wrote) with AutoModelForCausalLM.from_pretrained (bf16 on a GPU,
fp32 on the CPU, the dtypes hpcgpu's `task: infer` picks for model.dtype auto) and its tokenizer;
reads the {"id", "prompt"} rows of the input jsonl; cuts them into batches in input order (--sort:
by (prompt tokens, input position) first, the order hpcgpu uses, so the batches are the very same);
left padding; model.generate greedy with max_new_tokens and pad_token_id; decodes each completion up
to its end-of-sequence token; writes {"id", "index", "text", "completion_tokens"} rows to --output.

Prints one JSON line: rows, generated tokens (each row's up to its end-of-sequence token), prompt
tokens, the prompt tokens with their padding, and elapsed_s: the generation loop alone (padding,
generate, decoding, writing), after the model loaded, between two torch.cuda.synchronize().
Needs only torch and transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model dir (save_pretrained) with its tokenizer")
    ap.add_argument("--input", required=True, help='jsonl of {"id", "prompt"} rows')
    ap.add_argument("--output", required=True, help="jsonl to write")
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--sort", action="store_true", help="batch rows sorted by prompt length (else input order)")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when there is one)")
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
    eos = tokenizer.eos_token_id

    with open(args.input, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    order = list(range(len(rows)))
    if args.sort:
        lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows])["input_ids"]]
        order.sort(key=lambda i: (lengths[i], i))
    batches = [order[i: i + args.batch_size] for i in range(0, len(order), args.batch_size)]

    gen_tokens = prompt_tokens = padded_tokens = 0
    if on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with open(args.output, "w", encoding="utf-8") as out, torch.inference_mode():
        for batch in batches:
            enc = tokenizer([rows[i]["prompt"] for i in batch], return_tensors="pt", padding=True).to(device)
            width = enc["input_ids"].shape[1]
            generated = model.generate(**enc, do_sample=False, max_new_tokens=args.max_new_tokens,
                                       pad_token_id=tokenizer.pad_token_id)[:, width:].tolist()
            if args.verbose:
                if on_gpu:
                    torch.cuda.synchronize()
                print(f"batch of {len(batch)} rows, width {width}: {time.perf_counter() - t0:.2f} s so far",
                      file=sys.stderr, flush=True)
            prompt_tokens += int(enc["attention_mask"].sum())
            padded_tokens += enc["input_ids"].numel()
            for i, tokens in zip(batch, generated):
                n = tokens.index(eos) if eos in tokens else len(tokens)
                gen_tokens += n
                text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
                out.write(json.dumps({"id": rows[i].get("id"), "index": i, "text": text, "completion_tokens": n})
                          + "\n")
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    print(json.dumps({"rows": len(rows), "tokens": gen_tokens, "prompt_tokens": prompt_tokens,
                      "padded_prompt_tokens": padded_tokens, "batches": len(batches), "elapsed_s": elapsed,
                      "rows_per_s": len(rows) / elapsed, "tokens_per_s": gen_tokens / elapsed,
                      "sorted": args.sort, "no_cudnn_attention": args.no_cudnn_attention, "device": str(device),
                      "dtype": str(dtype).replace("torch.", "")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
