"""Decode attention formulations side by side on one GPU, no model: one query token a slot over a KV cache
of N slots x W columns (grouped-query heads), what the slot engine's step spends most of its time in at
hundreds of slots. Prints one JSON line a formulation: microseconds a call (median of 5 x 20 calls, CUDA
events), the K+V bytes it had to read (live columns for varlen, the view's columns for the rest) over that
time, and its largest error against an fp32 reference.

    python benchmarks/decode_attention_probe.py [--slots 512] [--width 640] [--view 640] [--compile]

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
    live_bytes = int(used.sum()) * kv * d * 2 * 2
    view_bytes = n * w * kv * d * 2 * 2
    for name, fn in forms.items():
        try:
            with torch.inference_mode():
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
            read = live_bytes if name == "varlen" else view_bytes
            print(json.dumps({"form": name, "slots": n, "view": w, "us": round(us, 1), "read_mb": round(read / 1e6),
                              "tb_s": round(read / us / 1e6, 2), "max_err": round(err, 4)}), flush=True)
        except Exception as exc:
            print(json.dumps({"form": name, "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)


if __name__ == "__main__":
    main()
