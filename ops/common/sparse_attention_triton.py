"""Triton core of ops/common/sparse_attention.py: split-KV sparse attention over listed keys.

Grid (tokens, head blocks, splits). A program walks its share of the virtual key list
``[source 0 columns | source 1 columns]`` (each source padded to BLOCK_N so a tile never mixes
caches), gathers and dequantizes BLOCK_N key rows in registers, and keeps a flash-attention
running max / sum / accumulator in the log2 domain. K = V, so one load of each row serves q·k
and p·v. A second kernel merges the splits, applies the sink and writes out / lse.

Under Triton's CPU interpreter ``tl.dot`` on bf16 operands is wrong (triton#11584), so
interpreted launches feed the dots fp32 operands (``DOT_F32``); compiled launches use bf16.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparse_mla.ops.common import checks, formats
from sparse_mla.ops.common.sparse_attention import head_dims
from sparse_mla.ops.common.dispatch import triton_interpreting
from sparse_mla.ops.common.triton_utils import exp2_int, to_bf16

FMT_CODES = {"v4": 0, "v32": 1, "plain_bf16": 2, "plain_fp8": 3}
LAST_SPLIT_KERNEL = None   # last compiled split kernel (registers, spills: tools/profile_decode.py)
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)      # used inside kernels: must be a constexpr

# Launch shape; tools/tune_decode.py sweeps it (docs/PERF.md has the H200 numbers).
CONFIG = {"block_n": 64, "max_heads": 64, "num_warps": 8, "min_programs": 132, "num_stages": 1,
          "dv_split": 1}
# Tiny launches (<= SMALL_UNITS token x head-block units, <= 64 heads) have too few programs
# to fill the card: splitting the output dims over two programs with smaller tiles wins there
# (H200: 16.4 vs 20.9 µs at batch 2, h64) and loses everywhere else.
SMALL_UNITS = 4
SMALL_CONFIG = {"block_n": 32, "num_warps": 4, "min_programs": 264, "dv_split": 2}


def launch_config(T, H):
    cfg = dict(CONFIG)
    hb = max(16, min(triton.next_power_of_2(H), cfg["max_heads"]))
    if SMALL_CONFIG and H <= 64 and T * triton.cdiv(H, hb) <= SMALL_UNITS:
        cfg.update(SMALL_CONFIG)
    return cfg


@triton.jit
def _load_values(ptrs, mask, FP8: tl.constexpr):
    """bf16 values, or e4m3 bytes decoded, at ``ptrs`` as fp32 (zeros where masked)."""
    x = tl.load(ptrs, mask=mask, other=0)
    if FP8:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _dot_operand(x, DOT_F32: tl.constexpr):
    """fp32 values as a tl.dot operand: bf16, or fp32 under the interpreter (see module doc)."""
    if DOT_F32:
        return x
    return x.to(tl.bfloat16)


@triton.jit
def _load_latent(cache_ptr, s0, s1, BS, blk, off, v, FMT: tl.constexpr, BN: tl.constexpr,
                 COL0: tl.constexpr, NC: tl.constexpr, DOT_F32: tl.constexpr):
    """Columns [COL0, COL0 + NC) of the 512-wide latent of rows (blk, off) as a [BN, NC] tile
    (V4: dequantized NoPE plus, in columns 448..511, the bf16 RoPE dims; V3.2: dequantized;
    plain: the row). Invalid rows (``v`` False) are zeros. Dequantization is exact in bf16 for
    V4 (e4m3 × 2^k) and rounds fp32 products to bf16 for V3.2, as the reference does."""
    d = COL0 + tl.arange(0, NC)[None, :]
    if FMT == 0:
        # one UE8M0 scale per 64-wide tile, broadcast over the tile (not loaded per element)
        NT: tl.constexpr = NC // 64
        t3 = COL0 // 64 + tl.arange(0, NT)[None, :, None]
        c3 = tl.arange(0, 64)[None, None, :]
        base = cache_ptr + blk * s0
        data3 = (base + off * 576)[:, :, None]
        v3 = v[:, :, None]
        q8 = tl.load(data3 + t3 * 64 + c3, mask=v3 & (t3 < 7), other=0)
        sb = tl.load(base + BS * 576 + off * 8 + COL0 // 64 + tl.arange(0, NT)[None, :],
                     mask=v, other=127).to(tl.int32)
        x = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * exp2_int(sb - 127)[:, :, None]
        rope = tl.load((data3 + 448).to(tl.pointer_type(tl.bfloat16)) + c3,
                       mask=v3 & (t3 == 7), other=0.0).to(tl.float32)
        k = tl.reshape(tl.where(t3 < 7, x, rope), (BN, NC))
    elif FMT == 1:
        rec = cache_ptr + blk * s0 + off * 656
        q8 = tl.load(rec + d, mask=v, other=0).to(tl.float8e4nv, bitcast=True)
        sc = tl.load((rec + 512).to(tl.pointer_type(tl.float32)) + d // 128, mask=v, other=0.0)
        k = to_bf16(q8.to(tl.float32) * sc, DOT_F32).to(tl.float32)   # DOT_F32: interpreter
    else:
        k = _load_values(cache_ptr + blk * s0 + off * s1 + d, v, FMT == 3)
    return _dot_operand(k, DOT_F32)


@triton.jit
def _load_rope_tail(cache_ptr, s0, s1, BS, blk, off, v, FMT: tl.constexpr,
                    DOT_F32: tl.constexpr):
    """The 64 RoPE dims of 576-wide rows (V3.2 656 B records, or plain 576-wide rows)."""
    r = tl.arange(0, 64)[None, :]
    if FMT == 1:
        k = _load_values((cache_ptr + blk * s0 + off * 656 + 528).to(
            tl.pointer_type(tl.bfloat16)) + r, v, False)
    else:
        k = _load_values(cache_ptr + blk * s0 + off * s1 + 512 + r, v, FMT == 3)
    return _dot_operand(k, DOT_F32)


@triton.jit
def _attend_source(acc, m_i, l_i, mx, q_a, q_b, q_rope, dv, t, col0, col1, cache_ptr, s0, s1,
                   BS, cap, idx_ptr, idx_s0, K, len_ptr, scale2,
                   FMT: tl.constexpr, HAS_LEN: tl.constexpr, BN: tl.constexpr,
                   D576: tl.constexpr, DV: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold columns [col0, col1) of one source into the running softmax state. DV == 2: this
    program owns output dims [256·dv, 256·dv + 256); q·k still uses all 512 (two halves)."""
    n = K
    if HAS_LEN:
        n = tl.minimum(tl.load(len_ptr + t), K)
    hi = tl.minimum(col1, n)
    for c in range(col0, hi, BN):
        cols = c + tl.arange(0, BN)
        live = cols < hi
        idx = tl.load(idx_ptr + t.to(tl.int64) * idx_s0 + cols, mask=live, other=-1)
        valid = live & (idx >= 0) & (idx < cap)
        v = valid[:, None]
        blk = (idx // BS).to(tl.int64)[:, None]
        off = (idx % BS).to(tl.int64)[:, None]
        if DV == 1:
            k = _load_latent(cache_ptr, s0, s1, BS, blk, off, v, FMT, BN, 0, 512, DOT_F32)
            s = tl.dot(q_a, tl.trans(k))
        else:
            k_a = _load_latent(cache_ptr, s0, s1, BS, blk, off, v, FMT, BN, 0, 256, DOT_F32)
            k_b = _load_latent(cache_ptr, s0, s1, BS, blk, off, v, FMT, BN, 256, 256, DOT_F32)
            s = tl.dot(q_a, tl.trans(k_a)) + tl.dot(q_b, tl.trans(k_b))
            k = tl.where(dv == 0, k_a, k_b)
        if D576:
            k_rope = _load_rope_tail(cache_ptr, s0, s1, BS, blk, off, v, FMT, DOT_F32)
            s += tl.dot(q_rope, tl.trans(k_rope))
        s = tl.where(valid[None, :], s * scale2, float("-inf"))
        mx = tl.maximum(mx, tl.max(s, axis=1))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, k)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k)
        m_i = m_new
    return acc, m_i, l_i, mx


@triton.jit
def _load_q(q_row, hmask, COL0: tl.constexpr, NC: tl.constexpr, Q_FP8: tl.constexpr,
            DOT_F32: tl.constexpr):
    q = _load_values(q_row + COL0 + tl.arange(0, NC)[None, :], hmask[:, None], Q_FP8)
    return _dot_operand(q, DOT_F32)


@triton.jit
def _split_kernel(
        q_ptr, q_s0, q_s1, H,
        c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0, K0, l0_ptr,
        c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, K1, l1_ptr,
        scale2, part_o, part_ml, n_splits, cols_per_split, K0P,
        FMT0: tl.constexpr, FMT1: tl.constexpr, HAS_L0: tl.constexpr, HAS_L1: tl.constexpr,
        HAS_SRC1: tl.constexpr, Q_FP8: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
        D576: tl.constexpr, DV: tl.constexpr, DOT_F32: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1) // DV
    dv = tl.program_id(1) % DV
    sp = tl.program_id(2)
    NV: tl.constexpr = 512 // DV
    h = hb * HB + tl.arange(0, HB)
    hmask = h < H
    q_row = q_ptr + t.to(tl.int64) * q_s0 + h[:, None] * q_s1
    if DV == 1:
        q_a = _load_q(q_row, hmask, 0, 512, Q_FP8, DOT_F32)
        q_b = q_a
    else:
        q_a = _load_q(q_row, hmask, 0, 256, Q_FP8, DOT_F32)
        q_b = _load_q(q_row, hmask, 256, 256, Q_FP8, DOT_F32)
    if D576:
        q_rope = _load_q(q_row, hmask, 512, 64, Q_FP8, DOT_F32)
    else:
        q_rope = q_a
    acc = tl.zeros((HB, NV), tl.float32)
    m_i = tl.full((HB,), float("-inf"), tl.float32)
    l_i = tl.zeros((HB,), tl.float32)
    mx = tl.full((HB,), float("-inf"), tl.float32)
    lo = sp * cols_per_split
    hi = lo + cols_per_split
    # virtual columns [0, K0P) are source 0, [K0P, K0P + K1) source 1
    acc, m_i, l_i, mx = _attend_source(
        acc, m_i, l_i, mx, q_a, q_b, q_rope, dv, t, tl.minimum(lo, K0P), tl.minimum(hi, K0P),
        c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0, K0, l0_ptr, scale2, FMT0, HAS_L0,
        BN, D576, DV, DOT_F32)
    if HAS_SRC1:
        acc, m_i, l_i, mx = _attend_source(
            acc, m_i, l_i, mx, q_a, q_b, q_rope, dv, t, tl.maximum(lo - K0P, 0),
            tl.maximum(hi - K0P, 0), c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, K1,
            l1_ptr, scale2, FMT1, HAS_L1, BN, D576, DV, DOT_F32)
    # partials: o = acc / l (0 when empty), lse2 = m + log2(l) (-inf when empty), max logit
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    row = (t.to(tl.int64) * H + h) * n_splits + sp
    dcol = dv * NV + tl.arange(0, NV)[None, :]
    tl.store(part_o + row[:, None] * 512 + dcol, o, mask=hmask[:, None])
    first = hmask & ((h * 0 + dv) == 0)   # vector compare (interpreter rejects scalar & vector)
    tl.store(part_ml + row * 2, lse2, mask=first)
    tl.store(part_ml + row * 2 + 1, mx, mask=first)


@triton.jit
def _combine_kernel(part_o, part_ml, n_splits, H, sink_ptr, out_ptr, out_s0, out_s1, lse_ptr,
                    lse_s0, lse_s1, mx_ptr, mx_s0, mx_s1, out_scale,
                    HAS_SINK: tl.constexpr, HAS_LSE: tl.constexpr, HAS_MAX: tl.constexpr,
                    SPLITS: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    row = (t.to(tl.int64) * H + h) * n_splits + sp
    ok = sp < n_splits
    lse2 = tl.load(part_ml + row * 2, mask=ok, other=float("-inf"))
    mxs = tl.load(part_ml + row * 2 + 1, mask=ok, other=float("-inf"))
    m = tl.max(lse2, axis=0)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    w = tl.exp2(lse2 - m_safe)
    total = tl.sum(w, axis=0)
    d = tl.arange(0, 512)
    o = tl.load(part_o + row[:, None] * 512 + d[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, total))) * LN2)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h)
        # sigmoid(lse - sink): +inf sink -> 0, -inf sink -> 1; empty rows stay 0
        o = o * tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp(sink - lse)))
    o = tl.where(empty, 0.0, o * out_scale)
    tl.store(out_ptr + t.to(tl.int64) * out_s0 + h * out_s1 + d, to_bf16(o, SOFT))
    if HAS_LSE:
        tl.store(lse_ptr + t.to(tl.int64) * lse_s0 + h * lse_s1, lse)
    if HAS_MAX:
        mx = tl.max(mxs, axis=0)
        tl.store(mx_ptr + t.to(tl.int64) * mx_s0 + h * mx_s1, mx * LN2)


def _source_args(src):
    """(pointer tensor, stride0, stride1) for a source's cache, strides in its element unit."""
    if src.fmt in ("v4", "v32"):
        fmt = formats.get_format(src.fmt)
        raw = src.cache.view(torch.uint8) if src.cache.dtype != torch.uint8 else src.cache
        return raw, checks.block_stride(src.cache, fmt, src.block_size), 0
    cache = src.cache.view(torch.uint8) if src.fmt == "plain_fp8" else src.cache
    return cache, src.cache.stride(0), src.cache.stride(1)


def run(q, sources, sink, scale, out, lse=None, out_scale=1.0, max_logits=None):
    T, H = q.shape[0], q.shape[1]
    if T == 0 or H == 0:
        return
    cfg = launch_config(T, H)
    bn = cfg["block_n"]
    hb = max(16, min(triton.next_power_of_2(H), cfg["max_heads"]))
    n_hb = triton.cdiv(H, hb)
    src0 = sources[0]
    src1 = sources[1] if len(sources) > 1 else None
    k0 = src0.indices.shape[1]
    k1 = src1.indices.shape[1] if src1 is not None else 0
    k0p = triton.cdiv(k0, bn) * bn
    total_blocks = max(1, (k0p + triton.cdiv(k1, bn) * bn) // bn)
    # enough programs to fill the card; each split a whole number of key tiles
    dv = cfg["dv_split"]
    want = max(1, cfg["min_programs"] // (T * n_hb * dv))
    n_splits = min(total_blocks, want)
    cols_per_split = triton.cdiv(total_blocks, n_splits) * bn
    n_splits = triton.cdiv(total_blocks * bn, cols_per_split)
    dev = q.device
    part_o = torch.empty(T * H * n_splits * 512, dtype=torch.float32, device=dev)
    part_ml = torch.empty(T * H * n_splits * 2, dtype=torch.float32, device=dev)
    c0, c0s0, c0s1 = _source_args(src0)
    if src1 is not None:
        c1, c1s0, c1s1 = _source_args(src1)
    else:
        c1, c1s0, c1s1 = c0, 0, 0
    i0 = src0.indices
    i1 = src1.indices if src1 is not None else i0
    dummy = i0
    q_fp8 = q.dtype == torch.float8_e4m3fn
    qq = q.view(torch.uint8) if q_fp8 else q
    interp = triton_interpreting()
    global LAST_SPLIT_KERNEL
    LAST_SPLIT_KERNEL = _split_kernel[(T, n_hb * dv, n_splits)](
        qq, q.stride(0), q.stride(1), H,
        c0, c0s0, c0s1, src0.block_size, src0.capacity, i0, i0.stride(0), k0,
        src0.lengths if src0.lengths is not None else dummy,
        c1, c1s0, c1s1, src1.block_size if src1 else 1, src1.capacity if src1 else 0, i1,
        i1.stride(0), k1, src1.lengths if (src1 is not None and src1.lengths is not None)
        else dummy,
        float(scale) * LOG2E, part_o, part_ml, n_splits, cols_per_split, k0p,
        FMT0=FMT_CODES[src0.fmt], FMT1=FMT_CODES[src1.fmt] if src1 else 0,
        HAS_L0=src0.lengths is not None,
        HAS_L1=src1 is not None and src1.lengths is not None, HAS_SRC1=src1 is not None,
        Q_FP8=q_fp8, HB=hb, BN=bn, D576=head_dims(sources) == 576, DV=dv, DOT_F32=interp,
        num_warps=cfg["num_warps"],
        **({} if cfg["num_stages"] is None else {"num_stages": cfg["num_stages"]}))
    _combine_kernel[(T, H)](
        part_o, part_ml, n_splits, H, sink if sink is not None else part_ml, out,
        out.stride(0), out.stride(1), lse if lse is not None else part_ml,
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        max_logits if max_logits is not None else part_ml,
        max_logits.stride(0) if max_logits is not None else 0,
        max_logits.stride(1) if max_logits is not None else 0, float(out_scale),
        HAS_SINK=sink is not None, HAS_LSE=lse is not None, HAS_MAX=max_logits is not None,
        SPLITS=triton.next_power_of_2(n_splits), SOFT=interp, num_warps=4)
