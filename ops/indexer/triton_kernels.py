"""Triton kernels of the indexer family. Their launchers are in triton_impl.py.

The scores kernels do not write fp32 logits: they write each (token, entry) pair's *selection
key*, an int64 whose order is the top-k order of docs/semantics.md §11.4 (larger score first,
equal scores by lower id), so one ``torch.topk`` over int64 selects exactly and
deterministically, with no tie left to the sort:
* high 32 bits: the fp32 score's bits mapped to a signed integer of the same order
  (-0.0 taken as +0.0, so the sign of a zero sum cannot decide a tie);
* low 32 bits: ``2^32 - 1 - id``, so among equal scores the lower id is larger;
* ``NOT_A_CANDIDATE`` (int64 min) for entries the token may not select.

Dot products run on bf16 operands with fp32 accumulation: bf16 and e4m3 values are exact in
bf16, so only the accumulation order differs from the float64 reference. An fp8 key's scale (a
positive power of two) is applied after the head sum: relu(s * x) = s * relu(x).

Reads are masked to the entries a program may select, so unwritten (NaN-poisoned) cache rows
and rows of negative or out-of-range blocks are never read.
"""
from __future__ import annotations

import triton
import triton.language as tl

from sparse_mla.ops.common.triton_utils import e4m3_decode, e4m3_sat, exp2_int, to_bf16
from sparse_mla.ops.indexer import format as fmt
from sparse_mla.ops.indexer.triton_select import MIN_KEY, NOT_A_CANDIDATE

__all__ = ["NOT_A_CANDIDATE"]       # re-exported: the launchers and tests name it here
D = tl.constexpr(fmt.DIM)


@triton.jit
def _operand(x, FP8: tl.constexpr, SOFT: tl.constexpr, DOT_F32: tl.constexpr):
    """A dot operand: e4m3 bytes decoded (exact in bf16), or the bf16 values; as fp32 where
    ``DOT_F32`` (the interpreter's bf16 dot is wrong; the values are the same)."""
    if FP8:
        y = e4m3_decode(x, SOFT).to(tl.float32)
    else:
        y = x.to(tl.float32)
    if DOT_F32:
        return y
    else:
        return y.to(tl.bfloat16)


@triton.jit
def _keys(score, j, cand):
    """Selection keys (module docstring) of fp32 ``score`` [..., BN] at ids ``j``."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits >= 0, bits, -1 - (bits & 0x7FFFFFFF))
    key = (ordered << 32) | (0xFFFFFFFF - j.to(tl.int64))
    return tl.where(cand, key, MIN_KEY)


@triton.jit
def _request_scores(q_ptr, q_s0, q_s1, w_ptr, w_s0, k_ptr, k_s0, ks_ptr, cu_k_ptr, r, t64, rows,
                    j, H, BT: tl.constexpr, BN: tl.constexpr, QFP8: tl.constexpr,
                    KFP8: tl.constexpr, SOFT: tl.constexpr, DOT_F32: tl.constexpr):
    """Scores [BT, BN] of token rows ``t64`` (those in ``rows``; others 0) against request
    ``r``'s entries ``j`` (dense key rows cu_k[r] + j; 0 past its last)."""
    d = tl.arange(0, D)
    k0 = tl.load(cu_k_ptr + r).to(tl.int64)
    k1 = tl.load(cu_k_ptr + r + 1).to(tl.int64)
    kmask = j < k1 - k0
    kt = tl.load(k_ptr + (k0 + j)[None, :] * k_s0 + d[:, None], mask=kmask[None, :], other=0)
    kt = _operand(kt, KFP8, SOFT, DOT_F32)
    s = tl.zeros((BT, BN), tl.float32)
    for h in range(H):
        qh = tl.load(q_ptr + t64[:, None] * q_s0 + h * q_s1 + d[None, :], mask=rows[:, None],
                     other=0)
        dot = tl.dot(_operand(qh, QFP8, SOFT, DOT_F32), kt)
        wh = tl.load(w_ptr + t64 * w_s0 + h, mask=rows, other=0.0).to(tl.float32)
        s += wh[:, None] * tl.maximum(dot, 0.0)
    if KFP8:
        s = s * tl.load(ks_ptr + k0 + j, mask=kmask, other=0.0)[None, :]
    return s


@triton.jit
def _token_candidates(t, live, cu_q_ptr, cu_k_ptr, pos_ptr, ratio, n_req, steps):
    """(request, candidates) of token rows ``t``: the request r with cu_q[r] <= t < cu_q[r+1]
    (bisection over cu_q in ``steps`` >= log2(n_req + 2) halvings) and min(C_r, (p + 1) //
    ratio) at its position p; (-1, 0) for rows outside every request or not ``live``."""
    lo = tl.zeros_like(t)
    hi = lo + n_req + 1
    for _ in range(steps):          # lo <- how many of cu_q[0..n_req] are <= t
        go = live & (lo < hi)
        mid = (lo + hi) // 2
        below = tl.load(cu_q_ptr + mid, mask=go, other=0) <= t
        lo = tl.where(go & below, mid + 1, lo)
        hi = tl.where(go & ~below, mid, hi)
    req = lo - 1
    inside = live & (req >= 0) & (req < n_req) & (t < tl.load(cu_q_ptr + n_req))
    r = tl.where(inside, req, 0)
    c = tl.load(cu_k_ptr + r + 1, mask=inside, other=0).to(tl.int64) - \
        tl.load(cu_k_ptr + r, mask=inside, other=0).to(tl.int64)
    p1 = tl.load(pos_ptr + t, mask=inside, other=0).to(tl.int64) + 1
    nc = tl.minimum(c, tl.where(p1 > 0, p1 // ratio, 0))
    return tl.where(inside, req, -1), tl.where(inside, nc, 0).to(tl.int32)


@triton.jit
def prefill_keys_kernel(q_ptr, q_s0, q_s1, w_ptr, w_s0, k_ptr, k_s0, ks_ptr, cu_q_ptr, cu_k_ptr,
                        pos_ptr, key_ptr, key_s0, lim_ptr, start, n_rows, n_req, steps, ratio,
                        H, width, BT: tl.constexpr, BN: tl.constexpr, QFP8: tl.constexpr,
                        KFP8: tl.constexpr, SOFT: tl.constexpr, DOT_F32: tl.constexpr):
    """Keys of rows [pid0*BT, +BT) x ids [pid1*BN, +BN) of a chunk: row i is token start + i,
    of request req (found from cu_q) and may select ids < nc (``_token_candidates``, written
    to ``lim[i]`` by pid1 0); request r's keys are rows cu_k[r].. of ``k``. A tile whose rows
    span several requests computes each request's dot in turn (rare: at request edges)."""
    i = tl.program_id(0) * BT + tl.arange(0, BT)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    live = i < n_rows
    t = start + i
    req, nc = _token_candidates(t, live, cu_q_ptr, cu_k_ptr, pos_ptr, ratio, n_req, steps)
    if tl.program_id(1) == 0:
        tl.store(lim_ptr + i, nc, mask=live)
    t64 = t.to(tl.int64)
    score = tl.zeros((BT, BN), tl.float32)
    if tl.program_id(1) * BN < tl.max(nc, axis=0):
        r_lo = tl.min(tl.where(live & (nc > 0), req, 2147483647), axis=0)
        r_hi = tl.max(tl.where(nc > 0, req, -1), axis=0)
        if r_lo == r_hi:        # the usual tile: one request, one accumulator
            score = _request_scores(q_ptr, q_s0, q_s1, w_ptr, w_s0, k_ptr, k_s0, ks_ptr,
                                    cu_k_ptr, r_lo, t64, live, j, H, BT, BN, QFP8, KFP8, SOFT,
                                    DOT_F32)
        else:                   # rows of several requests: each request's keys in turn
            for r in range(r_lo, r_hi + 1):
                s_r = _request_scores(q_ptr, q_s0, q_s1, w_ptr, w_s0, k_ptr, k_s0, ks_ptr,
                                      cu_k_ptr, r, t64, live & (req == r), j, H, BT, BN, QFP8,
                                      KFP8, SOFT, DOT_F32)
                score = tl.where((req == r)[:, None], s_r, score)
    key = _keys(score, j[None, :], j[None, :] < nc[:, None])
    tl.store(key_ptr + i.to(tl.int64)[:, None] * key_s0 + j[None, :], key,
             mask=live[:, None] & (j < width)[None, :])


@triton.jit
def _tile_scores(q, w, kt, HEADS_N: tl.constexpr, NT: tl.constexpr, HP: tl.constexpr):
    """Scores [BN, NT] of one tile of keys for NT tokens of HP heads each: q [NT * HP, 128]
    (token-major), w [NT * HP] their weights, kt the keys as ``_operand``s ([BN, 128] with
    ``HEADS_N``, else [128, BN]). Every token's heads go through one dot, so a key tile is
    read once for all of a request's tokens."""
    if HEADS_N:
        dot = tl.dot(kt, tl.trans(q))                                   # [BN, NT * HP]
        part = tl.maximum(dot, 0.0) * w[None, :]
        return tl.sum(tl.reshape(part, (dot.shape[0], NT, HP)), axis=2)
    else:
        dot = tl.dot(q, kt)                                             # [NT * HP, BN]
        part = tl.maximum(dot, 0.0) * w[:, None]
        return tl.trans(tl.sum(tl.reshape(part, (NT, HP, dot.shape[1])), axis=1))


@triton.jit
def decode_keys_kernel(q_ptr, q_s0, q_s1, w_ptr, w_s0, cache_ptr, c_s0, c_s1, num_blocks,
                         bt_ptr, bt_s0, bt_cols, seq_ptr, key_ptr, key_s0, lim_ptr, H, width,
                         ratio, BS, NEXT_N: tl.constexpr, NT: tl.constexpr, HP: tl.constexpr,
                         BN: tl.constexpr, TILES: tl.constexpr, HEADS_N: tl.constexpr,
                         QFP8: tl.constexpr, KFP8: tl.constexpr, SOFT: tl.constexpr,
                         DOT_F32: tl.constexpr):
    """Keys of request pid0's tokens [pid2 * NT, +NT) (of its NEXT_N) x ids [pid1 * TILES * BN,
    +TILES * BN) over the paged cache, BN at a time. Token i sits at position seq - NEXT_N + i
    and may select ids < (position + 1) // ratio whose block is in [0, num_blocks). The NT
    tokens' q is loaded once per program and all of them go through one dot per tile
    (``_tile_scores``): a key tile is read once per NT tokens (a long MTP draft is split into
    groups of NT so that NT x HP stays within the registers). pid1 0 writes each token's
    candidate bound min(width, (position + 1) // ratio) to ``lim``."""
    b = tl.program_id(0)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    if NT >= NEXT_N:    # one group: no offset (a run-time one cost sm_90 ~240 B of spills)
        t0 = 0
    else:
        t0 = tl.program_id(2) * NT
    it = t0 + tl.arange(0, NT)
    pos1 = seq - NEXT_N + it + 1
    nc = tl.where(pos1 > 0, pos1 // ratio, 0)                          # [NT]
    tok = (b * NEXT_N + it).to(tl.int64)
    live_t = it < NEXT_N
    if tl.program_id(1) == 0:
        tl.store(lim_ptr + tok, tl.minimum(nc, width).to(tl.int32), mask=live_t)
    last = tl.where(seq > 0, seq // ratio, 0)         # what the last token may select
    d = tl.arange(0, D)
    j0 = tl.program_id(1) * (TILES * BN)
    if j0 < last:
        r = tl.arange(0, NT * HP)
        rt, rh = t0 + r // HP, r % HP
        qok = (rt < NEXT_N) & (rh < H)
        qt = (b * NEXT_N + rt).to(tl.int64)
        q = tl.load(q_ptr + qt[:, None] * q_s0 + rh[:, None] * q_s1 + d[None, :],
                    mask=qok[:, None], other=0)
        q = _operand(q, QFP8, SOFT, DOT_F32)
        w = tl.load(w_ptr + qt * w_s0 + rh, mask=qok, other=0.0).to(tl.float32)
        for u in tl.static_range(TILES):
            j = j0 + u * BN + tl.arange(0, BN)
            col = j // BS
            ok = (j < width) & (j < last) & (col < bt_cols)
            blk = tl.load(bt_ptr + b.to(tl.int64) * bt_s0 + col, mask=ok,
                          other=-1).to(tl.int64)
            ok &= (blk >= 0) & (blk < num_blocks)
            off = j % BS
            base = cache_ptr + blk * c_s0
            if KFP8:
                row = off * D
            else:
                row = off * c_s1
            if HEADS_N:
                kt = tl.load(base[:, None] + row[:, None] + d[None, :], mask=ok[:, None],
                             other=0)
            else:
                kt = tl.load(base[None, :] + row[None, :] + d[:, None], mask=ok[None, :],
                             other=0)
            score = _tile_scores(q, w, _operand(kt, KFP8, SOFT, DOT_F32), HEADS_N, NT, HP)
            if KFP8:
                scale = tl.load((base + BS * D + off * 4).to(tl.pointer_type(tl.float32)),
                                mask=ok, other=0.0)
                score = score * scale[:, None]
            key = _keys(score, j[:, None], ok[:, None] & (j[:, None] < nc[None, :]))
            tl.store(key_ptr + tok[None, :] * key_s0 + j[:, None], key,
                     mask=live_t[None, :] & (j < width)[:, None])
    else:
        for u in tl.static_range(TILES):
            j = j0 + u * BN + tl.arange(0, BN)
            tl.store(key_ptr + tok[None, :] * key_s0 + j[:, None],
                     tl.full((BN, NT), MIN_KEY, tl.int64),
                     mask=live_t[None, :] & (j < width)[:, None])


@triton.jit
def k_insert_kernel(k_ptr, k_s0, cache_ptr, c_s0, c_s1, slot_ptr, n_tokens, capacity, BS,
                    FP8: tl.constexpr, TPP: tl.constexpr, SOFT: tl.constexpr):
    """Rows -> the indexer cache (docs/semantics.md §11.1): bf16 first; fp8 as 128 e4m3 of
    x / 2^e with e = ceil(log2(max(amax, 1e-4) / 448)) exactly (from the fp32 bits: amax =
    m * 2^E, 448 = 1.75 * 2^8), and the fp32 2^e in the block's tail."""
    d = tl.arange(0, D)
    for i in tl.static_range(TPP):
        tok = tl.program_id(0) * TPP + i
        slot = tl.load(slot_ptr + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
        if (slot >= 0) & (slot < capacity):
            x = tl.load(k_ptr + tok.to(tl.int64) * k_s0 + d).to(tl.float32)
            x = to_bf16(x, SOFT).to(tl.float32)
            blk = slot // BS
            off = slot % BS
            if FP8:
                amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
                abits = amax.to(tl.int32, bitcast=True)
                e = ((abits >> 23) & 0xFF) - 135 + ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)
                base = cache_ptr + blk * c_s0
                tl.store(base + off * D + d, e4m3_sat(x * exp2_int(-e), SOFT))
                tl.store((base + BS * D + off * 4).to(tl.pointer_type(tl.float32)), exp2_int(e))
            else:
                tl.store(cache_ptr + blk * c_s0 + off * c_s1 + d, x.to(tl.bfloat16))
