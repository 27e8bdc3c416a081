"""Benchmark / CLI cases for FlashMLA-semantics decode and prefill (FlashMLA's own shapes).

Decode: every token attends a 128-token window (SWA cache, page 256) plus top-k compressed
entries (compressed cache, page 64): h 64 with 512, h 128 with 1024; s_q 1 and 2. V3.2: h 128,
s_q 2, top-k 2048 of a 656 B cache. Prefill: 4096 queries, h 128, top-k 2048 of 32768 keys,
at d_qk 512 (V4) and 576 (V3.2). FLOPs = 2·h·(D_qk + 512) per (token, key); bytes = key rows
+ q + out.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.cache_insert import (compressed_insert_v41, quantize_insert_v32,
                                         quantize_insert_v4)
from sparse_mla.ops.common import formats
from sparse_mla.ops.common.benchcase import BenchCase
from sparse_mla.ops.flashmla_decode import ops

WINDOW = 128
# FlashMLA-range data (outputs |o| < 1): docs/semantics.md §9's abs 1e-3 + rel 2/128 as one
# max-abs bound
TOLERANCE = 1e-3 + 2 / 128


def _max_err(ref, out):
    return max(float((a.float() - b.float()).abs().nan_to_num(0.0, 0.0, 0.0).max())
               for a, b in zip(ref, out))


def _random_cache(fmt, n_blocks, bs, device):
    """A cache of random rows quantized by our writer (FlashMLA's value range: randn / 10)."""
    cache = formats.alloc_paged_cache(fmt, n_blocks, bs, device=device, fill=0)
    n = n_blocks * bs
    x = (torch.randn(n, 512, device=device) / 10).clamp(-1, 1).to(torch.bfloat16)
    slots = torch.arange(n, device=device)
    if fmt == "v4":
        quantize_insert_v4(x, cache, slots)
    elif fmt in ("v41", "v41_fp4"):
        identity = torch.cat([torch.ones(1, 32), torch.zeros(1, 32)], dim=1).to(device)
        compressed_insert_v41(x, cache, slots, torch.zeros_like(slots), identity, 1,
                              cache_format=fmt)
    else:
        rope = (torch.randn(n, 64, device=device) / 10).clamp(-1, 1).to(torch.bfloat16)
        quantize_insert_v32(x, rope, cache, slots)
    return cache


def _rows(b, s_q, width, per_row, device, g_seed):
    """Distinct ids per token from its request's own region of ``per_row`` slots."""
    g = torch.Generator(device=device).manual_seed(g_seed)
    base = (torch.arange(b, device=device) * per_row).view(b, 1, 1)
    pick = torch.rand(b, s_q, per_row, device=device, generator=g).argsort(-1)[..., :width]
    return (base + pick).to(torch.int32)


def decode_inputs(b, s_q, h, topk, device, fmt="v4"):
    d = formats.get_format(fmt).out_dim
    q = torch.randn(b, s_q, h, d, device=device).clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(h, device=device)
    if fmt == "v32":
        cache = _random_cache("v32", b * 4096 // 64, 64, device)
        return dict(q=q, k_cache=cache, indices=_rows(b, s_q, topk, 4096, device, 1),
                    kv_format="v32")
    swa = _random_cache("v4", b, 256, device)
    per_req = 4 * topk
    cmp_ = _random_cache("v4", b * per_req // 64, 64, device)
    full = lambda w: torch.full((b,), w, dtype=torch.int32, device=device)  # noqa: E731
    return dict(q=q, k_cache=swa, indices=_rows(b, s_q, WINDOW, 256, device, 1),
                topk_length=full(WINDOW), extra_k_cache=cmp_,
                extra_indices_in_kvcache=_rows(b, s_q, topk, per_req, device, 2),
                extra_topk_length=full(topk), attn_sink=sink)


def decode_cost(b, s_q, h, n_keys, fmt="v4"):
    d, row = formats.get_format(fmt).out_dim, formats.get_format(fmt).bytes_per_token
    tokens = b * s_q
    flops = 2 * h * (d + 512) * n_keys * tokens
    nbytes = tokens * (n_keys * row + h * d * 2 + h * 512 * 2)
    return flops, nbytes


def prefill_inputs(s_q, h, s_kv, topk, device, d=512):
    """``d`` 512: V4 (with a sink); 576: V3.2, which has no sink (vLLM passes none)."""
    g = torch.Generator(device=device).manual_seed(3)
    idx = torch.rand(s_q, 1, s_kv, device=device, generator=g).argsort(-1)[..., :topk]
    return dict(q=torch.randn(s_q, h, d, device=device).clamp(-1, 1).to(torch.bfloat16),
                kv=(torch.randn(s_kv, 1, d, device=device) / 10).to(torch.bfloat16),
                indices=idx.to(torch.int32), sm_scale=d ** -0.5,
                attn_sink=torch.randn(h, device=device) if d == 512 else None)


def _decode_case(b, s_q, h, topk, device, fmt="v4", check=True):
    n_keys = topk if fmt == "v32" else WINDOW + topk
    flops, nbytes = decode_cost(b, s_q, h, n_keys, fmt)

    def run(a, impl):
        a = dict(a)
        q, c, i = a.pop("q"), a.pop("k_cache"), a.pop("indices")
        return ops.flash_mla_with_kvcache(q, c, i, impl=impl, **a)

    name = f"{fmt} b={b} s_q={s_q} h={h} " + (f"topk={topk}" if fmt == "v32" else
                                               f"win={WINDOW}+{topk}")
    return BenchCase("flashmla_sparse_decode", name,
                     lambda: decode_inputs(b, s_q, h, topk, device, fmt), run, bytes=nbytes,
                     flops=flops, compare=_max_err, reference=check, tolerance=TOLERANCE)


def _prefill_case(s_q, h, s_kv, topk, device, check, d=512):
    flops = 2 * h * (d + 512) * topk * s_q
    nbytes = s_q * (topk * 2 * d + h * (d + 512) * 2)

    def run(a, impl):
        return ops.flash_mla_sparse_fwd(impl=impl, **a)

    name = ("v32 " if d == 576 else "") + f"s_q={s_q} h={h} topk={topk}/{s_kv}"
    return BenchCase("flashmla_sparse_prefill", name,
                     lambda: prefill_inputs(s_q, h, s_kv, topk, device, d), run, bytes=nbytes,
                     flops=flops, compare=_max_err, reference=check, tolerance=TOLERANCE)


DECODE_SHAPES = [(h, topk, s_q, b) for h, topk in ((64, 512), (128, 1024)) for s_q in (1, 2)
                 for b in (2, 64, 74, 128, 148, 256)]
# tensor-parallel shards of the h64 layers (TP 2 / 4), at batch 2 and 64
SHARD_SHAPES = [(h, 512, 2, b) for h in (32, 16) for b in (2, 64)]
# C128A layers: the window and the 64 compressed rows of 8,192 tokens of context (192 keys a
# token), where bench_backend found FlashMLA's layer faster than ours from batch 64
SHORT_SHAPES = [(h, 64, 1, b) for h in (64, 128) for b in (64, 256)]


def cases(device: str, small: bool):
    if small:
        return [_decode_case(2, 1, 8, 64, device), _prefill_case(8, 4, 64, 64, device, True)]
    out = [_decode_case(b, s_q, h, topk, device, check=b * s_q <= 64)
           for h, topk, s_q, b in DECODE_SHAPES + SHARD_SHAPES + SHORT_SHAPES]
    out.append(_decode_case(64, 2, 128, 2048, device, fmt="v32", check=False))
    out.append(v41_decode_case(64, 1, 64, "v41", "v41_fp4", device, check=True))
    out.append(_prefill_case(4096, 128, 32768, 2048, device, check=False))
    out.append(_prefill_case(4096, 128, 32768, 2048, device, check=False, d=576))   # V3.2
    return out


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4.1-Flash decode (docs/semantics.md §12): window 128 in 32-token SWA pages + top-k
# 512 compressed entries in 64-token blocks; the native records (528 B SWA + 288 B compressed)
# against the 584 B pair vLLM writes below SM100
V41_TOPK = 512
V41_SWA_PAGE = 32
V41_COMPRESSED_BLOCK = 64
V41_RECORDS = (("v41", "v41_fp4"), ("v41", "v41"), ("v4", "v4"))
V41_DECODE_SHAPES = [(h, s_q, b) for h in (64, 128) for s_q in (1, 2) for b in (1, 64, 256)]
V41_QUICK_SHAPES = [(h, 1, b) for h in (64, 128) for b in (1, 64, 256)]


def v41_kv_bytes(main_fmt, extra_fmt, ratio):
    """KV bytes per context token per layer of a C<ratio>A layer: its compressed entries
    (one per ``ratio`` tokens); the SWA cache adds ``WINDOW`` records per request whatever
    the context."""
    return formats.get_format(extra_fmt).bytes_per_token / ratio


def v41_decode_inputs(b, s_q, h, main_fmt, extra_fmt, device):
    """Each request: 160 SWA slots (5 pages of 32) of which the window's 128 are read, and
    4 x 512 compressed entries of which 512 are read."""
    q = torch.randn(b, s_q, h, 512, device=device).clamp(-1, 1).to(torch.bfloat16)
    swa_slots = 5 * V41_SWA_PAGE
    swa = _random_cache(main_fmt, b * 5, V41_SWA_PAGE, device)
    per_req = 4 * V41_TOPK
    cmp_ = _random_cache(extra_fmt, b * per_req // V41_COMPRESSED_BLOCK, V41_COMPRESSED_BLOCK,
                         device)
    full = lambda w: torch.full((b,), w, dtype=torch.int32, device=device)  # noqa: E731
    a = dict(q=q, k_cache=swa, indices=_rows(b, s_q, WINDOW, swa_slots, device, 1),
             topk_length=full(WINDOW), extra_k_cache=cmp_,
             extra_indices_in_kvcache=_rows(b, s_q, V41_TOPK, per_req, device, 2),
             extra_topk_length=full(V41_TOPK), attn_sink=torch.randn(h, device=device),
             kv_format=main_fmt)
    if extra_fmt != main_fmt:
        a["extra_kv_format"] = extra_fmt
    return a


def v41_decode_case(b, s_q, h, main_fmt, extra_fmt, device, check=True):
    tokens = b * s_q
    n_keys = WINDOW + V41_TOPK
    flops = 2 * h * 1024 * n_keys * tokens
    nbytes = tokens * (WINDOW * formats.get_format(main_fmt).bytes_per_token
                       + V41_TOPK * formats.get_format(extra_fmt).bytes_per_token
                       + h * 512 * 4)

    def run(a, impl):
        a = dict(a)
        q, c, i = a.pop("q"), a.pop("k_cache"), a.pop("indices")
        return ops.flash_mla_with_kvcache(q, c, i, impl=impl, **a)

    name = f"v4.1 {main_fmt}+{extra_fmt} b={b} s_q={s_q} h={h} win={WINDOW}+{V41_TOPK}"
    return BenchCase("flashmla_sparse_decode", name,
                     lambda: v41_decode_inputs(b, s_q, h, main_fmt, extra_fmt, device), run,
                     bytes=nbytes, flops=flops, compare=_max_err, reference=check,
                     tolerance=TOLERANCE)
