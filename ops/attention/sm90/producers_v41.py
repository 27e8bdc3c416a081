"""The sm_90 kernel's producer over DeepSeek-V4.1's records (docs/semantics.md §12): 528 B
MXFP8 main (SWA) rows with extra (compressed) rows in the record ``EXTRA`` names (a
``launch.FMT_CODES`` code): 5, 528 B too; 6, 288 B NVFP4; 0, the 584 B V4 record (a V4.1
deployment on SM90).

The shape of ``producers._produce_v4`` outside clusters: the raw records go through the
staging buffer by cp.async, SUB_N rows at a time, one chunk ahead of the dequantization, each
thread reading back exactly the bytes its own cp.async wrote (one layout for both), so its
wait_group is all the staging buffer needs. A 528 B record has no bf16 dims: its 512 e4m3
bytes fill all eight byte tiles of the staging buffer (V4 uses seven and copies its RoPE dims
separately) and its sixteen scale bytes come as two int64 per row; a 288 B record's 256 bytes
fill four, its 32 scale bytes four int64; 584 B rows are staged as ``producers._produce_v4``
stages them (seven tiles, the RoPE dims in ``stage_rope``). A chunk lies in one source
(source 0's columns are padded to whole tiles), so where the sources' records differ the
format is chosen once per chunk, by a branch uniform over the partition, not per row. At
65-128 heads the token's two head blocks run as a 2-CTA cluster (``_produce_v41_pair``, as
V4's: ``cluster``).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                              mbarrier)

from sparse_mla.ops.attention.fmt_codes import V4, V41, V41_FP4, V41_WITH_FP4
from sparse_mla.ops.attention.portable import tile_source
from sparse_mla.ops.attention.sm90.cluster import (_CLUSTER_ARRIVE, _CLUSTER_WAIT, _SEND_V41,
                                                   PAIR_SUB, V41_PANELS, _cluster_sync,
                                                   _pair_drain, _pair_handoff, _send_half,
                                                   _thread_ids)
from sparse_mla.ops.attention.sm90.compat import barrier
from sparse_mla.ops.attention.sm90.dequant import _store_fp4, _store_v4, _store_v41
from sparse_mla.ops.attention.sm90.gather import (_early_slots, _issue_fp4, _issue_v4,
                                                  _issue_v41, _slots, _staged_panels7,
                                                  _usable)


@gluon.jit
def _issue(stage_raw, stage_rope, idx, c, n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, c1_ptr,
           c1_s0, c1_s1, c1_bs, c1_cap, cb, SUB: gl.constexpr, EXTRA: gl.constexpr):
    """Start the gather of the chunk at virtual column ``c`` in its source's record: (valid,
    four int64 of scale bytes: the last two zeros for 528 B rows, the last three for 584 B
    rows)."""
    source = tile_source(c < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, c1_ptr, c1_s0, c1_s1,
                         c1_bs, c1_cap)
    if EXTRA == V41:
        v, s0, s1 = _issue_v41(stage_raw, idx, source, cb, SUB)
        s2 = s0
        s3 = s0
    else:
        if c < n0p:
            v, s0, s1 = _issue_v41(stage_raw, idx, source, cb, SUB)
            s2 = s0 * 0
            s3 = s2
        elif EXTRA == V41_FP4:
            v, s0, s1, s2, s3 = _issue_fp4(stage_raw, idx, source, cb, SUB)
        else:
            v, s0, v_o = _issue_v4(stage_raw, stage_rope, idx, idx, source, cb, SUB, False)
            s1 = s0 * 0
            s2 = s1
            s3 = s1
    return v, s0, s1, s2, s3


@gluon.jit
def _produce_v41(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, early, t, lo, hi,
                 n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                 c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN: gl.constexpr,
                 SUB: gl.constexpr, STAGES: gl.constexpr, P_WARPS: gl.constexpr,
                 EARLY: gl.constexpr, FMT: gl.constexpr):
    """The producer outside clusters (kernel ``FMT`` 5, 7 or 8: 528 B main rows with 528 B,
    288 B or 584 B extra rows)."""
    EXTRA: gl.constexpr = V41 if FMT == V41 else (V41_FP4 if FMT == V41_WITH_FP4 else V4)
    LB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [P_WARPS, 1], [1, 0])
    rows_b: gl.constexpr = gl.SliceLayout(1, LB)
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))
    upper = (cb >= 32)[None, :]     # the tile's columns under its second scale (528 B rows)
    CH: gl.constexpr = BN // SUB
    idx = _early_slots(early, 0, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                       rows_b, EARLY)
    v, s0, s1, s2, s3 = _issue(stage_raw, stage_rope, idx, lo, n0p, c0_ptr, c0_s0, c0_s1, c0_bs,
                               c0_cap, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, cb, SUB, EXTRA)
    idx = _early_slots(early, SUB, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                       rows_b, EARLY)
    for i in range(n_tiles):
        st = i % STAGES
        for h in gl.static_range(CH):     # static: shared-memory slices need constant starts
            c_c = lo + i * BN + h * SUB     # the chunk in the staging buffer
            async_copy.wait_group(0)
            x0, x1, x2, x3, x4, x5, x6, x7 = _staged(stage_raw, SUB, LB)
            rope = _rope(stage_rope, x0, SUB, LB, EXTRA)
            v_c = v
            s0_c = s0
            s1_c = s1
            s2_c = s2
            s3_c = s3
            c = c_c + SUB
            v, s0, s1, s2, s3 = _issue(stage_raw, stage_rope, idx, c, n0p, c0_ptr, c0_s0,
                                       c0_s1, c0_bs, c0_cap, c1_ptr, c1_s0, c1_s1, c1_bs,
                                       c1_cap, cb, SUB, EXTRA)
            idx = _slots(c + SUB, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                         rows_b)
            if h == 0:
                mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            _store_chunk(k_bufs.index(st), h * SUB, x0, x1, x2, x3, x4, x5, x6, x7, rope, s0_c,
                         s1_c, s2_c, s3_c, upper, c_c >= n0p, SUB, P_WARPS, EXTRA)
            bias_bufs.index(st).slice(h * SUB, SUB).store(gl.where(v_c, 0.0, float("-inf")))
        # generic-proxy stores -> the wgmma (async proxy) reads; all producer warps first
        fence_async_shared()
        barrier()
        mbarrier.arrive(ready.index(st))
    async_copy.wait_group(0)    # the gather issued past the last chunk (all rows masked)


@gluon.jit
def _produce_v41_pair(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free, t,
                      lo, hi, n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                      i0_ptr, i0_s0, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0,
                      BN: gl.constexpr, STAGES: gl.constexpr, P_WARPS: gl.constexpr, rank,
                      FMT: gl.constexpr, g0, ALONE: gl.constexpr):
    """``_produce_v41`` in a 2-CTA cluster (``cluster``): this CTA's 32-row half of every tile
    (one chunk a tile, staged a tile ahead), stored here and copied, all eight panels, into
    the peer's stage (584 B rows' RoPE dims too); the bias of the peer's half is written here
    from its slot ids. ``g0`` / ``ALONE``: as ``producers._produce_v4``'s."""
    EXTRA: gl.constexpr = V41 if FMT == V41 else (V41_FP4 if FMT == V41_WITH_FP4 else V4)
    LB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [P_WARPS, 1], [1, 0])
    rows_b: gl.constexpr = gl.SliceLayout(1, LB)
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))
    upper = (cb >= 32)[None, :]
    SUB: gl.constexpr = PAIR_SUB
    gl.static_assert(BN == 2 * PAIR_SUB)
    tid = _thread_ids(P_WARPS)
    first = lo + rank * SUB
    other = lo + (1 - rank) * SUB   # the peer's half: only its bias is written here
    if ALONE:
        _cluster_sync(tid, _CLUSTER_ARRIVE)
    idx = _slots(first, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
    idx_o = _slots(other, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
    v, s0, s1, s2, s3 = _issue(stage_raw, stage_rope, idx, first, n0p, c0_ptr, c0_s0, c0_s1,
                               c0_bs, c0_cap, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, cb, SUB,
                               EXTRA)
    idx = _slots(first + BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
    if ALONE:
        _cluster_sync(tid, _CLUSTER_WAIT)
    for i in range(n_tiles):
        g = g0 + i
        st = g % STAGES
        c_c = first + i * BN      # this CTA's chunk in the staging buffer
        async_copy.wait_group(0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _staged(stage_raw, SUB, LB)
        rope = _rope(stage_rope, x0, SUB, LB, EXTRA)
        v_c = v
        s0_c = s0
        s1_c = s1
        s2_c = s2
        s3_c = s3
        # both halves of a tile lie in one source (source 0's columns are padded to BN)
        v_oc = _usable(idx_o, gl.where(c_c < n0p, c0_cap, c1_cap))
        v, s0, s1, s2, s3 = _issue(stage_raw, stage_rope, idx, c_c + BN, n0p, c0_ptr, c0_s0,
                                   c0_s1, c0_bs, c0_cap, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap,
                                   cb, SUB, EXTRA)
        idx = _slots(c_c + 2 * BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                     rows_b)
        idx_o = _slots(other + (i + 1) * BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0,
                       SUB, rows_b)
        _pair_handoff(empty, peer_free, g, rank, tid, STAGES)
        kb = k_bufs.index(st)
        bias = bias_bufs.index(st)
        if rank == 0:     # static slice starts: one branch per rank
            _store_chunk(kb, 0, x0, x1, x2, x3, x4, x5, x6, x7, rope, s0_c, s1_c, s2_c, s3_c,
                         upper, c_c >= n0p, SUB, P_WARPS, EXTRA)
            _bias_pair(bias, 0, v_c, v_oc, SUB)
        else:
            _store_chunk(kb, SUB, x0, x1, x2, x3, x4, x5, x6, x7, rope, s0_c, s1_c, s2_c,
                         s3_c, upper, c_c >= n0p, SUB, P_WARPS, EXTRA)
            _bias_pair(bias, SUB, v_c, v_oc, SUB)
        # generic-proxy stores -> the wgmma (async proxy) reads and the bulk copy to the peer
        # (async proxy too); all producer warps first
        fence_async_shared()
        barrier()
        _send_half(ready, st, rank, tid, BN, SUB, _SEND_V41, V41_PANELS)
    async_copy.wait_group(0)    # the gather issued past the last tile (all rows masked)
    if ALONE:
        _pair_drain(empty, peer_free, n_tiles, rank, tid, STAGES)


@gluon.jit
def _staged(stage_raw, SUB: gl.constexpr, LB: gl.constexpr):
    """The staged chunk's eight byte panels, all loaded whatever the record: a 288 B row fills
    only the first four, and loaded under a branch the panels were carried out of it byte by
    byte."""
    x0, x1, x2, x3, x4, x5, x6 = _staged_panels7(stage_raw, SUB, LB)
    return x0, x1, x2, x3, x4, x5, x6, stage_raw.slice(7 * SUB, SUB).load(LB)


@gluon.jit
def _rope(stage_rope, like, SUB: gl.constexpr, LB: gl.constexpr, EXTRA: gl.constexpr):
    """The staged chunk's RoPE dims where extra rows may be 584 B ones (stage_rope; read with
    the chunk's bytes, before the next gather overwrites it), else ``like`` (never used)."""
    if EXTRA == V4:
        rope = stage_rope.slice(0, SUB).load(LB)
    else:
        rope = like
    return rope


@gluon.jit
def _store_chunk(kb, r0: gl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7, rope, s0, s1, s2, s3,
                 upper, extra, SUB: gl.constexpr, P_WARPS: gl.constexpr, EXTRA: gl.constexpr):
    """A staged chunk decoded into rows [r0, r0 + SUB) of stage ``kb``: in the extra rows'
    record ``EXTRA`` where the chunk is ``extra`` (source 1's), else as 528 B rows."""
    if EXTRA != V41 and extra:
        if EXTRA == V41_FP4:
            _store_fp4(kb, r0, SUB, x0, x1, x2, x3, s0, s1, s2, s3, P_WARPS)
        else:
            _store_v4(kb, r0, SUB, x0, x1, x2, x3, x4, x5, x6, rope, s0)
    else:
        _store_v41(kb, r0, SUB, x0, x1, x2, x3, x4, x5, x6, x7, s0, s1, upper)


@gluon.jit
def _bias_pair(bias, r0: gl.constexpr, valid, valid_o, SUB: gl.constexpr):
    """A cluster CTA's bias rows [r0, r0 + SUB) and the peer's half."""
    bias.slice(r0, SUB).store(gl.where(valid, 0.0, float("-inf")))
    bias.slice(SUB - r0, SUB).store(gl.where(valid_o, 0.0, float("-inf")))
