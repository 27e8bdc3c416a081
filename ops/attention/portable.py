"""The portable Triton kernels of the attention core: the split kernel and the combine kernel,
with the jit helpers the sm_90 Gluon kernel shares (``key_run``, ``slot_row``,
``tile_source``, ``softmax_step``, ``sink_gate``). ``launch`` launches them (its docstring has
the design, ``plan`` the route choice).

Split kernel: grid (tokens × head blocks × output halves, splits); each program walks its run
of the token's virtual key list (source 0's usable columns padded to BLOCK_N, then source
1's; without a loop where runs are at most one tile, ``ONE_TILE``), gathers and dequantizes
BLOCK_N key rows one 64-wide tile at a time, joins them into one bf16 operand for q·k and p·v
(K = V), and keeps a flash-attention running max / sum / accumulator in the log2 domain. The
combine kernel merges the splits, applies the sink and writes out / lse / max logits.

Under Triton's CPU interpreter ``tl.dot`` on bf16 operands is wrong (triton#11584), so
interpreted launches feed the dots fp32 operands (``DOT_F32``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from sparse_mla.ops.attention import records
from sparse_mla.ops.attention.fmt_codes import (PLAIN_BF16, PLAIN_FP8, SAME_AS_FMT, V4, V32, V41,
                                                V41_FP4, V41_FP4_INLINE, V41_INLINE)
from sparse_mla.ops.common.triton_utils import (e2m1_value, e4m3_decode, grid_launch_dependents,
                                                grid_wait, to_bf16, ue8m0_scale,
                                                v41_record_addrs)

LN2 = tl.constexpr(0.6931471805599453)      # used inside kernels: must be a constexpr
LOG2E_C = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_values(ptrs, mask, FP8: tl.constexpr, SOFT: tl.constexpr = False):
    """bf16 values, or e4m3 bytes decoded (in software where ``SOFT``), at ``ptrs`` as fp32
    (zeros where masked)."""
    x = tl.load(ptrs, mask=mask, other=0)
    if FP8:
        x = e4m3_decode(x, SOFT)
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
                  F16: tl.constexpr = False, SOFT: tl.constexpr = False):
    """bf16 / fp16 values, or e4m3 bytes decoded, at ``ptrs`` straight into a dot operand (no
    fp32 copy: a [64, 512] fp32 q staged on its way to bf16 is what made the fp8 path spill).
    ``F16``: the operand is fp16 (e4m3 is exact in it, and converts to it in one instruction
    per two bytes: three to bf16). ``SOFT``: e4m3 decoded in software, to fp32 (exact in
    either operand type)."""
    x = tl.load(ptrs, mask=mask, other=0)
    if FP8:
        x = e4m3_decode(x, SOFT)
    return _dot_operand(x.to(tl.float32) if DOT_F32 else x, DOT_F32, F16)


@triton.jit
def _row_scales(cache_ptr, s0, BS, blk, off, v, FMT: tl.constexpr, SCALE64: tl.constexpr):
    """V4 with 8-byte-aligned blocks: each row's eight UE8M0 scale bytes as one int64 [BN, 1].
    One 8-byte load per row replaces seven 1-byte loads per tile, and Triton's pipeliner can
    stage it asynchronously (it cannot stage 1-byte loads: they stalled every iteration)."""
    if FMT == V4 and SCALE64:
        ptr = (cache_ptr + blk * s0 + BS * 576 + off * 8).to(tl.pointer_type(tl.int64))
        sc = tl.load(ptr, mask=v, other=0)
    else:
        sc = tl.zeros_like(off)      # unused
    return sc


@triton.jit
def _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, TILE: tl.constexpr, FMT: tl.constexpr,
              SCALE64: tl.constexpr, DOT_F32: tl.constexpr, F16: tl.constexpr = False,
              SOFT: tl.constexpr = False):
    """Dims [64·TILE, 64·TILE + 64) of key rows (blk, off) as a [BN, 64] dot operand; rows
    with ``v`` False are zeros. TILE 8 is the 64-dim RoPE tail of 576-wide rows. V4: e4m3 × 2^k
    is exact in bf16 (one UE8M0 scale per row and tile), dims 448..511 are the bf16 RoPE part;
    V3.2 rounds the fp32 product to bf16 as the reference does. Working one 64-wide tile at a
    time keeps the dequantization temporaries small: a whole [BN, 512] fp32 tile next to the
    [64, 512] accumulator is what made the first version spill."""
    c = tl.arange(0, 64)[None, :]
    if FMT == V4:
        base = cache_ptr + blk * s0
        if TILE < 7:
            x = _load_values(base + off * 576 + TILE * 64 + c, v, True, SOFT)
            if SCALE64:
                sb = ((sc64 >> (8 * TILE)) & 0xFF).to(tl.int32)
            else:
                sb = tl.load(base + BS * 576 + off * 8 + TILE, mask=v, other=127).to(tl.int32)
            k = _dot_operand(x * ue8m0_scale(sb), DOT_F32)
        else:
            k = _load_operand((base + off * 576 + 448).to(tl.pointer_type(tl.bfloat16)) + c, v,
                              False, DOT_F32)
    elif FMT == V32:
        rec = cache_ptr + blk * s0 + off * 656
        if TILE < 8:
            x = _load_values(rec + TILE * 64 + c, v, True, SOFT)
            sc = tl.load((rec + 512).to(tl.pointer_type(tl.float32)) + TILE // 2, mask=v,
                         other=0.0)
            k = _dot_operand(to_bf16(x * sc, DOT_F32).to(tl.float32), DOT_F32)
        else:
            k = _load_operand((rec + 528).to(tl.pointer_type(tl.bfloat16)) + c, v, False,
                              DOT_F32)
    elif FMT == V41 or FMT == V41_INLINE:
        # V4.1 528 B: 512 e4m3 dims, then per row 16 UE8M0 scales of 32 dims (two per tile)
        # in the block's tail (5) or right after the row's data (9, token-inline); e4m3 × 2^k
        # is exact in bf16
        data, scales = v41_record_addrs(cache_ptr + blk * s0, off, BS, 512, 16, FMT == V41_INLINE)
        x = _load_values(data + TILE * 64 + c, v, True, SOFT)
        sb = tl.load(scales + TILE * 2 + c // 32, mask=v, other=127).to(tl.int32)
        k = _dot_operand(x * ue8m0_scale(sb), DOT_F32)
    elif FMT == V41_FP4 or FMT == V41_FP4_INLINE:
        # V4.1 288 B: e2m1 pairs (the even dim in the low nibble), then per row 32 e4m3
        # scales of 16 dims in the block's tail (6) or after the row's data (10, token-inline);
        # e2m1 × e4m3 is exact in bf16
        # (the tile's 32 bytes loaded once and their nibbles interleaved: a load of each
        # byte per dim took three times the shared memory, more than sm_86 / sm_89 allow)
        data, scales = v41_record_addrs(cache_ptr + blk * s0, off, BS, 256, 32,
                                        FMT == V41_FP4_INLINE)
        j = tl.arange(0, 32)[None, :]
        b = tl.load(data + TILE * 32 + j, mask=v, other=0).to(tl.int32)
        sc = _load_values(scales + TILE * 4 + j // 8, v, True, SOFT)
        k = _dot_operand(tl.interleave(e2m1_value(b & 0xF) * sc, e2m1_value(b >> 4) * sc),
                         DOT_F32)
    else:
        k = _load_operand(cache_ptr + blk * s0 + off * s1 + TILE * 64 + c, v, FMT == PLAIN_FP8,
                          DOT_F32, F16, SOFT)
    return k


@triton.jit
def _cat(a, b):
    j = tl.join(a, b)
    j = tl.permute(j, (0, 2, 1))
    return tl.reshape(j, (j.shape[0], 2 * a.shape[1]))


@triton.jit
def _key_half(cache_ptr, s0, s1, BS, blk, off, v, sc64, HALF: tl.constexpr, FMT: tl.constexpr,
              SCALE64: tl.constexpr, DOT_F32: tl.constexpr, F16: tl.constexpr,
              SOFT: tl.constexpr):
    """Dims [256·HALF, 256·HALF + 256) of the key rows: four ``_key_tile``s joined."""
    T0: tl.constexpr = 4 * HALF
    a = _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, T0, FMT, SCALE64, DOT_F32, F16,
                  SOFT)
    b = _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, T0 + 1, FMT, SCALE64, DOT_F32, F16,
                  SOFT)
    c = _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, T0 + 2, FMT, SCALE64, DOT_F32, F16,
                  SOFT)
    d = _key_tile(cache_ptr, s0, s1, BS, blk, off, v, sc64, T0 + 3, FMT, SCALE64, DOT_F32, F16,
                  SOFT)
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
            DOT_F32: tl.constexpr, F16: tl.constexpr, SOFT: tl.constexpr):
    """Dims [COL0, COL0 + NC) of the head block's q rows as a dot operand."""
    return _load_operand(q_row + COL0 + tl.arange(0, NC)[None, :], hmask[:, None], Q_FP8,
                         DOT_F32, F16, SOFT)


@triton.jit
def _load_q_block(q_row, hmask, DV: tl.constexpr, D576: tl.constexpr, Q_FP8: tl.constexpr,
                  DOT_F32: tl.constexpr, F16: tl.constexpr, SOFT: tl.constexpr):
    """The head block's q as dot operands: the two 256-dim halves (the same full 512 dims
    twice where ``DV`` is 1) and the RoPE tail of 576-wide rows (else a placeholder)."""
    if DV == 1:
        q_lo = _load_q(q_row, hmask, 0, 512, Q_FP8, DOT_F32, F16, SOFT)
        q_hi = q_lo
    else:
        q_lo = _load_q(q_row, hmask, 0, 256, Q_FP8, DOT_F32, F16, SOFT)
        q_hi = _load_q(q_row, hmask, 256, 256, Q_FP8, DOT_F32, F16, SOFT)
    if D576:
        q_rope = _load_q(q_row, hmask, 512, 64, Q_FP8, DOT_F32, F16, SOFT)
    else:
        q_rope = q_lo
    return q_lo, q_hi, q_rope


@triton.jit
def _tile_keys(cache, s0, s1, bs, cap, idx, FMT: tl.constexpr, DV: tl.constexpr,
               SCALE64: tl.constexpr, DOT_F32: tl.constexpr, F16: tl.constexpr,
               SOFT: tl.constexpr):
    """Gather and decode the key rows ``idx`` (slot ids; unusable where < 0 or >= ``cap``) of
    one cache: (valid [BN], block and in-block row [BN, 1], dims [0, 256) and [256, 512) as dot
    operands, or where ``DV`` is 1 the whole rows twice)."""
    valid = (idx >= 0) & (idx < cap)
    v = valid[:, None]
    blk = (idx // bs).to(tl.int64)[:, None]
    off = (idx % bs).to(tl.int64)[:, None]
    if FMT == PLAIN_BF16:
        # plain bf16 rows need no decoding: loaded whole, Triton copies them straight into
        # shared memory (cp.async) instead of staging 64-wide pieces in registers.
        # (PLAIN_BF16_TILED: the same rows in 64-wide pieces, for GPUs below sm_90, whose
        # shared memory cannot hold two stages of whole rows: Policy.low_shared.)
        row = cache + blk * s0 + off * s1
        if DV == 1:
            k_lo = _load_operand(row + tl.arange(0, 512)[None, :], v, False, DOT_F32)
            k_hi = k_lo
        else:
            k_lo = _load_operand(row + tl.arange(0, 256)[None, :], v, False, DOT_F32)
            k_hi = _load_operand(row + 256 + tl.arange(0, 256)[None, :], v, False, DOT_F32)
    else:
        sc64 = _row_scales(cache, s0, bs, blk, off, v, FMT, SCALE64)
        k_lo = _key_half(cache, s0, s1, bs, blk, off, v, sc64, 0, FMT, SCALE64, DOT_F32, F16,
                         SOFT)
        k_hi = _key_half(cache, s0, s1, bs, blk, off, v, sc64, 1, FMT, SCALE64, DOT_F32, F16,
                         SOFT)
        if DV == 1:
            k_lo = _cat(k_lo, k_hi)
            k_hi = k_lo
    return valid, blk, off, k_lo, k_hi


@triton.jit
def _tile_update(q_lo, q_hi, q_rope, k_lo, k_hi, valid, cache, s0, s1, bs, blk, off, dv,
                 scale2, acc, m_i, l_i, mx, FMT: tl.constexpr, DV: tl.constexpr,
                 D576: tl.constexpr, TRACK_MAX: tl.constexpr, DOT_F32: tl.constexpr,
                 F16: tl.constexpr, SOFT: tl.constexpr):
    """One key tile of the flash-attention loop: scores (576-wide rows: the RoPE dims loaded
    here, after the first dots), the running softmax, p·v. Returns (acc, m, l, max)."""
    if DV == 1:
        s = tl.dot(q_lo, tl.trans(k_lo))
    else:
        s = tl.dot(q_lo, tl.trans(k_lo))
        s = tl.dot(q_hi, tl.trans(k_hi), s)
    if D576:
        k_rope = _key_tile(cache, s0, s1, bs, blk, off, valid[:, None], off, 8, FMT, False,
                           DOT_F32, F16, SOFT)
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
               F16: tl.constexpr, SOFT: tl.constexpr):
    """One tile of the split kernel, in either of its forms: the key rows ``idx`` of the
    tile's cache (``tile_source``) gathered and decoded, and the running softmax / p·v
    updated. Returns (acc, m, l, max). (The loop form picks the source before it loads the
    next tile's ids: picked here, after them, ptxas scheduled the loop differently.)"""
    valid, blk, off, k_lo, k_hi = _tile_keys(cache, s0, s1, bs, cap, idx, FMT, DV, SCALE64,
                                             DOT_F32, F16, SOFT)
    return _tile_update(q_lo, q_hi, q_rope, k_lo, k_hi, valid, cache, s0, s1, bs, blk, off, dv,
                        scale2, acc, m_i, l_i, mx, FMT, DV, D576, TRACK_MAX, DOT_F32, F16, SOFT)


@triton.jit
def _mixed_step(first, cache, s0, s1, bs, cap, idx, q_lo, q_hi, q_rope, dv, scale2, acc, m_i,
                l_i, mx, FMT: tl.constexpr, FMT1: tl.constexpr, DV: tl.constexpr,
                D576: tl.constexpr, TRACK_MAX: tl.constexpr, SCALE64: tl.constexpr,
                DOT_F32: tl.constexpr, F16: tl.constexpr, SOFT: tl.constexpr):
    """``_tile_step`` where the two sources hold different records (``FMT1``: source 1's, e.g.
    a V4.1 layer's 528 B SWA rows and 288 B compressed rows; 512-wide rows, no ``D576``): the
    tile's rows are decoded as both records with the other source's rows masked off (masked
    loads read nothing; a masked row decodes to zeros), and the sum feeds one set of dots.
    Branching on the source instead kept both branches' key tiles in shared memory at once:
    more than an sm_86 / sm_89 / sm_120 block may use."""
    none = tl.full(idx.shape, -1, idx.dtype)
    va, blk, off, a_lo, a_hi = _tile_keys(cache, s0, s1, bs, cap, tl.where(first, idx, none),
                                          FMT, DV, SCALE64, DOT_F32, F16, SOFT)
    vb, blk, off, b_lo, b_hi = _tile_keys(cache, s0, s1, bs, cap, tl.where(first, none, idx),
                                          FMT1, DV, False, DOT_F32, F16, SOFT)
    return _tile_update(q_lo, q_hi, q_rope, a_lo + b_lo, a_hi + b_hi, va | vb, cache, s0, s1,
                        bs, blk, off, dv, scale2, acc, m_i, l_i, mx, FMT, DV, D576, TRACK_MAX,
                        DOT_F32, F16, SOFT)


@records.takes_records
@triton.jit
def _split_kernel(
        q, src0, src1, scale, part, n_splits,
        FMT: tl.constexpr, HAS_L0: tl.constexpr, HAS_L1: tl.constexpr,
        HAS_SRC1: tl.constexpr, Q_FP8: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
        D576: tl.constexpr, TRACK_MAX: tl.constexpr, PREFETCH: tl.constexpr,
        DV: tl.constexpr, N_UNITS: tl.constexpr, SCALE64: tl.constexpr,
        SCALE_T: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, F16: tl.constexpr,
        ONE_TILE: tl.constexpr, SOFT: tl.constexpr = False, FMT1: tl.constexpr = -1):
    # the records (ops/attention/records.py: RECORDS names their fields)
    q_ptr, q_s0, q_s1, H = q
    c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0, K0, l0_ptr, l0_div, l0_off, l0_lag = src0
    c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, K1, l1_ptr, l1_div, l1_off, l1_lag = src1
    scale2, scale_ptr = scale
    part_o, part_ml = part
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
    q_lo, q_hi, q_rope = _load_q_block(q_row, hmask, DV, D576, Q_FP8, DOT_F32, F16, SOFT)
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
        if FMT1 == SAME_AS_FMT:
            acc, m_i, l_i, mx = _tile_step(cache, s0, s1, bs, cap, idx, q_lo, q_hi, q_rope, dv,
                                           scale2, acc, m_i, l_i, mx, FMT, DV, D576, TRACK_MAX,
                                           SCALE64, DOT_F32, F16, SOFT)
        else:
            acc, m_i, l_i, mx = _mixed_step(lo < n0p, cache, s0, s1, bs, cap, idx, q_lo, q_hi,
                                            q_rope, dv, scale2, acc, m_i, l_i, mx, FMT, FMT1,
                                            DV, D576, TRACK_MAX, SCALE64, DOT_F32, F16, SOFT)
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
            if FMT1 == SAME_AS_FMT:
                acc, m_i, l_i, mx = _tile_step(cache, s0, s1, bs, cap, idx, q_lo, q_hi, q_rope,
                                               dv, scale2, acc, m_i, l_i, mx, FMT, DV, D576,
                                               TRACK_MAX, SCALE64, DOT_F32, F16, SOFT)
            else:
                acc, m_i, l_i, mx = _mixed_step(c < n0p, cache, s0, s1, bs, cap, idx, q_lo, q_hi,
                                                q_rope, dv, scale2, acc, m_i, l_i, mx, FMT, FMT1,
                                                DV, D576, TRACK_MAX, SCALE64, DOT_F32, F16, SOFT)
            if PREFETCH:
                idx = idx_next
    # partials: o = acc / l (0 when empty), lse2 = m + log2(l) (-inf when empty), max logit
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    # the block's first partial row as one 64-bit scalar, its rows' offsets from it in 32 bits:
    # 64-bit row products per element made the epilogue longer (lab/perf-log.md, "Batch-2 time
    # and the combine")
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
    # which waits for the lse loads, and paid a second round trip (lab/perf-log.md, "Batch-2
    # time and the combine").
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
