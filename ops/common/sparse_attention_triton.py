"""Triton core of ops/common/sparse_attention.py: split-KV sparse attention over listed keys.

Grid (tokens × head blocks × output halves, splits). Each token's key list is virtual:
``[source 0's usable columns, padded to BLOCK_N | source 1's]``, cut into ``n_splits`` runs of
whole tiles (``attention_plan.choose_splits`` picks the count from a wave cost model; which
kernel runs and why is ``attention_plan.plan_launch``'s, and ``run`` returns its plan). A program walks its
run in one loop (the source of each tile picked by scalar selects; a launch whose runs are
at most one tile has no loop, ``ONE_TILE``), gathers BLOCK_N key rows,
dequantizes them one 64-wide tile at a time (small temporaries: a whole fp32 [BN, 512] tile
beside the [64, 512] accumulator is what made the first version spill) and joins the tiles
into one bf16 operand that serves both q·k and p·v (K = V). It keeps a flash-attention running
max / sum / accumulator in the log2 domain; a second kernel merges the splits, applies the
sink and writes out / lse / max logits. Tiny launches also split the 512 output dims over two
4-warp programs (``DV`` = 2), which then both compute q·k.

On sm_90 the split kernel is replaced by ``sparse_attention_gluon._ws_kernel`` (warp-specialized:
producer warps gather and dequantize, consumer warpgroups run the dots) for every cache
format (V4, V3.2, plain 512- or 576-wide rows) unless the launch is tiny and has one head
block; the combine kernel is shared
(launched with programmatic dependent launch on sm_90+), and when a launch has one split per
token the Gluon kernel writes out / lse / max logits itself. Where one launch would leave
its last wave mostly idle, ``plan_phases`` makes two: the tokens filling whole waves
unsplit, then the rest split (``t0``: the launch's first token). V4 and V3.2 rows at 65-128
heads run as 2-CTA clusters, each CTA dequantizing half of every tile for both.

Under Triton's CPU interpreter ``tl.dot`` on bf16 operands is wrong (triton#11584), so
interpreted launches feed the dots fp32 operands (``DOT_F32``); compiled launches use bf16, or
fp16 for plain e4m3 keys with an e4m3 q (``F16``, exact).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_mla.ops.common import attention_plan as plan
from sparse_mla.ops.common import checks, formats
from sparse_mla.ops.common.sparse_attention import head_dims
from sparse_mla.ops.common.dispatch import triton_interpreting
from sparse_mla.ops.common.triton_utils import (grid_launch_dependents, grid_wait,
                                                launch_capped, pdl_supported, to_bf16,
                                                ue8m0_scale)

FMT_CODES = {"v4": 0, "v32": 1, "plain_bf16": 2, "plain_fp8": 3}
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)      # used inside kernels: must be a constexpr
LOG2E_C = tl.constexpr(LOG2E)

# Programmatic dependent launch where the GPU has it (sm_90+): the split and combine kernels
# are scheduled while the kernel before them runs and wait for its writes in-kernel, so their
# launch latency is hidden (docs/PERF.md session 7).
PDL = True
# Plain e4m3 keys with an e4m3 q run the dots on fp16 operands, in both kernels: exact (e4m3
# values are fp16 values as they are bf16 values), and e4m3 -> fp16 is one conversion per two
# bytes where -> bf16 is three (H200: the fp8 path 1.32-1.38x faster on the sm_90 kernel,
# 1.10-1.14x on the portable one, docs/PERF.md session 8)
FP16_FOR_E4M3 = True



@triton.jit
def _load_values(ptrs, mask, FP8: tl.constexpr):
    """bf16 values, or e4m3 bytes decoded, at ``ptrs`` as fp32 (zeros where masked)."""
    x = tl.load(ptrs, mask=mask, other=0)
    if FP8:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _dot_operand(x, DOT_F32: tl.constexpr, F16: tl.constexpr = False):
    """fp32 values as a tl.dot operand: bf16 (fp16 where ``F16``: e4m3 keys and queries), or
    fp32 under the interpreter (see module doc)."""
    if DOT_F32:      # one return per static branch: Triton type-checks every return it sees
        y = x
    elif F16:
        y = x.to(tl.float16)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def _load_operand(ptrs, mask, FP8: tl.constexpr, DOT_F32: tl.constexpr,
                  F16: tl.constexpr = False):
    """bf16 / fp16 values, or e4m3 bytes decoded, at ``ptrs`` straight into a dot operand (no
    fp32 copy: a [64, 512] fp32 q staged on its way to bf16 is what made the fp8 path spill).
    ``F16``: the operand is fp16 (e4m3 is exact in it, and converts to it in one instruction
    per two bytes: three to bf16)."""
    x = tl.load(ptrs, mask=mask, other=0)
    if FP8:
        x = x.to(tl.float8e4nv, bitcast=True)
    return _dot_operand(x.to(tl.float32) if DOT_F32 else x, DOT_F32, F16)


@triton.jit
def _row_scales(cache_ptr, s0, BS, blk, off, v, FMT: tl.constexpr, SCALE64: tl.constexpr):
    """V4 with 8-byte-aligned blocks: each row's eight UE8M0 scale bytes as one int64 [BN, 1].
    One 8-byte load per row replaces seven 1-byte loads per tile, and Triton's pipeliner can
    stage it asynchronously (it cannot stage 1-byte loads: they stalled every iteration)."""
    if FMT == 0 and SCALE64:
        ptr = (cache_ptr + blk * s0 + BS * 576 + off * 8).to(tl.pointer_type(tl.int64))
        sc = tl.load(ptr, mask=v, other=0)
    else:
        sc = tl.zeros_like(off)      # unused
    return sc


@triton.jit
def _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, TILE: tl.constexpr, FMT: tl.constexpr,
              SCALE64: tl.constexpr, DOT_F32: tl.constexpr, F16: tl.constexpr = False):
    """Dims [64·TILE, 64·TILE + 64) of key rows (blk, off) as a [BN, 64] dot operand; rows
    with ``v`` False are zeros. TILE 8 is the 64-dim RoPE tail of 576-wide rows. V4: e4m3 × 2^k
    is exact in bf16 (one UE8M0 scale per row and tile), dims 448..511 are the bf16 RoPE part;
    V3.2 rounds the fp32 product to bf16 as the reference does. Working one 64-wide tile at a
    time keeps the dequantization temporaries small: a whole [BN, 512] fp32 tile next to the
    [64, 512] accumulator is what made the first version spill."""
    c = tl.arange(0, 64)[None, :]
    if FMT == 0:
        base = cache_ptr + blk * s0
        if TILE < 7:
            x = _load_values(base + off * 576 + TILE * 64 + c, v, True)
            if SCALE64:
                sb = ((sc64 >> (8 * TILE)) & 0xFF).to(tl.int32)
            else:
                sb = tl.load(base + BS * 576 + off * 8 + TILE, mask=v, other=127).to(tl.int32)
            k = _dot_operand(x * ue8m0_scale(sb), DOT_F32)
        else:
            k = _load_operand((base + off * 576 + 448).to(tl.pointer_type(tl.bfloat16)) + c, v,
                              False, DOT_F32)
    elif FMT == 1:
        rec = cache_ptr + blk * s0 + off * 656
        if TILE < 8:
            x = _load_values(rec + TILE * 64 + c, v, True)
            sc = tl.load((rec + 512).to(tl.pointer_type(tl.float32)) + TILE // 2, mask=v,
                         other=0.0)
            k = _dot_operand(to_bf16(x * sc, DOT_F32).to(tl.float32), DOT_F32)
        else:
            k = _load_operand((rec + 528).to(tl.pointer_type(tl.bfloat16)) + c, v, False,
                              DOT_F32)
    else:
        k = _load_operand(cache_ptr + blk * s0 + off * s1 + TILE * 64 + c, v, FMT == 3, DOT_F32,
                          F16)
    return k


@triton.jit
def _cat(a, b):
    j = tl.join(a, b)
    j = tl.permute(j, (0, 2, 1))
    return tl.reshape(j, (j.shape[0], 2 * a.shape[1]))


@triton.jit
def _key_half(cache_ptr, s0, s1, BS, blk, off, v, sc64, HALF: tl.constexpr, FMT: tl.constexpr,
              SCALE64: tl.constexpr, DOT_F32: tl.constexpr, F16: tl.constexpr):
    """Dims [256·HALF, 256·HALF + 256) of the key rows: four ``_key_tile``s joined."""
    T0: tl.constexpr = 4 * HALF
    a = _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, T0, FMT, SCALE64, DOT_F32, F16)
    b = _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, T0 + 1, FMT, SCALE64, DOT_F32, F16)
    c = _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, T0 + 2, FMT, SCALE64, DOT_F32, F16)
    d = _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, T0 + 3, FMT, SCALE64, DOT_F32, F16)
    return _cat(_cat(a, b), _cat(c, d))


@triton.jit
def slot_row(c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0):
    """Where the slot ids of virtual columns from ``c`` live: (index row of token ``t`` in
    the column's source, the column within that source, its usable column count; 0 at/after
    ``hi``). Source 0's columns are below ``n0p``, source 1's after. Scalar code: the Gluon
    producer calls it too."""
    first = c < n0p
    col = tl.where(first, c, c - n0p)
    n = tl.where(c < hi, tl.where(first, n0, n1), 0)
    row = tl.where(first, i0_ptr + t.to(tl.int64) * i0_s0, i1_ptr + t.to(tl.int64) * i1_s0)
    return row, col, n


@triton.jit
def tile_source(first, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, c1_ptr, c1_s0, c1_s1, c1_bs,
                c1_cap):
    """A tile's cache arguments (pointer, block stride, row stride, block size, capacity):
    source 0's where ``first``, else source 1's. Scalar code: the Gluon producer calls it."""
    return (tl.where(first, c0_ptr, c1_ptr), tl.where(first, c0_s0, c1_s0),
            tl.where(first, c0_s1, c1_s1), tl.where(first, c0_bs, c1_bs),
            tl.where(first, c0_cap, c1_cap))


@triton.jit
def _tile_slots(c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, BN: tl.constexpr):
    """Slot ids of virtual columns [c, c + BN) (-1 where unusable or at/after ``hi``)."""
    row, col, n = slot_row(c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0)
    cols = col + tl.arange(0, BN)
    return tl.load(row + cols, mask=cols < n, other=-1)


@triton.jit
def _source_length(len_ptr, t, div, off, lag, K, HAS_LEN: tl.constexpr):
    """Usable leading columns of a source for token ``t`` (``KeySource.usable``):
    lengths[t // div] - off - lag·(div - 1 - t % div), clamped to [0, K]. ``div`` tokens share
    one entry (FlashMLA's per-batch-row lengths); ``lag`` (0 / 1) gives the earlier query
    positions of a request fewer columns (TRTLLM-gen's window)."""
    n = K
    if HAS_LEN:
        n = tl.load(len_ptr + t // div) - off - lag * (div - 1 - t % div)
        n = tl.maximum(tl.minimum(n, K), 0)
    return n


@triton.jit
def softmax_step(s, m_i, l_i):
    """One tile of the running softmax over log2-domain scores ``s`` [rows, keys] (-inf for
    unusable keys): (p, the rescale of what came before, new max, new sum, the tile's max).
    Rows without a usable key so far keep max -inf and sum 0. Elementwise / row-reduction
    code: the Gluon kernel calls it on its wgmma layouts too."""
    m_tile = tl.max(s, axis=1)
    m_new = tl.maximum(m_i, m_tile)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1), m_tile


@triton.jit
def sink_gate(lse, sink, empty):
    """Output factor of the attention sink: sigmoid(lse - sink), so a +inf sink gives 0 and a
    -inf sink 1; rows without keys stay 0. Shared by the combine kernel and the Gluon
    kernel's one-split epilogue."""
    return tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp(sink - lse)))


@triton.jit
def key_run(l0_ptr, l0_div, l0_off, l0_lag, l1_ptr, l1_div, l1_off, l1_lag, t, K0, K1, sp,
            n_splits, HAS_L0: tl.constexpr, HAS_L1: tl.constexpr, HAS_SRC1: tl.constexpr,
            BN: tl.constexpr):
    """Token ``t``'s usable lengths (n0, n1), source 0's padded length n0p, and split ``sp``'s
    run [lo, hi) of its virtual key list: source 0's usable columns padded to BN, then source
    1's, cut into ``n_splits`` runs of whole tiles. Scalar code: the Gluon kernel calls it too."""
    n0 = _source_length(l0_ptr, t, l0_div, l0_off, l0_lag, K0, HAS_L0)
    n1 = 0
    if HAS_SRC1:
        n1 = _source_length(l1_ptr, t, l1_div, l1_off, l1_lag, K1, HAS_L1)
    n0p = tl.cdiv(n0, BN) * BN
    total = n0p + n1
    per_split = tl.cdiv(tl.cdiv(total, BN), n_splits) * BN
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, total)
    return n0, n1, n0p, lo, hi


@triton.jit
def _load_q(q_row, hmask, COL0: tl.constexpr, NC: tl.constexpr, Q_FP8: tl.constexpr,
            DOT_F32: tl.constexpr, F16: tl.constexpr):
    """Dims [COL0, COL0 + NC) of the head block's q rows as a dot operand."""
    return _load_operand(q_row + COL0 + tl.arange(0, NC)[None, :], hmask[:, None], Q_FP8,
                         DOT_F32, F16)


@triton.jit
def _load_q_block(q_row, hmask, DV: tl.constexpr, D576: tl.constexpr, Q_FP8: tl.constexpr,
                  DOT_F32: tl.constexpr, F16: tl.constexpr):
    """The head block's q as dot operands: the two 256-dim halves (the same full 512 dims
    twice where ``DV`` is 1) and the RoPE tail of 576-wide rows (else a placeholder)."""
    if DV == 1:
        q_lo = _load_q(q_row, hmask, 0, 512, Q_FP8, DOT_F32, F16)
        q_hi = q_lo
    else:
        q_lo = _load_q(q_row, hmask, 0, 256, Q_FP8, DOT_F32, F16)
        q_hi = _load_q(q_row, hmask, 256, 256, Q_FP8, DOT_F32, F16)
    if D576:
        q_rope = _load_q(q_row, hmask, 512, 64, Q_FP8, DOT_F32, F16)
    else:
        q_rope = q_lo
    return q_lo, q_hi, q_rope


@triton.jit
def _tile_keys(cache, s0, s1, bs, cap, idx, FMT: tl.constexpr, DV: tl.constexpr,
               SCALE64: tl.constexpr, DOT_F32: tl.constexpr, F16: tl.constexpr):
    """Gather and decode the key rows ``idx`` (slot ids; unusable where < 0 or >= ``cap``) of
    one cache: (valid [BN], block and in-block row [BN, 1], dims [0, 256) and [256, 512) as dot
    operands, or where ``DV`` is 1 the whole rows twice)."""
    valid = (idx >= 0) & (idx < cap)
    v = valid[:, None]
    blk = (idx // bs).to(tl.int64)[:, None]
    off = (idx % bs).to(tl.int64)[:, None]
    if FMT == 2:
        # plain bf16 rows need no decoding: loaded whole, Triton copies them straight into
        # shared memory (cp.async) instead of staging 64-wide pieces in registers
        row = cache + blk * s0 + off * s1
        if DV == 1:
            k_lo = _load_operand(row + tl.arange(0, 512)[None, :], v, False, DOT_F32)
            k_hi = k_lo
        else:
            k_lo = _load_operand(row + tl.arange(0, 256)[None, :], v, False, DOT_F32)
            k_hi = _load_operand(row + 256 + tl.arange(0, 256)[None, :], v, False, DOT_F32)
    else:
        sc64 = _row_scales(cache, s0, bs, blk, off, v, FMT, SCALE64)
        k_lo = _key_half(cache, s0, s1, bs, blk, off, v, sc64, 0, FMT, SCALE64, DOT_F32, F16)
        k_hi = _key_half(cache, s0, s1, bs, blk, off, v, sc64, 1, FMT, SCALE64, DOT_F32, F16)
        if DV == 1:
            k_lo = _cat(k_lo, k_hi)
            k_hi = k_lo
    return valid, blk, off, k_lo, k_hi


@triton.jit
def _tile_update(q_lo, q_hi, q_rope, k_lo, k_hi, valid, cache, s0, s1, bs, blk, off, dv,
                 scale2, acc, m_i, l_i, mx, FMT: tl.constexpr, DV: tl.constexpr,
                 D576: tl.constexpr, TRACK_MAX: tl.constexpr, DOT_F32: tl.constexpr,
                 F16: tl.constexpr):
    """One key tile of the flash-attention loop: scores (576-wide rows: the RoPE dims loaded
    here, after the first dots), the running softmax, p·v. Returns (acc, m, l, max)."""
    if DV == 1:
        s = tl.dot(q_lo, tl.trans(k_lo))
    else:
        s = tl.dot(q_lo, tl.trans(k_lo))
        s = tl.dot(q_hi, tl.trans(k_hi), s)
    if D576:
        k_rope = _key_tile(cache, s0, s1, bs, blk, off, valid[:, None], off, 8, FMT, False,
                           DOT_F32, F16)
        s = tl.dot(q_rope, tl.trans(k_rope), s)
    s = tl.where(valid[None, :], s * scale2, float("-inf"))
    p, alpha, m_new, l_i, m_tile = softmax_step(s, m_i, l_i)
    if TRACK_MAX:
        mx = tl.maximum(mx, m_tile)
    p = _dot_operand(p, DOT_F32, F16)
    acc = acc * alpha[:, None]
    if DV == 1:
        acc = tl.dot(p, k_lo, acc)
    elif dv == 0:
        acc = tl.dot(p, k_lo, acc)
    else:
        acc = tl.dot(p, k_hi, acc)
    return acc, m_new, l_i, mx


@triton.jit
def _tile_step(cache, s0, s1, bs, cap, idx, q_lo, q_hi, q_rope, dv, scale2, acc, m_i, l_i,
               mx, FMT: tl.constexpr, DV: tl.constexpr, D576: tl.constexpr,
               TRACK_MAX: tl.constexpr, SCALE64: tl.constexpr, DOT_F32: tl.constexpr,
               F16: tl.constexpr):
    """One tile of the split kernel, in either of its forms: the key rows ``idx`` of the
    tile's cache (``tile_source``) gathered and decoded, and the running softmax / p·v
    updated. Returns (acc, m, l, max). (The loop form picks the source before it loads the
    next tile's ids: picked here, after them, ptxas scheduled the loop differently.)"""
    valid, blk, off, k_lo, k_hi = _tile_keys(cache, s0, s1, bs, cap, idx, FMT, DV, SCALE64,
                                             DOT_F32, F16)
    return _tile_update(q_lo, q_hi, q_rope, k_lo, k_hi, valid, cache, s0, s1, bs, blk, off, dv,
                        scale2, acc, m_i, l_i, mx, FMT, DV, D576, TRACK_MAX, DOT_F32, F16)


@triton.jit
def _split_kernel(
        q_ptr, q_s0, q_s1, H,
        c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0, K0, l0_ptr, l0_div, l0_off, l0_lag,
        c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, K1, l1_ptr, l1_div, l1_off, l1_lag,
        scale2, scale_ptr, part_o, part_ml, n_splits,
        FMT: tl.constexpr, HAS_L0: tl.constexpr, HAS_L1: tl.constexpr,
        HAS_SRC1: tl.constexpr, Q_FP8: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
        D576: tl.constexpr, TRACK_MAX: tl.constexpr, PREFETCH: tl.constexpr,
        DV: tl.constexpr, N_UNITS: tl.constexpr, SCALE64: tl.constexpr,
        SCALE_T: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, F16: tl.constexpr,
        ONE_TILE: tl.constexpr):
    if PDL:     # launched early: wait for the kernel before (it wrote q / lengths / indices);
        grid_wait()     # the combine kernel may then be launched, it waits for this grid
        grid_launch_dependents()
    # axis 0 = (token, head block, output half) with the head block fastest: the programs that
    # gather the same key rows are launched together, so all but the first read them from L2
    unit = tl.program_id(0) % N_UNITS
    t = tl.program_id(0) // N_UNITS
    hb = unit // DV
    dv = unit % DV
    sp = tl.program_id(1)
    NV: tl.constexpr = 512 // DV
    if SCALE_T:   # a device scalar (read at run time: CUDA-graph replays see its new value)
        scale2 = tl.load(scale_ptr).to(tl.float32) * LOG2E_C
    h = hb * HB + tl.arange(0, HB)
    hmask = h < H
    q_row = q_ptr + t.to(tl.int64) * q_s0 + h[:, None] * q_s1
    q_lo, q_hi, q_rope = _load_q_block(q_row, hmask, DV, D576, Q_FP8, DOT_F32, F16)
    acc = tl.zeros((HB, NV), tl.float32)
    m_i = tl.full((HB,), float("-inf"), tl.float32)
    l_i = tl.zeros((HB,), tl.float32)
    mx = tl.full((HB,), float("-inf"), tl.float32)
    # This token's virtual key list: source 0's usable columns padded to BN, then source 1's,
    # cut into n_splits runs of whole tiles. One loop over both sources (the source picked per
    # tile by scalar selects) keeps one copy of the tile code live; two loops spilled.
    n0, n1, n0p, lo, hi = key_run(l0_ptr, l0_div, l0_off, l0_lag, l1_ptr, l1_div, l1_off,
                                  l1_lag, t, K0, K1, sp, n_splits, HAS_L0, HAS_L1, HAS_SRC1,
                                  BN)
    idx = _tile_slots(lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, BN)
    if ONE_TILE:
        # every split is at most one tile (tiny launches), so no loop. In the loop, q's copy
        # into shared memory for the dots is loop-invariant and made before it: its stores
        # wait for q and hold up everything after them, so the lengths, slot ids and rows
        # were requested only once q had arrived. Without the loop the copy is made at the
        # first dot, and q's loads and the gather's are in flight together (sm_90 SASS)
        cache, s0, s1, bs, cap = tile_source(lo < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                             c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap)
        acc, m_i, l_i, mx = _tile_step(cache, s0, s1, bs, cap, idx, q_lo, q_hi, q_rope, dv,
                                       scale2, acc, m_i, l_i, mx, FMT, DV, D576, TRACK_MAX,
                                       SCALE64, DOT_F32, F16)
    else:
        # the next tile's slot ids are loaded one iteration ahead: the gather of a tile waits
        # on its ids, and that load's latency is otherwise paid in full every iteration
        for c in range(lo, hi, BN):
            cache, s0, s1, bs, cap = tile_source(c < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                                 c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap)
            if PREFETCH:
                idx_next = _tile_slots(c + BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0,
                                       i1_s0, BN)
            else:
                idx = _tile_slots(c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, BN)
            acc, m_i, l_i, mx = _tile_step(cache, s0, s1, bs, cap, idx, q_lo, q_hi, q_rope, dv,
                                           scale2, acc, m_i, l_i, mx, FMT, DV, D576, TRACK_MAX,
                                           SCALE64, DOT_F32, F16)
            if PREFETCH:
                idx = idx_next
    # partials: o = acc / l (0 when empty), lse2 = m + log2(l) (-inf when empty), max logit
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    # the block's first partial row as one 64-bit scalar, its rows' offsets from it in 32 bits:
    # 64-bit row products per element made the epilogue longer (H200, one-wave tiny launches
    # 1.02x, docs/PERF.md session 26)
    row0 = (t.to(tl.int64) * H + hb * HB) * n_splits + sp
    hrow = tl.arange(0, HB) * n_splits
    o = acc * inv_l[:, None]
    if part_o.dtype.element_ty == tl.bfloat16:      # or fp32: _partials
        o = to_bf16(o, DOT_F32)     # DOT_F32: interpreted, where the plain cast truncates
    tl.store(part_o + row0 * 512 + (hrow[:, None] * 512 + dv * NV + tl.arange(0, NV)[None, :]),
             o, mask=hmask[:, None])
    first = hmask & ((h * 0 + dv) == 0)   # vector compare (interpreter rejects scalar & vector)
    ml = part_ml + row0 * 2 + hrow * 2
    tl.store(ml, lse2, mask=first)
    if TRACK_MAX:
        tl.store(ml + 1, mx, mask=first)


@triton.jit
def _combine_kernel(part_o, part_ml, n_splits, t0, H, sink_ptr, out_ptr, out_s0, out_s1, lse_ptr,
                    lse_s0, lse_s1, mx_ptr, mx_s0, mx_s1, out_scale, out_scale_ptr,
                    OUT_SCALE_T: tl.constexpr, HAS_SINK: tl.constexpr, HAS_LSE: tl.constexpr,
                    HAS_MAX: tl.constexpr,
                    SPLITS: tl.constexpr, SOFT: tl.constexpr, PDL: tl.constexpr):
    tp = tl.program_id(0)       # partial rows are numbered from the launch's first token t0
    t = t0 + tp
    h = tl.program_id(1)
    # Launched early (programmatic dependent launch), so what the split kernel does not write
    # is read before the wait: the split kernel starts its dependents only after its own wait,
    # so the sink and scale are already final. After the wait the partial rows are loaded
    # first, and as volatile loads, which ptxas keeps in program order among themselves: as
    # plain loads, in some variants it moved them all behind the lse max's first shuffle,
    # which waits for the lse loads, and paid a second round trip (H200, TRTLLM-gen B1 h128:
    # 0.92x; volatile, one-wave launches 0.97-1.09x against plain loads after the max;
    # docs/PERF.md session 26).
    if HAS_SINK:
        sink = tl.load(sink_ptr + h)
    if OUT_SCALE_T:
        out_scale = tl.load(out_scale_ptr).to(tl.float32)
    sp = tl.arange(0, SPLITS)
    ok = sp < n_splits
    d = tl.arange(0, 512)
    row0 = (tp.to(tl.int64) * H + h) * n_splits     # this (token, head)'s first partial row
    if PDL:
        grid_wait()
    o = tl.load(part_o + row0 * 512 + (sp[:, None] * 512 + d[None, :]), mask=ok[:, None], other=0,
                volatile=True)
    ml = part_ml + row0 * 2 + sp * 2
    lse2 = tl.load(ml, mask=ok, other=float("-inf"))
    mxs = tl.load(ml + 1, mask=ok, other=float("-inf"))
    # max() skips NaN: a split whose keys scored NaN (a non-finite key value) would read as
    # empty when the token's other splits are, and the token as having no keys; the
    # reference's output and lse are NaN there
    m = tl.where(tl.sum((lse2 != lse2).to(tl.int32), axis=0) > 0, float("nan"),
                 tl.max(lse2, axis=0))
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    w = tl.exp2(lse2 - m_safe)
    total = tl.sum(w, axis=0)
    if part_o.dtype.element_ty == tl.int16:
        # bf16 partials, read as their bits (``_combine``): the interpreter's bf16 -> fp32
        # cast mangles subnormals; this is exact on both
        o = (o.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    o = tl.sum(o * w[:, None], axis=0) / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, total))) * LN2)
    if HAS_SINK:
        o = o * sink_gate(lse, sink, empty)
    o = tl.where(empty, 0.0, o * out_scale)
    tl.store(out_ptr + t.to(tl.int64) * out_s0 + h * out_s1 + d, to_bf16(o, SOFT))
    if HAS_LSE:
        tl.store(lse_ptr + t.to(tl.int64) * lse_s0 + h * lse_s1, lse)
    if HAS_MAX:
        mx = tl.max(mxs, axis=0)
        tl.store(mx_ptr + t.to(tl.int64) * mx_s0 + h * mx_s1, mx * LN2)


def _launch_gluon(g, grid, q, args0, src0, i0, k0, len0, args1, src1, i1, k1, len1, scale,
                  part_o, part_ml, n_splits, n_units, max_logits, q_fp8, final, sink, out, lse,
                  out_scale, pdl, d576, f16, staged, cluster, t0):
    """``cluster``: the two head blocks of each token run as one 2-CTA cluster (V4 rows
    staged or V3.2 rows, 65-128 heads; its producer gets ``PRODUCER_REGS_CLUSTER``
    registers): the compiled kernel is made cluster-launchable before its first
    launch, and the launch then takes half the grid's x (the launcher multiplies it back)."""
    lse_args = (lse, lse.stride(0), lse.stride(1)) if lse is not None else (part_ml, 0, 0)
    mx_args = ((max_logits, max_logits.stride(0), max_logits.stride(1))
               if max_logits is not None else (part_ml, 0, 0))
    args = (
        q, q.stride(0), q.stride(1), q.shape[1],
        *args0, src0.block_size, src0.capacity, i0, i0.stride(0), k0, *len0,
        *args1, src1.block_size if src1 else 1, src1.capacity if src1 else 0, i1,
        i1.stride(0), k1, *len1,
        *_scalar_arg(scale, LOG2E, part_ml), part_o, part_ml, n_splits, t0,
        out, out.stride(0), out.stride(1), *lse_args, *mx_args,
        sink if sink is not None else part_ml, *_scalar_arg(out_scale, 1.0, part_ml))
    kwargs = g.launch_constexprs(
        FMT_CODES[src0.fmt], has_l0=src0.lengths is not None,
        has_l1=src1 is not None and src1.lengths is not None, has_src1=src1 is not None,
        track_max=max_logits is not None, n_units=n_units,
        scale_t=isinstance(scale, torch.Tensor), q_fp8=q_fp8, final=final,
        has_sink=sink is not None, has_lse=lse is not None,
        out_scale_t=isinstance(out_scale, torch.Tensor), pdl=pdl, d576=d576, f16=f16,
        staged=staged, cluster=cluster)
    kwargs["launch_pdl"] = pdl
    if cluster:
        from sparse_mla.ops.common import gluon_hooks
        return gluon_hooks.launch_clusters(g._ws_kernel, grid, args, kwargs)
    return g._ws_kernel[grid](*args, **kwargs)


def _length_args(src, dummy):
    """(lengths, div, offset, lag) kernel arguments of a source's usable-column count
    (``KeySource.usable``); ``dummy`` stands in for absent lengths (never read)."""
    if src is None or src.lengths is None:
        return dummy, 1, 0, 0
    return src.lengths, src.tokens_per_length, src.length_offset, int(src.causal)


def _scalar_arg(value, factor, dummy):
    """(float, pointer) kernel arguments for a scale given as a float or as a one-element
    device tensor (then the kernel reads it: no host sync, CUDA-graph safe)."""
    if isinstance(value, torch.Tensor):
        return 0.0, value.reshape(-1)
    return float(value) * factor, dummy


def _scales_aligned(src):
    """V4 scale bytes of every row can be read as one int64 (block starts 8-byte aligned)."""
    return src.fmt == "v4" and plan._blocks_aligned(*_source_args(src)[:2])


def _source_args(src):
    """(pointer tensor, stride0, stride1) for a source's cache, strides in its element unit."""
    if src.fmt in ("v4", "v32"):
        fmt = formats.get_format(src.fmt)
        raw = src.cache.view(torch.uint8) if src.cache.dtype != torch.uint8 else src.cache
        return raw, checks.block_stride(src.cache, fmt, src.block_size), 0
    cache = src.cache.view(torch.uint8) if src.fmt == "plain_fp8" else src.cache
    return cache, src.cache.stride(0), src.cache.stride(1)


def run(q, sources, sink, scale, out, lse=None, out_scale=1.0, max_logits=None):
    """Launch the attention of ``q`` over ``sources`` (see ``sparse_attention``) and return
    the ``attention_plan.LaunchPlan`` that ran (None where there was nothing to compute)."""
    T, H = q.shape[0], q.shape[1]
    if T == 0 or H == 0:
        return None
    n_hb = triton.cdiv(H, plan.CONFIG["max_heads"])    # head blocks are max_heads wide past it
    src0 = sources[0]
    src1 = sources[1] if len(sources) > 1 else None
    k0 = src0.indices.shape[1]
    k1 = src1.indices.shape[1] if src1 is not None else 0
    if src1 is not None and src1.fmt != src0.fmt:
        raise ValueError(f"sources must share one cache format, got {src0.fmt} and {src1.fmt}")
    c0, c0s0, c0s1 = _source_args(src0)
    if src1 is not None:
        c1, c1s0, c1s1 = _source_args(src1)
    else:
        c1, c1s0, c1s1 = c0, 0, 0
    blocks = [(c0, c0s0)] + ([(c1, c1s0)] if src1 is not None else [])
    scale64 = src0.fmt == "v4" and all(plan._blocks_aligned(c, s0) for c, s0 in blocks)
    d576 = head_dims(sources) == 576
    launch, cfg, g = plan.plan_launch(q, src0.fmt, blocks, T, n_hb, k0, k1, heads=H)
    staged = launch.staged
    cluster = launch.route == "sm90_cluster"
    bn = cfg["block_n"]
    # enough programs to fill the card; the kernel cuts each token's own key list (lengths
    # applied) into n_splits runs of whole tiles, so at most this many tiles ever exist
    max_tiles = max(1, plan._tiles(k0, k1, bn))
    dvs = cfg["dv"]
    dev = q.device
    q_fp8 = q.dtype == torch.float8_e4m3fn
    # e4m3 keys and q: the dots run on fp16 operands (exact; one conversion per two bytes)
    f16 = src0.fmt == "plain_fp8" and q_fp8 and FP16_FOR_E4M3 and not triton_interpreting()
    i0 = src0.indices
    i1 = src1.indices if src1 is not None else i0
    dummy = i0
    pdl = PDL and pdl_supported(dev)
    if g is not None:
        # the sm_90 kernel decodes an e4m3 q into shared memory itself; one split per token:
        # it finishes the rows itself (no partials, no combine)
        qq = q.view(torch.uint8) if q_fp8 else q
        phases = plan.plan_phases(T, n_hb, max_tiles, plan._sm_count(dev),
                                  cfg["split_overhead"])
        launch.phases = tuple(phases)
        launch.combined = any(n_splits > 1 for _, _, n_splits in phases)
        for t0, t1, n_splits in phases:
            final = n_splits == 1
            part_o, part_ml = _partials(0 if final else (t1 - t0) * H * n_splits, dev,
                                         n_splits)
            launch.kernels.append(_launch_gluon(
                g, ((t1 - t0) * n_hb, n_splits), qq, (c0, c0s0, c0s1), src0, i0, k0,
                _length_args(src0, dummy), (c1, c1s0, c1s1), src1, i1, k1,
                _length_args(src1, dummy), scale, part_o, part_ml, n_splits, n_hb, max_logits,
                q_fp8, final, sink, out, lse, out_scale, pdl, d576, f16, staged, cluster, t0))
            if not final:
                _combine(part_o, part_ml, n_splits, t0, t1, H, sink, out, lse, max_logits,
                         out_scale, pdl, interp=False)
        return launch
    # waves of one program per SM even where two 4-warp programs fit (dv 2): H200 batch 2,
    # h64, s_q 2, window 128 + 512: 10 splits (80 programs) 11.6 µs, 20 (160) 12.8 µs
    n_splits = plan.choose_splits(T * n_hb * dvs, max_tiles, plan._sm_count(dev),
                                  cfg["split_overhead"], cfg["max_splits"])
    hb = plan.head_block(H, cfg["tiny"], dev, src0.fmt)
    part_o, part_ml = _partials(T * H * n_splits, dev, n_splits)
    if q_fp8 and cfg["dv"] == 1:
        # exact (e4m3 ⊂ bf16). Decoded in the kernel, Triton keeps a computed q as a register
        # wgmma operand for the whole key loop (64 registers: the fp8 path spilled and ran
        # 30 % slower than bf16); one elementwise pass here keeps q in shared memory. Tiny
        # launches (one or two tiles per program) decode in the kernel: the extra launch
        # would cost them more (H200 batch 1: 15.8 vs 11.8 µs).
        q, q_fp8 = q.to(torch.float16 if f16 else torch.bfloat16), False
    qq = q.view(torch.uint8) if q_fp8 else q
    interp = triton_interpreting()
    launch.phases = ((0, T, n_splits), )
    launch.combined = True
    launch.kernels.append(_split_kernel[(T * n_hb * dvs, n_splits)](
        qq, q.stride(0), q.stride(1), H,
        c0, c0s0, c0s1, src0.block_size, src0.capacity, i0, i0.stride(0), k0,
        *_length_args(src0, dummy),
        c1, c1s0, c1s1, src1.block_size if src1 else 1, src1.capacity if src1 else 0, i1,
        i1.stride(0), k1, *_length_args(src1, dummy),
        *_scalar_arg(scale, LOG2E, part_ml), part_o, part_ml, n_splits,
        FMT=FMT_CODES[src0.fmt],
        HAS_L0=src0.lengths is not None,
        HAS_L1=src1 is not None and src1.lengths is not None, HAS_SRC1=src1 is not None,
        Q_FP8=q_fp8, HB=hb, BN=bn, D576=d576,
        TRACK_MAX=max_logits is not None, PREFETCH=cfg["prefetch"], DV=dvs,
        N_UNITS=n_hb * dvs, SCALE64=scale64,
        SCALE_T=isinstance(scale, torch.Tensor), DOT_F32=interp, PDL=pdl, F16=f16,
        ONE_TILE=plan.one_tile(max_tiles, n_splits),
        num_warps=cfg["num_warps"] // dvs,
        num_stages=cfg["num_stages_v32"] if src0.fmt == "v32" else cfg["num_stages"],
        launch_pdl=pdl))
    _combine(part_o, part_ml, n_splits, 0, T, H, sink, out, lse, max_logits, out_scale, pdl,
             interp)
    return launch


# Split partials (each split's normalized output rows) in bf16, their (lse2, max) pairs in
# fp32: half the bytes between the split kernels and the combine. H100 (docs/PERF.md session
# 18): whole op 1.04-1.19x at batch 2 and b64, 0.996-1.007x at b74 / b148 h128. Each partial
# is rounded once more than FlashMLA's fp32 ones (2^-9 relative per term of a convex
# combination, within SPEC §9's rel 2/128; the error against the reference did not change).
# A launch of one split (the portable kernel, whose combine then only applies the sink and
# output scale) keeps fp32, so its rows are rounded once, as the sm_90 kernel's own epilogue
# rounds them. torch.float32 restores fp32 everywhere (both kernels take either).
PARTIAL_DTYPE = torch.bfloat16


def _partials(n_rows, dev, n_splits):
    """Partial outputs ([n_rows, 512]; ``PARTIAL_DTYPE`` where a token has several splits,
    else fp32) and fp32 (lse2, max) pairs for ``n_rows`` rows."""
    dtype = PARTIAL_DTYPE if n_splits > 1 else torch.float32
    return (torch.empty(max(1, n_rows * 512), dtype=dtype, device=dev),
            torch.empty(max(1, n_rows * 2), dtype=torch.float32, device=dev))


def _combine(part_o, part_ml, n_splits, t0, t1, H, sink, out, lse, max_logits, out_scale, pdl,
             interp):
    """Merge the splits of tokens [t0, t1) (partial rows numbered from t0) into out / lse /
    max logits."""
    if part_o.dtype == torch.bfloat16:     # read as their bits (see the kernel)
        part_o = part_o.view(torch.int16)
    # 2-byte partials: two warps span a row's 512 dims in 16-byte loads, so all splits of a
    # column sit in one thread; with four, the splits were summed across warps through shared
    # memory and the combine ran up to 4x slower (b64 s_q1 h64: 21.4 against 4.6 µs, H100)
    grid = (t1 - t0, H)
    args = (
        part_o, part_ml, n_splits, t0, H, sink if sink is not None else part_ml, out,
        out.stride(0), out.stride(1), lse if lse is not None else part_ml,
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        max_logits if max_logits is not None else part_ml,
        max_logits.stride(0) if max_logits is not None else 0,
        max_logits.stride(1) if max_logits is not None else 0,
        *_scalar_arg(out_scale, 1.0, part_ml))
    kwargs = dict(
        OUT_SCALE_T=isinstance(out_scale, torch.Tensor),
        HAS_SINK=sink is not None, HAS_LSE=lse is not None, HAS_MAX=max_logits is not None,
        SPLITS=triton.next_power_of_2(n_splits), SOFT=interp, PDL=pdl,
        num_warps=4 if part_o.element_size() == 4 else 2,
        launch_pdl=pdl)
    cap = combine_residency(grid[0] * grid[1], plan._sm_count(part_o.device), pdl)
    if cap is None:
        _combine_kernel[grid](*args, **kwargs)
    else:
        launch_capped(_combine_kernel, grid, args, kwargs, cap)


# Launched early (PDL), the combine's CTAs all land on the SMs the split launch leaves free,
# as many as fit, and only those SMs merge the partials: H200 batch 2, s_q 2, h128 (72 split
# programs, 512 combine CTAs): 60 SMs, up to 9 CTAs each, 2.67 µs from release to the last
# CTA. Capped at ceil(CTAs / SMs) per SM, the rest start on the split's SMs as they empty:
# 128 SMs, at most 4 each, 1.8 µs; the call 13.96 -> 13.04 µs (docs/PERF.md session 28).
# Large combines (b64 s_q1 h64: 4,096 CTAs) lost 8 % under a cap of 4, so only small ones
# are capped: ``COMBINE_SPREAD`` CTAs per SM at most (None: never).
COMBINE_SPREAD = 8


def combine_residency(ctas, sms, pdl):
    """The per-SM cap on a combine launch of ``ctas`` CTAs (None: uncapped): launched early
    (``pdl``) and small enough to spread ceil(ctas / sms) to an SM within ``COMBINE_SPREAD``."""
    if not pdl or COMBINE_SPREAD is None:
        return None
    per_sm = triton.cdiv(ctas, sms)
    return per_sm if per_sm <= COMBINE_SPREAD else None
