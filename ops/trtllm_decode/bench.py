"""Benchmark cases for the TRTLLM-gen-semantics DSv4 decode (ops/common/benchcase.py contract).

small=False: bf16 and per-tensor-fp8 plain caches, h 64 / 128, window 128 + compressed 512 /
1024 (cross product), batch 1 / 4 / 64 / 256 with s_q = 2 (MTP, as docs/design.md's FlashMLA
anchor; batch 4 splits the keys and combines, as FlashMLA's batch-2 shapes do), long context
(every SWA column visible, every compressed column valid). SWA pool page 64; compressed
pool page 64 with scattered rows. small=True: tiny CPU shapes.

``bytes`` = KV rows a perfect kernel reads (valid keys x row bytes, per token) + q + out;
``flops`` = 4 * H * 512 * valid keys per token (QK and PV). compare = max abs error vs the
reference; the per-token Python reference is skipped (reference=False) above 64 tokens.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common.benchcase import BenchCase
from sparse_mla.ops.trtllm_decode import ops

I32 = torch.int32
# bf16 outputs of magnitude < 1: docs/semantics.md §9's decode bound (abs 1e-3 + rel 2/128) as
# one number
TOLERANCE = 1e-3 + 2 / 128
W = 128
PAGE = 64
SCALE = 512 ** -0.5


def _max_abs(a, b):
    return max(float((x.float().cpu() - y.float().cpu()).abs().max()) for x, y in zip(a, b))


def _make(device, dtype, B, s_q, H, topk_c, ctx, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = B * s_q
    fp8 = dtype == torch.float8_e4m3fn
    kv_scale = 0.5 if fp8 else 1.0
    swa_rows = B * (W + s_q + PAGE)
    swa_pages = -(-swa_rows // PAGE)
    cmp_rows = max(min(T * max(topk_c, 1), 1 << 18), topk_c * 97 + 1)
    cmp_pages = -(-cmp_rows // PAGE)
    swa = torch.randn(swa_pages, PAGE, 512, generator=g)
    cmp = torch.randn(cmp_pages, PAGE, 512, generator=g)
    q = torch.randn(T, H, 512, generator=g)
    if fp8:
        swa, cmp, q = (x.div(kv_scale).to(dtype) for x in (swa, cmp, q))
    else:
        swa, cmp, q = (x.to(dtype) for x in (swa, cmp, q))
    # SWA: request b owns rows [b*(W+s_q+PAGE), ...); token i of the request sees the W rows
    # ending at its own position.
    req = torch.arange(T) // s_q
    qi = torch.arange(T) % s_q
    base = req * (W + s_q + PAGE) + qi + 1
    swa_idx = (base.unsqueeze(1) + torch.arange(W)).to(I32)
    start = torch.randint(0, cmp_pages * PAGE, (T, 1), generator=g)
    cmp_idx = ((start + torch.arange(topk_c) * 97) % (cmp_pages * PAGE)).to(I32)
    x = dict(
        query=q.view(B, s_q, H, 512), swa_kv_cache=swa, compressed_kv_cache=cmp,
        sparse_indices=torch.cat([swa_idx, cmp_idx], dim=1),
        sparse_topk_lens=torch.full((T,), W + topk_c, dtype=I32),
        seq_lens=torch.full((B,), ctx + s_q, dtype=I32),
        sinks=torch.randn(H, generator=g),
        out=torch.empty(B, s_q, H, 512, dtype=torch.bfloat16))
    x = {k: v.to(device) for k, v in x.items()}
    x["bmm1"] = SCALE * kv_scale * kv_scale if fp8 else SCALE   # q_scale = kv_scale here
    x["bmm2"] = kv_scale
    return x


def _run(x, impl):
    ops.trtllm_decode_dsv4(x["query"], x["swa_kv_cache"], x["sparse_indices"],
                           x["compressed_kv_cache"], x["sparse_topk_lens"], x["seq_lens"],
                           x["out"], x["bmm1"], None, x["bmm2"], None, x["sinks"], "HND", None,
                           None, None, impl)
    return (x["out"],)


def cases(device: str, small: bool) -> list:
    out = []
    if small:
        grid = [(dt, 8, 16, 2, 2, 300) for dt in (torch.bfloat16, torch.float8_e4m3fn)]
    else:
        grid = [(dt, h, c, b, 2, 8192) for dt in (torch.bfloat16, torch.float8_e4m3fn)
                for h, c in ((64, 512), (64, 1024), (128, 512), (128, 1024))
                for b in (1, 4, 64, 256)]
    for dtype, H, topk_c, B, s_q, ctx in grid:
        T = B * s_q
        row = 1024 if dtype == torch.bfloat16 else 512
        keys = W + topk_c
        name = "bf16" if dtype == torch.bfloat16 else "fp8"
        shape = f"{name} h={H} W=128+{topk_c} B={B} s_q={s_q}"

        def make(dtype=dtype, H=H, topk_c=topk_c, B=B, s_q=s_q, ctx=ctx):
            return _make(device, dtype, B, s_q, H, topk_c, ctx)
        out.append(BenchCase(
            "trtllm_decode_dsv4", shape, make, _run,
            bytes=T * keys * row + T * H * 512 * (row // 512) + T * H * 512 * 2,
            flops=4 * H * 512 * keys * T, compare=_max_abs, error_unit="max abs err",
            reference=T <= 64, tolerance=TOLERANCE))
    return out
