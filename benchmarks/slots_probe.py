"""The slot engine in process on one GPU, no hpcgpu job around it: decode tokens/s at several slot counts,
the capture time, the step time, and (--profile N) the CUDA kernels of one uncaptured step at N slots.

    python benchmarks/slots_probe.py [--rows 768] [--slots 64,256,512] [--profile 256]

Model: the llama-400m shape of benchmarks/infer_throughput.py (24 layers, hidden 1024, 16 heads, 8 KV
heads, random weights, bf16); rows of 8..510 random token ids (seeded), greedy, 128 new tokens, no EOS.
Tokens/s counts generated tokens over the engine's run, the capture excluded. Prints one JSON line per
measurement. A probe for the engine's development, not a comparison: infer_throughput.py is that.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def llama_400m() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                               num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                               max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).cuda().eval()


def measure(model: torch.nn.Module, ids: list[list[int]], slots: int, new: int, attention: str,
            compiled: bool = False) -> dict:
    from hpcgpu.runtime import slots as eng

    settings = eng.EngineSettings(slots=slots, width=eng.cache_width(ids, new), max_new_tokens=new, eos=[], pad=0,
                                  sampler=eng.Sampler(0.0, 0, 1.0), seed=0, stop_at=None, compile=compiled, attention=attention)
    engine = eng.SlotEngine(model, torch.device("cuda"), ids, settings)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # longest first, as the task takes them
    chunk = max(1, slots // 4)
    todo = [order[i:i + chunk] for i in range(0, len(order), chunk)]
    tokens = 0

    def emit(done: list) -> None:
        nonlocal tokens
        tokens += sum(len(d.tokens) for d in done)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        engine.prepare()
        engine.run(lambda: todo.pop(0) if todo else None, emit, lambda: False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0 - engine.capture_s
    step_ms = elapsed / max(1, engine.replays * engine.steps) * 1e3
    return {"slots": slots, "attention": engine.attention, "rows": len(ids), "tokens": tokens, "elapsed_s": round(elapsed, 2),
            "tok_s": round(tokens / elapsed), "capture_s": round(engine.capture_s, 2), "views": sorted(engine.graphs),
            "why": engine.graphs_off_why, "step_ms": round(step_ms, 3), "width": settings.width,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=768)
    ap.add_argument("--slots", default="64,256,512")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--compile", default="off", help="on, off or both: the decode forward through torch.compile")
    ap.add_argument("--attention", default="varlen", help="flex, varlen, sdpa (the masked view), or a comma list, per slot count")
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = llama_400m()
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, 32000, (int(torch.randint(8, 511, (1,), generator=g)),), generator=g).tolist()
           for _ in range(args.rows)]
    for slots in [int(x) for x in args.slots.split(",")]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            for attention in args.attention.split(","):
                for compiled in ([False, True] if args.compile == "both" else [args.compile == "on"]):
                    print(json.dumps(measure(model, ids, slots, args.new, attention, compiled)), flush=True)
        except Exception as exc:  # report and go on to the next setting
            print(json.dumps({"slots": slots, "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
    if args.profile:
        profile(model, ids, args.profile, args.new, args.attention.split(",")[0])


def profile(model: torch.nn.Module, ids: list[list[int]], slots: int, new: int, attention: str) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from hpcgpu.runtime import slots as eng

    settings = eng.EngineSettings(slots=slots, width=eng.cache_width(ids, new), max_new_tokens=new, eos=[], pad=0,
                                  sampler=eng.Sampler(0.0, 0, 1.0), seed=0, stop_at=None, attention=attention)
    engine = eng.SlotEngine(model, torch.device("cuda"), ids, settings)
    engine.graphs_off_why = "profiled uncaptured"
    with torch.inference_mode():
        engine.emit = engine.prefill([(s, s) for s in range(slots)])
        engine._steps(settings.width)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine._steps(settings.width)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)


if __name__ == "__main__":
    main()
