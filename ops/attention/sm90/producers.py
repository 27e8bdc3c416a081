"""The producer partition of the sm_90 kernel (4 warps): fills the two-stage ring of bf16
[BLOCK_N, 512] key tiles the consumers read, and signals each stage's ``ready`` mbarrier.

* V4 rows (``_produce_v4``): where every block starts 16-byte aligned the raw records go
  through an 18 KB staging buffer by cp.async, SUB_N rows at a time, one chunk ahead of the
  dequantization; in a 2-CTA cluster each CTA does half of every tile (``cluster``);
* V3.2 rows in a cluster (``_produce_v32_pair``): half of every tile, the next tile's first
  panels staged by cp.async a tile ahead;
* everything else a tile at a time (``_produce_tiles``): V4 rows loaded into registers, V3.2
  rows (RoPE dims by cp.async), plain e4m3 rows converted, plain bf16 rows copied by cp.async
  straight into the stage.

Addresses and loads are ``gather``'s, the conversions ``dequant``'s.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                              mbarrier)

from sparse_mla.ops.attention.fmt_codes import PLAIN_BF16, V32, V4, V41_FIRST
from sparse_mla.ops.attention.portable import tile_source
from sparse_mla.ops.attention.sm90 import persist
from sparse_mla.ops.attention.sm90.cluster import (_CLUSTER_ARRIVE, _CLUSTER_WAIT, _SEND_V4,
                                                   _SEND_V32_2, _SEND_V32_3, _SEND_V32_STAGED,
                                                   PAIR_SUB, V4_PANELS, V32_PANELS,
                                                   _cluster_sync, _pair_drain, _pair_handoff,
                                                   _send_half, _send_pair_v32, _store_pair_v32,
                                                   _thread_ids)
from sparse_mla.ops.attention.sm90.compat import async_load, barrier, reinterpret2
from sparse_mla.ops.attention.sm90.dequant import _panel, _store_e4m3, _store_v4, _store_v32
from sparse_mla.ops.attention.sm90.gather import (V32_RECORD, _byte_tile, _byte_tiles8,
                                                  _early_slots, _gather_v4, _gather_v32,
                                                  _issue_v4, _load_v32_tail, _record,
                                                  _rope_v32, _slots, _stage_v32,
                                                  _staged_panels7, _usable)
from sparse_mla.ops.attention.sm90.producers_v41 import _produce_v41, _produce_v41_pair


@gluon.jit
def _produce(k_bufs, kr_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free,
             early, t, lo, hi,
             n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
             c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0,
             FMT: gl.constexpr, D576: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
             P_WARPS: gl.constexpr, STAGED: gl.constexpr,
             SUB: gl.constexpr, rank, CLUSTER: gl.constexpr, EARLY: gl.constexpr,
             RANK_VIEWS: gl.constexpr, PERSIST: gl.constexpr, tok_tab, n_mine, t0, tp,
             tp_step):
    """The producer partition: V4 rows through the staging buffer where ``STAGED`` (half of
    each tile where ``CLUSTER``), V4.1 rows (``FMT`` 5: 528 B in both sources, 7 / 8: 528 B
    main rows with 288 B / 584 B extra rows) through it too (``producers_v41``), else a tile
    at a time (``_produce_tiles``)."""
    if PERSIST:    # tokens tp, tp + tp_step, ... (persist)
        if CLUSTER:
            tid = _thread_ids(P_WARPS)
            _cluster_sync(tid, _CLUSTER_ARRIVE)
            _cluster_sync(tid, _CLUSTER_WAIT)
        g0 = 0
        for k in range(n_mine):
            lok, hik, n0pk, n0k, n1k, n_k = persist.run(tok_tab, k, P_WARPS)
            tk = t0 + tp + k * tp_step
            if FMT == V32:
                _produce_v32_pair(k_bufs, kr_bufs, stage_raw, stage_rope, bias_bufs, ready,
                                  empty, peer_free, tk, lok, hik, n_k, n0pk, n0k, n1k, c0_ptr,
                                  c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0, c1_ptr, c1_s0,
                                  c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN, STAGES, P_WARPS,
                                  rank, g0, False)
            elif FMT >= V41_FIRST:
                _produce_v41_pair(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty,
                                  peer_free, tk, lok, hik, n_k, n0pk, n0k, n1k, c0_ptr, c0_s0,
                                  c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0, c1_ptr, c1_s0, c1_s1,
                                  c1_bs, c1_cap, i1_ptr, i1_s0, BN, STAGES, P_WARPS, rank, FMT,
                                  g0, False)
            else:
                _produce_v4(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free,
                            early, tk, lok, hik, n_k, n0pk, n0k, n1k, c0_ptr, c0_s0, c0_s1,
                            c0_bs, c0_cap, i0_ptr, i0_s0, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap,
                            i1_ptr, i1_s0, BN, SUB, STAGES, P_WARPS, rank, CLUSTER, EARLY,
                            RANK_VIEWS, g0, False)
            g0 += n_k
        if CLUSTER:
            _pair_drain(empty, peer_free, g0, rank, tid, STAGES)
    elif CLUSTER and FMT == V32:
        _produce_v32_pair(k_bufs, kr_bufs, stage_raw, stage_rope, bias_bufs, ready, empty,
                          peer_free, t, lo, hi,
                          n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr,
                          i0_s0, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN,
                          STAGES, P_WARPS, rank, 0, True)
    elif STAGED and FMT >= V41_FIRST and CLUSTER:
        _produce_v41_pair(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free, t,
                          lo, hi, n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                          i0_ptr, i0_s0, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN,
                          STAGES, P_WARPS, rank, FMT, 0, True)
    elif STAGED and FMT >= V41_FIRST:
        _produce_v41(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, early, t, lo, hi,
                     n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                     c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN, SUB, STAGES,
                     P_WARPS, EARLY, FMT)
    elif STAGED:
        _produce_v4(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free, early,
                    t, lo, hi,
                    n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                    c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN, SUB, STAGES,
                    P_WARPS, rank, CLUSTER, EARLY, RANK_VIEWS, 0, True)
    else:
        _produce_tiles(k_bufs, kr_bufs, bias_bufs, ready, empty, early, t, lo, hi, n_tiles,
                       n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                       c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, FMT, D576, BN,
                       STAGES, P_WARPS, EARLY)


@gluon.jit
def _produce_tiles(k_bufs, kr_bufs, bias_bufs, ready, empty, early, t, lo, hi, n_tiles, n0p,
                   n0, n1,
                   c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                   c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0,
                   FMT: gl.constexpr, D576: gl.constexpr, BN: gl.constexpr,
                   STAGES: gl.constexpr, P_WARPS: gl.constexpr, EARLY: gl.constexpr):
    if FMT == PLAIN_BF16:
        # plain bf16 rows, [BN, 64] slices: 16 bytes per thread, 8 threads a 128-byte line.
        # At 32 bytes per thread (the byte tiles' layout below) each 16-byte cp.async
        # covered half of every sector it touched, so every sector was asked for twice
        # (lab/perf-log.md, "bf16 rows in whole sectors")
        LB: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [P_WARPS, 1], [1, 0])
    else:
        # [BN, 64] byte tiles: 16 contiguous bytes per thread (one 128-bit load), 4 threads
        # a row; V4 rows' bf16 RoPE dims use it too (32 bytes per thread), so their row
        # pointers need no layout conversion (a shared-memory round trip and two barriers
        # per tile)
        LB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [P_WARPS, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [P_WARPS, 1], [1, 0])  # _rope_v32
    rows_b: gl.constexpr = gl.SliceLayout(1, LB)
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))
    # Slot ids are loaded a tile ahead (two with ``EARLY``, whose first two come from
    # ``early``: AHEAD); the gather of a tile waits on them. The gather itself
    # is issued before waiting for the stage to drain, so its latency overlaps the consumers
    # still reading that stage. Issuing it a whole tile earlier (software pipelining) needs a
    # second tile of raw bytes in registers: 3 KB of spills at 168 registers (sm_90a).
    idx = _early_slots(early, 0, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, BN,
                       rows_b, EARLY)
    AHEAD: gl.constexpr = 2 if EARLY else 1
    idx1 = idx
    if EARLY:
        idx1 = _early_slots(early, BN, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0,
                            BN, rows_b, EARLY)
    for i in range(n_tiles):
        st = i % STAGES
        c = lo + i * BN
        idx_next = _slots(c + AHEAD * BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0,
                          BN, rows_b)
        cache, s0, s1, bs, cap = tile_source(c < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                             c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap)
        valid = _usable(idx, cap)
        kb = k_bufs.index(st)
        if FMT == V4:
            x0, x1, x2, x3, x4, x5, x6, rope, sc = _gather_v4(cache, s0, bs, idx, valid, cb)
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            _store_v4(kb, 0, BN, x0, x1, x2, x3, x4, x5, x6, rope, sc)
        elif FMT == V32:
            # V3.2 records: 512 e4m3 bytes, four fp32 scales (one per 128 dims), 64 bf16 RoPE
            # dims. The RoPE dims need no decoding: copied asynchronously into their own stage
            # while the 512 latent dims are dequantized (and 16 registers lighter than a load)
            rec, x0, x1, x2, x3, x4, x5, x6, x7, sa, sb, sc, sd = _gather_v32(
                cache, s0, bs, idx, valid, cb)
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            _store_v32_rows(kb, kr_bufs.index(st), rec, valid, LR, x0, x1, x2, x3, x4, x5, x6,
                            x7, sa, sb, sc, sd)
        elif FMT == PLAIN_BF16:
            # bf16 rows need no decoding: copied asynchronously straight into the stage, and
            # the producer moves on without waiting for them (see the cp.async note below)
            row = _record(cache, s0, bs, idx, s1)
            v2 = valid[:, None]
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            for j in gl.static_range(8):
                async_load(
                    kb.slice(64 * j, 64, dim=1), row[:, None] + (64 * j + cb[None, :]), mask=v2)
            if D576:
                async_load(
                    kr_bufs.index(st), row[:, None] + (512 + cb[None, :]), mask=v2)
            async_copy.commit_group()
            async_copy.mbarrier_arrive(ready.index(st))
        else:
            row = _record(cache, s0, bs, idx, s1)
            v2 = valid[:, None]
            y0, y1, y2, y3, y4, y5, y6, y7 = _byte_tiles8(row, v2, cb)
            if D576:
                y8 = _byte_tile(row, 8, v2, cb)
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            if D576:
                _store_e4m3(kr_bufs.index(st), 0, y8)
            _store_e4m3(kb, 0, y0)
            _store_e4m3(kb, 1, y1)
            _store_e4m3(kb, 2, y2)
            _store_e4m3(kb, 3, y3)
            _store_e4m3(kb, 4, y4)
            _store_e4m3(kb, 5, y5)
            _store_e4m3(kb, 6, y6)
            _store_e4m3(kb, 7, y7)
        bias_bufs.index(st).store(gl.where(valid, 0.0, float("-inf")))
        # generic-proxy stores -> the wgmma (async proxy) reads; all producer warps first.
        # bf16 rows' cp.async copies are not waited for here: each thread's
        # cp.async.mbarrier.arrive above raised the stage's pending count, and lowers it when
        # that thread's copies land, so ``ready`` completes with the data (CUTLASS's sm_90
        # cp.async + wgmma mainloop relies on the same: no proxy fence after the copies).
        # The next stage's gather then goes out as soon as that stage is free: waiting for the
        # copies here left one tile in flight at a time (lab/perf-log.md, "bf16 stage
        # completion by cp.async").
        fence_async_shared()
        barrier()
        mbarrier.arrive(ready.index(st))
        if EARLY:
            idx = idx1
            idx1 = idx_next
        else:
            idx = idx_next
    if FMT == PLAIN_BF16:
        async_copy.wait_group(0)    # nothing left in flight when the partition ends


@gluon.jit
def _produce_v4(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free, early, t,
                lo, hi, n_tiles,
                n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN: gl.constexpr,
                SUB: gl.constexpr, STAGES: gl.constexpr, P_WARPS: gl.constexpr,
                rank, CLUSTER: gl.constexpr, EARLY: gl.constexpr,
                RANK_VIEWS: gl.constexpr, g0, ALONE: gl.constexpr):
    # V4 rows go global -> staging buffer by cp.async, SUB rows at a time, one chunk ahead:
    # chunk j+1's gather is in flight, holding no registers, while chunk j is dequantized
    # (gathering a whole tile into registers left the producer waiting on its loads:
    # lab/perf-log.md, "Lead and follow consumers", "V4 rows staged by cp.async"). Each thread
    # reads back exactly the bytes its own cp.async wrote (one layout for both), so its
    # wait_group is all the staging buffer needs.
    # In a cluster (``CLUSTER``) the chunk is this CTA's half of each tile, sent on to the
    # peer: chunks are then BN columns apart, one per tile.
    # The ring's tiles g0 .. g0 + n_tiles - 1: g0 = 0 where the program has this one token
    # (``ALONE``: the cluster's start-up sync and last hand-offs are here), else the tiles
    # of its earlier tokens (persist: the caller syncs and drains once).
    LB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [P_WARPS, 1], [1, 0])
    rows_b: gl.constexpr = gl.SliceLayout(1, LB)
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))
    CH: gl.constexpr = 1 if CLUSTER else BN // SUB
    STEP: gl.constexpr = BN if CLUSTER else SUB
    gl.static_assert(not CLUSTER or (BN == 2 * PAIR_SUB and SUB == PAIR_SUB))
    if CLUSTER:
        tid = _thread_ids(P_WARPS)
        first = lo + rank * SUB
        other = lo + (1 - rank) * SUB   # the peer's half: only its RoPE dims are copied here
        if ALONE:
            _cluster_sync(tid, _CLUSTER_ARRIVE)
        idx = _slots(first, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
        idx_o = _slots(other, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
    else:
        first = lo
        other = lo
        idx = _early_slots(early, 0, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0,
                           SUB, rows_b, EARLY)
        idx_o = idx
    v, sc, v_o = _issue_v4(stage_raw, stage_rope, idx, idx_o,
                           tile_source(first < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                       c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap), cb, SUB, CLUSTER)
    if CLUSTER:
        idx = _slots(first + STEP, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                     rows_b)
        idx_o = _slots(other + STEP, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                       rows_b)
        if ALONE:
            _cluster_sync(tid, _CLUSTER_WAIT)
    else:
        idx = _early_slots(early, STEP, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0,
                           SUB, rows_b, EARLY)
    for i in range(n_tiles):
        g = g0 + i
        st = g % STAGES
        for h in gl.static_range(CH):     # static: shared-memory slices need constant starts
            async_copy.wait_group(0)
            x0, x1, x2, x3, x4, x5, x6 = _staged_panels7(stage_raw, SUB, LB)
            rope = stage_rope.slice(0, SUB).load(LB)
            rope_o = rope
            if CLUSTER:
                rope_o = stage_rope.slice(SUB, SUB).load(LB)
            v_c = v
            sc_c = sc
            v_oc = v_o
            c = first + i * BN + (h + 1) * STEP
            v, sc, v_o = _issue_v4(stage_raw, stage_rope, idx, idx_o,
                                   tile_source(c < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                               c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap), cb, SUB,
                                   CLUSTER)
            idx = _slots(c + STEP, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                         rows_b)
            if CLUSTER:
                idx_o = _slots(other + i * BN + 2 * STEP, hi, n0p, n0, n1, i0_ptr, i1_ptr, t,
                               i0_s0, i1_s0, SUB, rows_b)
            if h == 0:
                if CLUSTER:
                    _pair_handoff(empty, peer_free, g, rank, tid, STAGES)
                else:
                    mbarrier.wait(empty.index(st), ((g // STAGES) & 1) ^ 1)
            if CLUSTER and RANK_VIEWS:  # rows by rank at run time, one path (compat, 3.7)
                _store_chunk(k_bufs.index(st), bias_bufs.index(st), 0, x0, x1, x2, x3, x4, x5,
                             x6, rope, sc_c, v_c, SUB, rank)
                _store_peer_rows(k_bufs.index(st), bias_bufs.index(st), 0, rope_o, v_oc, SUB,
                                 1 - rank)
            elif CLUSTER:     # static slice starts: one branch per rank
                if rank == 0:
                    _store_chunk(k_bufs.index(st), bias_bufs.index(st), 0, x0, x1, x2, x3, x4,
                                 x5, x6, rope, sc_c, v_c, SUB)
                    _store_peer_rows(k_bufs.index(st), bias_bufs.index(st), SUB, rope_o, v_oc,
                                     SUB)
                else:
                    _store_chunk(k_bufs.index(st), bias_bufs.index(st), SUB, x0, x1, x2, x3,
                                 x4, x5, x6, rope, sc_c, v_c, SUB)
                    _store_peer_rows(k_bufs.index(st), bias_bufs.index(st), 0, rope_o, v_oc,
                                     SUB)
            else:
                _store_chunk(k_bufs.index(st), bias_bufs.index(st), h * SUB, x0, x1, x2, x3,
                             x4, x5, x6, rope, sc_c, v_c, SUB)
        # generic-proxy stores -> the wgmma (async proxy) reads, and in a cluster the bulk
        # copy to the peer (async proxy too); all producer warps first
        fence_async_shared()
        barrier()
        if CLUSTER:
            _send_half(ready, st, rank, tid, BN, SUB, _SEND_V4, V4_PANELS)
        else:
            mbarrier.arrive(ready.index(st))
    async_copy.wait_group(0)    # the gather issued past the last chunk (all rows masked)
    if CLUSTER and ALONE:
        _pair_drain(empty, peer_free, n_tiles, rank, tid, STAGES)


@gluon.jit
def _store_chunk(kb, bias, r0: gl.constexpr, x0, x1, x2, x3, x4, x5, x6, rope, sc, valid,
                 SUB: gl.constexpr, half=None):
    """One dequantized chunk of V4 rows into rows [r0, r0 + SUB) of a stage, and its bias
    (``half``, a run-time index: rows [half · SUB, half · SUB + SUB) instead, ``_panel``)."""
    _store_v4(kb, r0, SUB, x0, x1, x2, x3, x4, x5, x6, rope, sc, half)
    _bias_rows(bias, r0, SUB, half).store(gl.where(valid, 0.0, float("-inf")))


@gluon.jit
def _store_peer_rows(kb, bias, r0: gl.constexpr, rope, valid, SUB: gl.constexpr, half=None):
    """What a cluster CTA writes itself of the peer's V4 rows [r0, r0 + SUB) (or, with
    ``half``, [half · SUB, half · SUB + SUB)): their RoPE dims (copied from the cache, no
    decoding) and their bias."""
    _panel(kb, 7, r0, SUB, half).store(rope)
    _bias_rows(bias, r0, SUB, half).store(gl.where(valid, 0.0, float("-inf")))


@gluon.jit
def _bias_rows(bias, r0: gl.constexpr, SUB: gl.constexpr, half):
    """Rows [r0, r0 + SUB) of a stage's bias, or with ``half`` (run time) rows
    [half · SUB, half · SUB + SUB): the bias seen as [BN / SUB, SUB]."""
    if half is not None:
        view = reinterpret2(bias, bias.dtype, bias.shape[0] // SUB, SUB,
                            gl.SwizzledSharedLayout(1, 1, 1, [0])).index(half)
    else:
        view = bias.slice(r0, SUB)
    return view


@gluon.jit
def _store_v32_rows(kb, krb, rec, valid, LR: gl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7,
                    sa, sb, sc, sd):
    """Gathered V3.2 rows into a stage's rows (``kb``: latent dims, ``krb``: RoPE dims). The
    RoPE dims need no decoding: copied asynchronously while the latent dims are dequantized
    (and 16 registers lighter than a load); waited for before returning."""
    _rope_v32(krb, rec, valid, LR)
    async_copy.commit_group()
    _store_v32(kb, 0, x0, x1, sa)
    _store_v32(kb, 1, x2, x3, sb)
    _store_v32(kb, 2, x4, x5, sc)
    _store_v32(kb, 3, x6, x7, sd)
    async_copy.wait_group(0)


@gluon.jit
def _produce_v32_pair(k_bufs, kr_bufs, stage_raw, stage_sc, bias_bufs, ready, empty, peer_free,
                      t, lo, hi, n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                      i0_ptr, i0_s0, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0,
                      BN: gl.constexpr, STAGES: gl.constexpr, P_WARPS: gl.constexpr,
                      rank, g0, ALONE: gl.constexpr):
    """The producer of a cluster over the V3.2 cache: this CTA's 32-row half of every tile,
    stored here and copied into the peer's stage. The RoPE dims of the peer's half are copied
    here from the cache, like this CTA's own (they need no decoding, and the cluster copies
    cost by the byte), and its bias is written here.

    The first two pairs of panels (and their scales) of the next tile are copied into
    ``stage_raw`` / ``stage_sc`` by cp.async a tile ahead; the last two are loaded into
    registers at the top of the tile, so their latency passes while the first two are
    stored. Loading whole tiles into registers left the latency exposed: per-tile %clock64
    stamps had the lead waiting a quarter of each tile for its stage (lab/perf-log.md, "V3.2
    cluster timeline"). Registers cannot carry the next tile instead: a pair-by-pair register
    pipeline was slower, because ptxas puts every load of the loop on one scoreboard and the
    first use of any waits for all (8 KB of shared memory is all there is for staging; same
    section). Nor can the register half be loaded at the end of the tile before: the first
    load after the back edge, or the hand-off's wait loop entered with loads in flight, then
    waits for all of them (lab/perf-log.md, "V3.2 cluster bounds").

    The ring's tiles are g0 .. g0 + n_tiles - 1, as ``_produce_v4``'s (``ALONE``: this
    program's one token; else a persistent program's, whose caller syncs and drains once)."""
    LB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [P_WARPS, 1], [1, 0])
    rows_b: gl.constexpr = gl.SliceLayout(1, LB)
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))
    SUB: gl.constexpr = PAIR_SUB
    gl.static_assert(BN == 2 * PAIR_SUB)
    tid = _thread_ids(P_WARPS)
    first = lo + rank * SUB
    other = lo + (1 - rank) * SUB       # the peer's half: only its RoPE dims are copied here
    if ALONE:
        _cluster_sync(tid, _CLUSTER_ARRIVE)
    idx = _slots(first, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
    idx_o = _slots(other, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
    if ALONE:
        _cluster_sync(tid, _CLUSTER_WAIT)
    # both halves of a tile come from one source (source 0's columns are padded to BN). The
    # staging of the first tile and (in the loop) of the next one stay written out: folded
    # into _stage_v32, these values stop being loop-carried, ptxas reschedules the dequant,
    # and V3.2 h128 ran slower (lab/perf-log.md, "Symmetric consumers (dropped)")
    cache, s0, s1, bs, cap = tile_source(first < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                         c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap)
    valid = _usable(idx, cap)
    _stage_v32(stage_raw, stage_sc, _record(cache, s0, bs, idx, V32_RECORD), valid, cb)
    for i in range(n_tiles):
        g = g0 + i
        st = g % STAGES
        c = first + i * BN
        idx_next = _slots(c + BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                          rows_b)
        c_o = other + i * BN
        idx_o_next = _slots(c_o + BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                            rows_b)
        cache, s0, s1, bs, cap = tile_source(c < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                             c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap)
        # recomputed although the staging below had them: carried over the back edge
        # instead, V3.2 h128 ran slower (lab/perf-log.md, "V3.2 cluster bounds")
        valid = _usable(idx, cap)
        rec = _record(cache, s0, bs, idx, V32_RECORD)
        x4, x5, x6, x7, sc, sd = _load_v32_tail(rec, valid, cb)
        valid_o = _usable(idx_o, cap)
        rec_o = _record(cache, s0, bs, idx_o, V32_RECORD)
        _pair_handoff(empty, peer_free, g, rank, tid, STAGES)
        bias = gl.where(valid, 0.0, float("-inf"))
        bias_o = gl.where(valid_o, 0.0, float("-inf"))
        # the RoPE dims of both halves by cp.async (32 bytes per thread: _rope_v32's whole-
        # sector layout was no faster here, lab/perf-log.md, "bf16 rows in whole sectors");
        # the latent dims a pair of panels at a time, sent as soon as stored (the two staged
        # pairs as one batch: one fence and one copy issue fewer, lab/perf-log.md, "V3.2
        # cluster bounds"), so the copies overlap the rest's dequantization (faster than one
        # batch for V3.2; V4's producer lost to a second batch's barrier: lab/perf-log.md,
        # "Cluster exchange")
        if rank == 0:     # static slice starts: one branch per rank
            _rope_v32(kr_bufs.index(st).slice(SUB, SUB), rec_o, valid_o, LB)
            _rope_v32(kr_bufs.index(st).slice(0, SUB), rec, valid, LB)
        else:
            _rope_v32(kr_bufs.index(st).slice(0, SUB), rec_o, valid_o, LB)
            _rope_v32(kr_bufs.index(st).slice(SUB, SUB), rec, valid, LB)
        async_copy.commit_group()
        async_copy.wait_group(1)    # this tile's staged panels
        barrier()     # a scale is copied by one of the four threads that read it
        x0 = stage_raw.index(0).load(LB)
        x1 = stage_raw.index(1).load(LB)
        sa = stage_sc.index(0).load(rows_b)
        _store_pair_v32(k_bufs, st, rank, 0, x0, x1, sa, SUB)
        x2 = stage_raw.index(2).load(LB)
        x3 = stage_raw.index(3).load(LB)
        sb = stage_sc.index(1).load(rows_b)
        _send_pair_v32(k_bufs, ready, st, rank, tid, 1, x2, x3, sb, BN, SUB, _SEND_V32_STAGED)
        # the next tile's first pairs, once these have left the staging buffer
        cache, s0, s1, bs, cap = tile_source(c + BN < n0p, c0_ptr, c0_s0, c0_s1, c0_bs,
                                             c0_cap, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap)
        _stage_v32(stage_raw, stage_sc, _record(cache, s0, bs, idx_next, V32_RECORD),
                   _usable(idx_next, cap), cb)
        _send_pair_v32(k_bufs, ready, st, rank, tid, 2, x4, x5, sc, BN, SUB, _SEND_V32_2)
        _store_pair_v32(k_bufs, st, rank, 3, x6, x7, sd, SUB)
        if rank == 0:
            bias_bufs.index(st).slice(0, SUB).store(bias)
            bias_bufs.index(st).slice(SUB, SUB).store(bias_o)
        else:
            bias_bufs.index(st).slice(SUB, SUB).store(bias)
            bias_bufs.index(st).slice(0, SUB).store(bias_o)
        async_copy.wait_group(1)    # the RoPE dims (the next tile's staging may still fly)
        fence_async_shared()
        barrier()
        _send_half(ready, st, rank, tid, BN, SUB, _SEND_V32_3, V32_PANELS)
        idx = idx_next
        idx_o = idx_o_next
    async_copy.wait_group(0)    # the staging past the last tile (nothing) before exit
    if ALONE:
        _pair_drain(empty, peer_free, n_tiles, rank, tid, STAGES)
