"""Decode attention formulations side by side on one GPU, no model: one query token a slot over a KV cache
of N slots x W columns (grouped-query heads), what the slot engine's step spends most of its time in at
hundreds of slots. Prints one JSON line a formulation: microseconds a call (median of 5 x 20 calls, CUDA
events), the K+V bytes it had to read (live columns for varlen and FlashInfer, the view's columns for the
rest) over that time, and its largest error against an fp32 reference.

    python benchmarks/decode_attention_probe.py [--slots 512] [--width 640] [--view 640] [--compile] \
        [--forms "varlen,flashinfer,flashinfer graph,flashinfer graph tc"]

The flashinfer rows (issue #46; FlashInfer 0.5.3, imported only there: where it is not importable a row
says so and the others go on): BatchDecodeWithPagedKVCacheWrapper over the slot cache as it is, (slots,
width, KV heads, dim) contiguous = NHD pages of page_size 1 (`k.view(slots * width, 1, kv, dim)`), each
slot's live columns [start, col] its pages (indptr = the cumulative live lengths, indices = slot x width +
start + j, last_page_len all 1), sm_scale dim^-0.5, no positional encoding.
  flashinfer        use_cuda_graph=False, planned at the exact lengths; compile_s: the first plan and
                    call (FlashInfer's JIT compile of the kernel, or its cache: FLASHINFER_WORKSPACE_BASE),
                    plan_ms: a plan once compiled (host work the engine pays where it replans)
  flashinfer graph  what the slot engine would run (benchmarks/flashinfer_graph.py FlashInferDecode, not
                    in hpcgpu: it failed on an H100, see there): use_cuda_graph=True, planned ONCE at
                    full width, each call writing the slots' page lists on the device (update), captured
                    in a CUDA graph and replayed (us: a replay); compile_s: its setup; split_kv: whether
                    that plan split
  flashinfer graph tc  the same with FlashInfer's tensor-core kernel planned with disable_split_kv

A probe for the engine's development (runtime/slots.py), not a comparison of programs.
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--view", type=int, default=640)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--forms", default="", help="comma-separated forms to run (default: all)")
    a = ap.parse_args()
    n, W, w, h, kv, d = a.slots, a.width, a.view, a.heads, a.kv, a.dim
    g = h // kv
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    kh = torch.randn(n, kv, W, d, device=dev, dtype=dt)  # heads-major cache
    vh = torch.randn(n, kv, W, d, device=dev, dtype=dt)
    kr, vr = kh.transpose(1, 2).contiguous(), vh.transpose(1, 2).contiguous()  # rows cache (n, W, kv, d)
    q = torch.randn(n, h, 1, d, device=dev, dtype=dt)
    length = torch.randint(8, w, (n,), device=dev)
    start = (w - length).clamp(min=0)  # left-aligned rows ending at the view's last column
    col = torch.full((n,), w - 1, device=dev)
    cols = torch.arange(w, device=dev)[None, :]
    valid = (cols >= start[:, None]) & (cols <= col[:, None])
    mask = torch.where(valid, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    scale = d ** -0.5
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), kh[:, :, :w].float().repeat_interleave(g, 1), vh[:, :, :w].float().repeat_interleave(g, 1),
        attn_mask=mask, scale=scale).transpose(1, 2)

    def qk_t() -> torch.Tensor:  # scores = q @ K^T, fp32 out
        qq = q.reshape(n * kv, g, d)
        k = kh.view(n * kv, W, d)[:, :w]
        v = vh.view(n * kv, W, d)[:, :w]
        s = torch.bmm(qq, k.transpose(1, 2), out_dtype=torch.float32).view(n, kv, g, w) * scale + mask
        return torch.bmm(s.softmax(-1).to(dt).view(n * kv, g, w), v).view(n, 1, h, d)

    def kq(out_fp32: bool) -> torch.Tensor:  # scores^T = K @ q^T: K read as the long operand
        qq = q.reshape(n * kv, g, d)
        k = kh.view(n * kv, W, d)[:, :w]
        v = vh.view(n * kv, W, d)[:, :w]
        st = (torch.bmm(k, qq.transpose(1, 2), out_dtype=torch.float32) if out_fp32
              else torch.bmm(k, qq.transpose(1, 2)).float())  # (n*kv, w, g)
        s = st.view(n, kv, w, g).transpose(2, 3) * scale + mask
        return torch.bmm(s.softmax(-1).to(dt).view(n * kv, g, w), v).view(n, 1, h, d)

    def reduce_form() -> torch.Tensor:  # elementwise products and sums: inductor's own reduction kernels
        qq = q.reshape(n, kv, g, 1, d).float()
        k = kh[:, :, None, :w].float()
        s = (qq * k).sum(-1) * scale + mask  # (n, kv, g, w)
        p = s.softmax(-1)
        return (p[..., None] * vh[:, :, None, :w].float()).sum(-2).to(dt).reshape(n, 1, h, d)

    def sdpa_grouped() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(n, kv, g, d), kh[:, :, :w], vh[:, :, :w], attn_mask=mask.to(dt), scale=scale)
        return out.reshape(n, 1, h, d)

    cu_q = torch.arange(n + 1, device=dev, dtype=torch.int32)
    cu_k = torch.cat([(torch.arange(n, device=dev) * W + start).int(), torch.tensor([n * W], device=dev, dtype=torch.int32)])
    used = (col - start + 1).int()

    def varlen() -> torch.Tensor:
        out = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2).reshape(n, h, d), kr.view(n * W, kv, d), vr.view(n * W, kv, d), cu_q, cu_k, 1, W, 0.0,
            False, False, scale=scale, seqused_k=used)[0]
        return out.reshape(n, 1, h, d)

    forms = {"varlen": varlen, "qk_t fp32": qk_t, "kq bf16": lambda: kq(False), "kq fp32": lambda: kq(True),
             "sdpa grouped": sdpa_grouped, "reduce (eager)": reduce_form}
    def kq_masked(m: torch.Tensor, out_fp32: bool) -> torch.Tensor:  # the width from the mask: dynamic
        ww = m.shape[-1]
        qq = q.reshape(n * kv, g, d)
        k = kh.view(n * kv, W, d)[:, :ww]
        v = vh.view(n * kv, W, d)[:, :ww]
        st = (torch.bmm(k, qq.transpose(1, 2), out_dtype=torch.float32) if out_fp32
              else torch.bmm(k, qq.transpose(1, 2)).float())
        s = st.view(n, kv, ww, g).transpose(2, 3) * scale + m
        return torch.bmm(s.softmax(-1).to(dt).view(n * kv, g, ww), v).view(n, 1, h, d)

    def dynamic(out_fp32: bool):
        fn = torch.compile(lambda m: kq_masked(m, out_fp32), dynamic=None)
        for ww in (w - 64, w):  # two widths through one compile
            m = mask[..., :ww].clone() if ww == w else mask[..., :ww].contiguous()
            torch._dynamo.maybe_mark_dynamic(m, 3)
            with torch.inference_mode():
                fn(m)
        m = mask.clone()
        torch._dynamo.maybe_mark_dynamic(m, 3)
        return lambda: fn(m)

    if a.compile:
        for out_fp32 in (True, False):
            try:
                forms[f"kq {'fp32' if out_fp32 else 'bf16'}, compiled dynamic"] = dynamic(out_fp32)
            except Exception as exc:
                print(json.dumps({"form": f"dynamic {out_fp32}", "error": f"{type(exc).__name__}: {exc}"[:300]}))
        forms.update({"kq fp32, compiled": torch.compile(lambda: kq(True)),
                      "kq bf16, compiled": torch.compile(lambda: kq(False)),
                      "reduce, compiled": torch.compile(reduce_form)})
    # the flashinfer rows (None: built in their row, where FlashInfer is imported), right after varlen
    forms = {"varlen": forms.pop("varlen"), "flashinfer": None, "flashinfer graph": None, "flashinfer graph tc": None,
             **forms}
    live_pages = flashinfer_pages(start, used, W)
    live_bytes = int(used.sum()) * kv * d * 2 * 2
    view_bytes = n * w * kv * d * 2 * 2
    only = [f.strip() for f in a.forms.split(",") if f.strip()]
    for name, fn in forms.items():
        if only and name not in only:
            continue
        extra: dict = {}
        try:
            with torch.inference_mode():
                if fn is None:
                    fn, extra = flashinfer_form(name, q.reshape(n, h, d), kr.view(n * W, 1, kv, d),
                                                vr.view(n * W, 1, kv, d), live_pages, n, W, h, kv, d, scale,
                                                start, used)
                    if fn is None:
                        print(json.dumps({"form": name, **extra}), flush=True)
                        continue
                out = fn()
                err = (out.float() - ref).abs().max().item()
                times = []
                for _ in range(5):
                    a0, b0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a0.record()
                    for _ in range(20):
                        fn()
                    b0.record()
                    torch.cuda.synchronize()
                    times.append(a0.elapsed_time(b0) / 20 * 1e3)
            us = sorted(times)[2]
            read = live_bytes if name == "varlen" or name.startswith("flashinfer") else view_bytes
            print(json.dumps({"form": name, "slots": n, "view": w, "us": round(us, 1), "read_mb": round(read / 1e6),
                              "tb_s": round(read / us / 1e6, 2), "max_err": round(err, 4), **extra}), flush=True)
        except Exception as exc:
            print(json.dumps({"form": name, "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)


def flashinfer_pages(start: torch.Tensor, used: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
    """Each slot's live columns as pages of one token of the (slots * width)-page cache: indptr (the
    cumulative live lengths), indices (slot * width + start + j), last_page_len (all 1); int32, on the GPU."""
    n = len(used)
    used = used.int()
    indptr = torch.zeros(n + 1, dtype=torch.int32, device=used.device)
    indptr[1:] = used.cumsum(0)
    first = torch.repeat_interleave(torch.arange(n, device=used.device) * width + start, used)
    within = torch.arange(int(indptr[-1]), device=used.device) - torch.repeat_interleave(indptr[:-1], used)
    return {"indptr": indptr, "indices": (first + within).int(), "last": torch.ones(n, dtype=torch.int32,
                                                                                   device=used.device)}


def plan_fields(wrapper) -> dict:
    """split_kv and padded_batch_size of a decode plan: the last and first fields of FlashInfer's
    DecodePlanInfo (wrapper._plan_info, a private list of ints: "?" where that changed)."""
    try:
        info = [int(x) for x in wrapper._plan_info]
        return {"split_kv": info[-1], "padded_batch_size": info[0]}
    except Exception as exc:
        return {"split_kv": "?", "padded_batch_size": "?", "plan_info": f"{type(exc).__name__}: {exc}"[:120]}


def flashinfer_form(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: dict[str, torch.Tensor],
                    n: int, width: int, h: int, kv: int, d: int, scale: float, start: torch.Tensor,
                    used: torch.Tensor):
    """(the call to time, what to print beside it) of a flashinfer row; (None, why) where it cannot run."""
    import time

    try:
        import flashinfer
    except Exception as exc:  # not installed, or its import fails on this machine
        return None, {"error": f"flashinfer not importable: {type(exc).__name__}: {exc}"[:300]}
    plan_kw = dict(num_qo_heads=h, num_kv_heads=kv, head_dim=d, page_size=1, pos_encoding_mode="NONE",
                   q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=scale)
    workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    extra: dict = {"flashinfer": getattr(flashinfer, "__version__", "?")}
    if name == "flashinfer":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        wrapper.plan(pages["indptr"], pages["indices"], pages["last"], **plan_kw)
        wrapper.run(q, (k, v))
        torch.cuda.synchronize()
        extra["compile_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        wrapper.plan(pages["indptr"], pages["indices"], pages["last"], **plan_kw)
        extra["plan_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        extra.update(plan_fields(wrapper))
        return (lambda: wrapper.run(q, (k, v)).view(n, 1, h, d)), extra
    # the engine's way, through benchmarks/flashinfer_graph.py (what the engine would run): planned once at the full
    # width in CUDA-graph mode, each call writing the slots' page lists on the device, replayed as a graph;
    # "flashinfer graph tc": its tensor-core kernel, planned unsplit (what the engine takes with few slots)
    from flashinfer_graph import FlashInferDecode  # benchmarks/: the engine's way, not in hpcgpu (see it)

    col = start + used.to(start.dtype) - 1
    kernel = FlashInferDecode(n, width, h, kv, d, q.dtype, q.device, tensor_cores=name.endswith(" tc"))
    extra.update({"compile_s": round(kernel.setup_s, 2), "split_kv": int(kernel.plan_splits()),
                  "tensor_cores": kernel.tensor_cores})
    q4, kf, vf = q.view(n, h, 1, d), k.view(n * width, kv, d), v.view(n * width, kv, d)

    def step() -> torch.Tensor:
        kernel.update(start, col)
        return kernel.attend(q4, kf, vf, scale)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay, extra


if __name__ == "__main__":
    main()
