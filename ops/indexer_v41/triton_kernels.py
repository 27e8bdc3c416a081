"""The Triton kernel of the V4.1 indexer family (docs/semantics.md §11.6); launchers in
triton_impl.py.

One kernel for both levels, prefill and decode. A program scores one token row against a tile
of ``BSL`` candidate blocks of ``CB`` positions: level 1 the blocks in order (the whole causal
range, in tiles), level 2 the row's listed blocks (sorted, so a repeat is the slot before it),
so level 2 reads only the listed blocks' keys. Scores are ops/indexer's (§11.2: bf16 / e4m3
operands, fp32 accumulation, an e4m3 key's scale after the head sum) and are written as its
int64 selection keys (``_keys``: score high, 2^32 - 1 - position low), for
``ops.indexer.triton_impl.select``. Level 1 also writes one key per block in the same pass:
its NaN-propagating max (NaN above every number), +inf for the row's newest block,
"not a candidate" for a block with no live logit; the block id in the low half.

Reads are masked to causal, readable positions, so unused (NaN-poisoned) cache rows and
negative or out-of-range blocks are never read.
"""
from __future__ import annotations

import triton
import triton.language as tl

from sparse_mla.ops.indexer.triton_kernels import D, _keys, _operand

# a key's high half for a NaN block (above +inf's 0x7F800000) and for +inf
NAN_HIGH = tl.constexpr(0x7FFFFFFF << 32)
INF_HIGH = tl.constexpr(0x7F800000 << 32)


@triton.jit
def _block_keys(score, live, slot_loc, c_blk, n, CB, BSL: tl.constexpr):
    """Keys [BSL] of the tile's blocks ``c_blk`` from the position scores [N] whose block
    slot is ``slot_loc`` and whose ``live`` flag is set."""
    member = (slot_loc[None, :] == tl.arange(0, BSL)[:, None]) & live[None, :]
    nan = tl.max(tl.where(member & (score != score)[None, :], 1, 0), axis=1) > 0
    has = tl.max(tl.where(member, 1, 0), axis=1) > 0
    best = tl.max(tl.where(member & (score == score)[None, :], score[None, :], float("-inf")),
                  axis=1)
    key = _keys(best, c_blk, has)
    pinned = (n > 0) & (c_blk == (n - 1) // CB)
    low = 0xFFFFFFFF - c_blk.to(tl.int64)
    key = tl.where(nan, low + NAN_HIGH, key)
    return tl.where(pinned, low + INF_HIGH, key)


@triton.jit
def v41_keys_kernel(q_ptr, q_s0, q_s1, w_ptr, w_s0, n_ptr, start,
                    cache_ptr, c_s0, c_s1, num_blocks, bt_ptr, bt_s0, bt_cols, BS, NEXT_N,
                    k_ptr, k_s0, ks_ptr, k0_ptr,
                    cand_ptr, cand_s0, n_slots,
                    key_ptr, key_s0, bkey_ptr, bkey_s0, width, nblk, H, CB,
                    HP: tl.constexpr, BSL: tl.constexpr, CBP: tl.constexpr,
                    PAGED: tl.constexpr, LEVEL1: tl.constexpr, QFP8: tl.constexpr,
                    KFP8: tl.constexpr, SOFT: tl.constexpr, DOT_F32: tl.constexpr):
    """Row pid0 of a chunk (token ``start + pid0``, causal count ``n[token]``) x block slots
    [pid1*BSL, +BSL). Keys of position j go to column j (level 1) or slot*CB + offset (level 2);
    level 1's block keys to column c of ``bkey``. PAGED: request token // NEXT_N's entries
    through the block table; else dense rows k0[token] + j of ``k``."""
    i = tl.program_id(0)
    t = (start + i).to(tl.int64)
    n = tl.load(n_ptr + t).to(tl.int64)
    e = tl.arange(0, BSL * CBP)
    slot_loc = e // CBP
    off = (e % CBP).to(tl.int64)
    slot = tl.program_id(1) * BSL + slot_loc
    if LEVEL1:
        c = slot.to(tl.int64)
        slot_ok = c < nblk
    else:
        inside = slot < n_slots
        c = tl.load(cand_ptr + t * cand_s0 + slot, mask=inside, other=-1).to(tl.int64)
        prev = tl.load(cand_ptr + t * cand_s0 + slot - 1, mask=inside & (slot > 0), other=-1)
        slot_ok = inside & (c >= 0) & ((slot == 0) | (c != prev.to(tl.int64)))
    j = c * CB + off
    live = slot_ok & (off < CB) & (j < n)
    if PAGED:
        b = t // NEXT_N
        col = j // BS
        live &= col < bt_cols
        blk = tl.load(bt_ptr + b * bt_s0 + col, mask=live, other=-1).to(tl.int64)
        live &= (blk >= 0) & (blk < num_blocks)
        entry = j % BS
        base = cache_ptr + blk * c_s0
        if KFP8:
            row = base + entry * D
        else:
            row = base + entry * c_s1
    else:
        k0 = tl.load(k0_ptr + t).to(tl.int64)
        row = k_ptr + (k0 + j) * k_s0
    score = tl.zeros((BSL * CBP,), tl.float32)
    if tl.max(live.to(tl.int32), axis=0) > 0:
        d = tl.arange(0, D)
        kt = _operand(tl.load(row[None, :] + d[:, None], mask=live[None, :], other=0), KFP8,
                      SOFT, DOT_F32)
        h = tl.arange(0, HP)
        q = tl.load(q_ptr + t * q_s0 + h[:, None] * q_s1 + d[None, :], mask=(h < H)[:, None],
                    other=0)
        w = tl.load(w_ptr + t * w_s0 + h, mask=h < H, other=0.0).to(tl.float32)
        dot = tl.dot(_operand(q, QFP8, SOFT, DOT_F32), kt)
        score = tl.sum(tl.maximum(dot, 0.0) * w[:, None], axis=0)
        if KFP8:
            if PAGED:
                scale = tl.load((base + BS * D + entry * 4).to(tl.pointer_type(tl.float32)),
                                mask=live, other=0.0)
            else:
                scale = tl.load(ks_ptr + k0 + j, mask=live, other=0.0)
            score = score * scale
    key = _keys(score, j, live)
    row_keys = key_ptr + i.to(tl.int64) * key_s0
    if LEVEL1:
        tl.store(row_keys + j, key, mask=slot_ok & (off < CB) & (j < width))
        c_blk = tl.program_id(1) * BSL + tl.arange(0, BSL)
        tl.store(bkey_ptr + i.to(tl.int64) * bkey_s0 + c_blk,
                 _block_keys(score, live, slot_loc, c_blk, n, CB, BSL), mask=c_blk < nblk)
    else:
        tl.store(row_keys + slot.to(tl.int64) * CB + off, key, mask=(slot < n_slots) & (off < CB))
