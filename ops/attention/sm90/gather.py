"""Key-row addressing and gathers of the sm_90 kernel's producers: slot ids of a run of the
token's virtual key list (``_slots``, ``_early_slots``), cache record addresses, and the loads
and cp.async copies that bring V4, V3.2 and plain rows from global memory into registers or
shared memory (dequantized afterwards by ``dequant``).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy

from sparse_mla.ops.attention.portable import slot_row
from sparse_mla.ops.attention.sm90.cluster import V32_STAGED_PANELS
from sparse_mla.ops.attention.sm90.compat import async_load
from sparse_mla.ops.common import formats

V32_RECORD = gl.constexpr(formats.V32.bytes_per_token)     # bytes of a V3.2 record
V32_SCALES = gl.constexpr(formats.V32.scale_offset)        # its four fp32 scales' byte offset
V32_ROPE = gl.constexpr(formats.V32.rope_offset)           # its bf16 RoPE dims' byte offset


@gluon.jit
def _usable(idx, cap):
    """Slot ids that address a cache row."""
    return (idx >= 0) & (idx < cap)


@gluon.jit
def _record(cache, s0, bs, idx, row_stride):
    """Address of each slot's row: block ``idx // bs`` (``s0`` apart), row ``idx % bs`` of
    it (``row_stride`` apart: 576 B V4 records, 656 B V3.2 records, a plain cache's
    stride(1))."""
    return cache + (idx // bs).to(gl.int64) * s0 + (idx % bs).to(gl.int64) * row_stride


@gluon.jit
def _slots(c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, BN: gl.constexpr,
           layout: gl.constexpr):
    """Slot ids of virtual columns [c, c + BN) (-1 where unusable or at/after ``hi``), in
    ``layout`` (the portable kernel's ``_tile_slots`` with an explicit layout)."""
    row, col, n = slot_row(c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0)
    cols = col + gl.arange(0, BN, layout=layout)
    return gl.load(row + cols, mask=cols < n, other=-1)


@gluon.jit
def _early_slots(early, c: gl.constexpr, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0,
                 i1_s0, W: gl.constexpr, layout: gl.constexpr, EARLY: gl.constexpr):
    """``_slots`` of virtual columns [lo + c, lo + c + W), read from ``early`` (each source's
    leading ids, loaded with the lengths: ``_load_early``) where they are there: in the
    token's first split, with the columns all in one source (shared-memory slices need
    constant starts). Anywhere else, or without ``EARLY``, they are loaded now."""
    if EARLY:
        gl.static_assert(c + W <= early.shape[1])
        if (lo == 0) & ((c + W <= n0p) | (n0p == 0)):
            from0 = n0p > 0
            cols = c + gl.arange(0, W, layout=layout)
            n = gl.where(c < hi, gl.where(from0, n0, n1), 0)
            ids = gl.where(from0, early.index(0).slice(c, W).load(layout),
                           early.index(1).slice(c, W).load(layout))
            idx = gl.where(cols < n, ids, -1)
        else:
            idx = _slots(lo + c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, W, layout)
    else:
        idx = _slots(lo + c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, W, layout)
    return idx


@gluon.jit
def _load_early(i0_ptr, i0_s0, K0, i1_ptr, i1_s0, K1, t, N: gl.constexpr,
                num_warps: gl.constexpr):
    """Issue the loads of both sources' first ``N`` slot ids of token ``t`` (-1 past the
    index rows), for ``_early_slots``."""
    EL: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    ce = gl.arange(0, N, layout=EL)
    e0 = gl.load(i0_ptr + t.to(gl.int64) * i0_s0 + ce, mask=ce < K0, other=-1)
    e1 = gl.load(i1_ptr + t.to(gl.int64) * i1_s0 + ce, mask=ce < K1, other=-1)
    return e0, e1


@gluon.jit
def _byte_tile(row, j: gl.constexpr, v2, cb):
    """Bytes [64 j, 64 j + 64) of each row (zeros where ``v2`` is false): one [BN, 64] tile.
    Unrolled by the callers: Gluon has no register arrays to loop over."""
    return gl.load(row[:, None] + (64 * j + cb[None, :]), mask=v2, other=0)


@gluon.jit
def _byte_tiles8(row, v2, cb):
    """Bytes [0, 512) of each row as eight [BN, 64] tiles (the e4m3 part of V3.2 records and
    of plain e4m3 rows), all loads issued before any is used."""
    return (_byte_tile(row, 0, v2, cb), _byte_tile(row, 1, v2, cb), _byte_tile(row, 2, v2, cb),
            _byte_tile(row, 3, v2, cb), _byte_tile(row, 4, v2, cb), _byte_tile(row, 5, v2, cb),
            _byte_tile(row, 6, v2, cb), _byte_tile(row, 7, v2, cb))


@gluon.jit
def _staged_panels7(stage_raw, SUB: gl.constexpr, LB: gl.constexpr):
    """The first seven 64-byte panels of the staged chunk (``stage_raw``: panel j's SUB rows
    at rows [j SUB, j SUB + SUB)), loaded in layout ``LB``: a V4 / V3.2 producer's e4m3 dims
    (the eighth panel, where a record has one, is the caller's)."""
    return (stage_raw.slice(0 * SUB, SUB).load(LB), stage_raw.slice(1 * SUB, SUB).load(LB),
            stage_raw.slice(2 * SUB, SUB).load(LB), stage_raw.slice(3 * SUB, SUB).load(LB),
            stage_raw.slice(4 * SUB, SUB).load(LB), stage_raw.slice(5 * SUB, SUB).load(LB),
            stage_raw.slice(6 * SUB, SUB).load(LB))


@gluon.jit
def _v4_records(cache, s0, bs, idx, valid):
    """Byte address of each slot's 576-byte V4 record (e4m3 dims, then RoPE dims) and its
    eight UE8M0 scale bytes, loaded as one int64 (0 where not ``valid``); a block holds
    ``bs`` records, then their scales."""
    # Spelled out, not through _record: with the block's address shared by both pointers
    # (b86fd5b) the h128 clusters ran slower, though the PTX had the same instructions in a
    # different order (lab/perf-log.md, "Refactor regression undone")
    blk = (idx // bs).to(gl.int64)
    off = (idx % bs).to(gl.int64)
    rec = cache + blk * s0 + off * 576
    sc = gl.load((cache + blk * s0 + bs * 576 + off * 8).to(gl.pointer_type(gl.int64)),
                 mask=valid, other=0)
    return rec, sc


@gluon.jit
def _gather_v4(cache, s0, bs, idx, valid, cb):
    """Issue the loads of one tile of V4 rows: seven [BN, 64] e4m3 byte tiles, the [BN, 64]
    bf16 RoPE tile and each row's eight scale bytes as one int64 (rows with an unusable slot
    id load nothing and read as zeros)."""
    rec, sc = _v4_records(cache, s0, bs, idx, valid)
    v2 = valid[:, None]
    x0 = _byte_tile(rec, 0, v2, cb)
    x1 = _byte_tile(rec, 1, v2, cb)
    x2 = _byte_tile(rec, 2, v2, cb)
    x3 = _byte_tile(rec, 3, v2, cb)
    x4 = _byte_tile(rec, 4, v2, cb)
    x5 = _byte_tile(rec, 5, v2, cb)
    x6 = _byte_tile(rec, 6, v2, cb)
    rope = gl.load((rec + 448).to(gl.pointer_type(gl.bfloat16))[:, None] + cb[None, :],
                   mask=v2, other=0.0)
    return x0, x1, x2, x3, x4, x5, x6, rope, sc


@gluon.jit
def _issue_v4(stage_raw, stage_rope, idx, idx_o, source, cb, SUB: gl.constexpr,
              PEER: gl.constexpr):
    """Start the gather of one chunk of V4 rows (``source``: ``tile_source``'s cache
    arguments) into the staging buffer: the 448 e4m3 bytes as seven [SUB, 64] byte tiles and
    the 64 bf16 RoPE dims by cp.async (rows with an unusable slot id are zero-filled), and
    where ``PEER`` the RoPE dims of the peer CTA's rows ``idx_o`` after them, one commit
    group; the rows' eight UE8M0 scale bytes (one int64) by an ordinary load, used a chunk
    later. Returns (valid, scales, the peer rows' valid)."""
    cache, s0, s1, bs, cap = source
    valid = _usable(idx, cap)
    rec, sc = _v4_records(cache, s0, bs, idx, valid)
    v2 = valid[:, None]
    for k in gl.static_range(7):
        async_load(stage_raw.slice(k * SUB, SUB), rec[:, None] + (64 * k + cb[None, :]),
                   mask=v2)
    async_load(
        stage_rope.slice(0, SUB),
        (rec + 448).to(gl.pointer_type(gl.bfloat16))[:, None] + cb[None, :], mask=v2)
    valid_o = valid
    if PEER:
        valid_o = _usable(idx_o, cap)
        rec_o = _record(cache, s0, bs, idx_o, 576)
        async_load(
            stage_rope.slice(SUB, SUB),
            (rec_o + 448).to(gl.pointer_type(gl.bfloat16))[:, None] + cb[None, :],
            mask=valid_o[:, None])
    async_copy.commit_group()
    return valid, sc, valid_o


@gluon.jit
def _gather_v32(cache, s0, bs, idx, valid, cb):
    """Issue the loads of V3.2 records (rows with an unusable slot id load nothing): the 512
    e4m3 bytes as eight [rows, 64] byte tiles and the four fp32 scales; returns the records'
    addresses too (their RoPE dims are copied later)."""
    rec = _record(cache, s0, bs, idx, V32_RECORD)
    x0, x1, x2, x3, x4, x5, x6, x7 = _byte_tiles8(rec, valid[:, None], cb)
    scales = _v32_scales(rec)
    sa = gl.load(scales, mask=valid, other=0.0)
    sb = gl.load(scales + 1, mask=valid, other=0.0)
    sc = gl.load(scales + 2, mask=valid, other=0.0)
    sd = gl.load(scales + 3, mask=valid, other=0.0)
    return rec, x0, x1, x2, x3, x4, x5, x6, x7, sa, sb, sc, sd


@gluon.jit
def _v32_scales(rec):
    """Pointers to the four fp32 scales (one per 128 dims) of the V3.2 records at ``rec``."""
    return (rec + V32_SCALES).to(gl.pointer_type(gl.float32))


@gluon.jit
def _rope_v32(krb, rec, valid, LR: gl.constexpr):
    """Start the copy of V3.2 rows' RoPE dims (bf16, no decoding) into ``krb``, in layout
    ``LR``, which spreads the rows as ``rec``'s layout does (no conversion). One-CTA
    producers give 16 bytes per thread, a thread's two halves half a row apart, so each
    cp.async covers whole sectors (``producers._produce_tiles``' bf16 note), faster for V3.2
    (lab/perf-log.md, "bf16 rows in whole sectors")."""
    rows: gl.constexpr = gl.SliceLayout(1, LR)
    rope = gl.convert_layout(rec, rows) + V32_ROPE
    cr = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
    async_load(
        krb, rope.to(gl.pointer_type(gl.bfloat16))[:, None] + cr[None, :],
        mask=gl.convert_layout(valid, rows)[:, None])


@gluon.jit
def _stage_v32(stage_raw, stage_sc, rec, valid, cb):
    """Start the cp.async of V3.2 rows' first ``V32_STAGED_PANELS`` e4m3 panels and their
    scales into the staging buffers, in ``_byte_tile``'s layout (each thread later reads the
    bytes it copied); rows that are not ``valid`` are zero-filled. One commit group."""
    v2 = valid[:, None]
    for j in gl.static_range(V32_STAGED_PANELS):
        async_load(
            stage_raw.index(j), rec[:, None] + (64 * j + cb[None, :]), mask=v2)
    scales = _v32_scales(rec)    # one per pair of panels
    for j in gl.static_range(V32_STAGED_PANELS // 2):
        async_load(stage_sc.index(j), scales + j, mask=valid)
    async_copy.commit_group()


@gluon.jit
def _load_v32_tail(rec, valid, cb):
    """The loads of what ``_stage_v32`` leaves of V3.2 rows: e4m3 panels 4-7 as
    ``_byte_tile``s and the scales of their two pairs (zeros where not ``valid``)."""
    gl.static_assert(V32_STAGED_PANELS == 4)
    v2 = valid[:, None]
    scales = _v32_scales(rec) + 2
    return (_byte_tile(rec, 4, v2, cb), _byte_tile(rec, 5, v2, cb), _byte_tile(rec, 6, v2, cb),
            _byte_tile(rec, 7, v2, cb), gl.load(scales, mask=valid, other=0.0),
            gl.load(scales + 1, mask=valid, other=0.0))


V41_DATA = gl.constexpr(formats.V41.token_data_bytes)      # e4m3 bytes of a 528 B record
V41_SCALES = gl.constexpr(formats.V41.scale_offset)        # its UE8M0 scale bytes (tail)


@gluon.jit
def _issue_v41(stage_raw, idx, source, cb, SUB: gl.constexpr):
    """Start the gather of one chunk of 528 B V4.1 rows (``source``: ``tile_source``'s cache
    arguments) into the staging buffer: the 512 e4m3 bytes as eight [SUB, 64] byte tiles by
    cp.async (rows with an unusable slot id are zero-filled), one commit group; the rows'
    sixteen UE8M0 scale bytes (in the block's tail after its data rows) as two int64 by
    ordinary loads, used a chunk later. Returns (valid, scales 0-7, scales 8-15)."""
    cache, s0, s1, bs, cap = source
    valid = _usable(idx, cap)
    blk = (idx // bs).to(gl.int64)
    off = (idx % bs).to(gl.int64)
    rec = cache + blk * s0 + off * V41_DATA
    v2 = valid[:, None]
    for k in gl.static_range(8):
        async_load(stage_raw.slice(k * SUB, SUB), rec[:, None] + (64 * k + cb[None, :]),
                   mask=v2)
    async_copy.commit_group()
    sc = (cache + blk * s0 + bs * V41_DATA + off * V41_SCALES).to(gl.pointer_type(gl.int64))
    return valid, gl.load(sc, mask=valid, other=0), gl.load(sc + 1, mask=valid, other=0)


V41_FP4_DATA = gl.constexpr(formats.V41_FP4.token_data_bytes)    # e2m1 bytes of a 288 B record
V41_FP4_SCALES = gl.constexpr(formats.V41_FP4.scale_offset)      # its e4m3 scale bytes (tail)


@gluon.jit
def _issue_fp4(stage_raw, idx, source, cb, SUB: gl.constexpr):
    """``_issue_v41`` for 288 B V4.1 rows: their 256 bytes of e2m1 pairs as four [SUB, 64]
    byte tiles by cp.async (one commit group) and their 32 e4m3 scale bytes as four int64.
    Returns (valid, scales 0-7, 8-15, 16-23, 24-31)."""
    cache, s0, s1, bs, cap = source
    valid = _usable(idx, cap)
    blk = (idx // bs).to(gl.int64)
    off = (idx % bs).to(gl.int64)
    rec = cache + blk * s0 + off * V41_FP4_DATA
    v2 = valid[:, None]
    for k in gl.static_range(4):
        async_load(stage_raw.slice(k * SUB, SUB), rec[:, None] + (64 * k + cb[None, :]),
                   mask=v2)
    async_copy.commit_group()
    sc = (cache + blk * s0 + bs * V41_FP4_DATA + off * V41_FP4_SCALES).to(
        gl.pointer_type(gl.int64))
    return (valid, gl.load(sc, mask=valid, other=0), gl.load(sc + 1, mask=valid, other=0),
            gl.load(sc + 2, mask=valid, other=0), gl.load(sc + 3, mask=valid, other=0))
