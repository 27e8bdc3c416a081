"""Warp-specialized Hopper (sm_90) split kernel of the attention core, written in Gluon.

Same contract as ``sparse_attention_portable._split_kernel`` (one program per token × 64-head
block × split of the token's virtual key list; partial out / lse2 / max written for the
combine kernel) for keys in the V4 584 B cache, the V3.2 656 B cache or a plain bf16 / e4m3
cache of 512- or 576-wide rows, but the work is divided between warps instead of serialised
in each warp:

* a 4-warp **producer** gathers BLOCK_N key rows into a bf16 [BLOCK_N, 512] tile of a
  two-stage shared-memory ring, then signals an mbarrier. V4 rows: 448 e4m3 bytes, 64 bf16
  RoPE dims and the eight UE8M0 scale bytes as one int64, dequantized once (``_produce_v4``:
  where every block starts 16-byte aligned the raw records go through an 18 KB staging
  buffer by cp.async, SUB_N rows at a time, one chunk ahead of the dequantization;
  otherwise they are loaded into registers a tile at a time); V3.2 rows: 512
  e4m3 bytes times four fp32 scales; plain e4m3 rows are converted (their per-tensor scale is
  folded into the softmax / output scales outside); plain bf16 rows and V3.2's bf16 RoPE dims
  are copied with cp.async, never passing through registers. 576-wide keys (V3.2, 576-wide
  plain rows) put their last 64 dims, which score but are not values, in a [BLOCK_N, 64]
  stage of their own (q's in a [64, 64] buffer): 231,272 of sm_90's 232,448 shared bytes
  (the V3.2 clusters put p in the RoPE stages and stage part of the next tile: 231,576);
* at 65-128 heads over the V4 or V3.2 cache (``CLUSTER``) the token's two head blocks run
  as a 2-CTA cluster: each producer dequantizes half of every tile and copies the
  dequantized dims into its peer's stage as well (see "2-CTA clusters" below);
* two **consumer** warpgroups run q·kᵀ and p·v on the tensor cores straight from the ring,
  split as FlashMLA's sm_90 decode kernel splits them: ``_lead`` computes the whole score
  tile, the softmax and p·v for output dims [0, 256); ``_follow`` does p·v for [256, 512)
  with the lead's p from shared memory, so its p·v of tile i overlaps the lead's q·k of tile
  i+1. (The earlier split — scores by key columns, accumulator by output dims in one 8-warp
  partition — read q from shared memory twice per tile and reduced every row across both
  warpgroups: 5-15 % slower, docs/perf-log.md, "Lead and follow consumers".)

An e4m3 q is decoded once, into shared memory, by the lead warpgroup: to fp16 when the keys
are plain e4m3 too, and the dots then run on fp16 operands (exact, like bf16, but e4m3 -> fp16
is one conversion per two bytes and e4m3 -> bf16 three: the fp8 producer was conversion-bound;
the V4 producer, at two per pair, is not: docs/perf-log.md, "V3.2 and 576-wide rows on sm_90"). Only used on sm_90
with a Triton in ``attention_plan.GLUON_TRITON`` (3.6-3.9: the Gluon API differences between
them are the shims of ``gluon_compat``); ``attention_plan.plan_launch`` routes to the
portable kernel everywhere else and for tiny launches of one head block, and says why.
Importing this module installs ``gluon_hooks``' compile hook. docs/perf-log.md has the
measurements (including what was tried and dropped: a software-pipelined producer, integer
e4m3 decoding).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from sparse_mla.ops.common import cluster_ptx, formats, gluon_hooks
from sparse_mla.ops.common.gluon_compat import PANEL_VIEWS, async_load, barrier, reinterpret
from sparse_mla.ops.common.sparse_attention_portable import (
    key_run, sink_gate, slot_row, softmax_step, tile_source)
from sparse_mla.ops.common.triton_utils import grid_launch_dependents, grid_wait

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
HEADS = gl.constexpr(64)         # rows of one program: the wgmma M of each warpgroup
BLOCK_N = 64         # keys per ring stage (64 KB of bf16)
SUB_N = 32           # V4 rows per staged gather chunk (18 KB of staging)
STAGE_V4 = True      # V4 rows gathered through the staging buffer (16-byte-aligned blocks)
STAGES = 2           # q (64 KB) + two stages fill the 227 KB of shared memory
PRODUCER_WARPS = 4
PRODUCER_REGS = 120  # setmaxnreg for the producer (H200: 120 beats 96 by 7-16 %, docs/perf-log.md)
PRODUCER_REGS_CLUSTER = 128     # in clusters (the lead keeps 208): H200 V4 h128 +4.6-5.1 %,
                                # V3.2 +0.9 %; one CTA at h64 lost 4 % at 128 (docs/perf-log.md, "Cluster exchange")
FOLLOW_REGS = 168    # setmaxnreg for _follow (152 spills); _lead gets the rest of the
                     # 12-warp budget: 216
CLUSTER_V4 = True    # V4 rows at 65-128 heads: the token's two head blocks run as a 2-CTA
                     # cluster and each CTA dequantizes half of every tile (``_send_half``)
CLUSTER_V32 = True   # the same for V3.2 rows
# V4 rows outside clusters and plain e4m3 rows: the first two tiles' slot ids are loaded
# together with the lengths, before the partitions start, instead of after them by the
# producer (one dependent round trip less before the first gather), and the producer then
# loads ids two tiles ahead (``_early_slots``). H200: V4 h64 and e4m3 1-3 % faster; plain
# bf16 rows 1-8 % slower at batch 256 (either way), so not for them; V3.2 rows' producer
# spills with it (docs/perf-log.md, "Slot ids loaded with the lengths")
EARLY_SLOTS = gl.constexpr(True)

# --- 2-CTA clusters (V4 / V3.2 rows, two head blocks of one token) --------------------------
# Both CTAs of a cluster read the same key rows. Each one's producer gathers and dequantizes
# one 32-row half of every 64-row tile (rank 0 rows [0, 32), rank 1 rows [32, 64)), stores it
# in its own stage and copies its dequantized panels into the peer's with ``cp.async.bulk``
# shared::cta -> shared::cluster, completing bytes on the peer's ``ready``. The copies cost
# by the byte (docs/perf-log.md, "Cluster exchange"), so what needs no decoding (the RoPE dims) and the bias
# each CTA writes for the peer's rows itself. Since either producer writes both
# CTAs' stages, the producers hand each released stage over to each other (``_pair_handoff``).
# FlashMLA's sm_90 kernel splits its h128 dequantization the same way. Gluon (Triton 3.6) has
# no API for any of it: the kernel is compiled as an ordinary one-CTA kernel and launched as
# clusters (``gluon_hooks.cluster_launchable``), and inline PTX addresses shared memory as
# ``global_smem`` plus the allocator's offsets, which ``gluon_hooks`` reads at compile time
# and writes over the ``SMLA_OFF_*`` placeholders of ``cluster_ptx`` (tools/dev/probe_cluster.py
# proved the route).
PAIR_SUB = gl.constexpr(cluster_ptx.PAIR_SUB)
V32_RECORD = gl.constexpr(formats.V32.bytes_per_token)     # bytes of a V3.2 record
V32_SCALES = gl.constexpr(formats.V32.scale_offset)        # its four fp32 scales' byte offset
V32_ROPE = gl.constexpr(formats.V32.rope_offset)           # its bf16 RoPE dims' byte offset
# e4m3 panels of the next tile's V3.2 rows that the cluster producer stages by cp.async (the
# first two pairs: 8 KB, what is left once p shares the RoPE stages: _p_buf); they go to the
# peer as the first copy batch, so that batch defines them
V32_STAGED_PANELS = gl.constexpr(cluster_ptx.V32_SENDS[0][1])
PANEL_TX = gl.constexpr(cluster_ptx.PANEL_TX)
_SEND_V4 = gl.constexpr(cluster_ptx.send_panels(*cluster_ptx.V4_SENDS[0]))
V4_PANELS = gl.constexpr(cluster_ptx.sent_panels(cluster_ptx.V4_SENDS))
_SEND_V32_STAGED, _SEND_V32_2, _SEND_V32_3 = (
    gl.constexpr(cluster_ptx.send_panels(*b)) for b in cluster_ptx.V32_SENDS)
V32_PANELS = gl.constexpr(cluster_ptx.sent_panels(cluster_ptx.V32_SENDS))
_REMOTE_ARRIVE = gl.constexpr(cluster_ptx.REMOTE_ARRIVE)
_CLUSTER_ARRIVE_INIT = gl.constexpr(cluster_ptx.CLUSTER_ARRIVE_INIT)
_CLUSTER_ARRIVE = gl.constexpr(cluster_ptx.CLUSTER_ARRIVE)
_CLUSTER_WAIT = gl.constexpr(cluster_ptx.CLUSTER_WAIT)


gluon_hooks.install()


def launch_constexprs(fmt, *, has_l0, has_l1, has_src1, track_max, n_units, scale_t, q_fp8,
                      final, has_sink, has_lse, out_scale_t, pdl, d576, f16, staged, cluster):
    """``_ws_kernel``'s compile-time parameters (and ``num_warps``) for one launch variant:
    ``fmt`` is the cache format's code (``sparse_attention_triton.FMT_CODES``). Shared by the
    launch and by the compile-only check (``sm90_variants``), so both build the same kernel."""
    return dict(
        FMT=fmt, HAS_L0=has_l0, HAS_L1=has_l1, HAS_SRC1=has_src1, BN=BLOCK_N, STAGES=STAGES,
        TRACK_MAX=track_max, N_UNITS=n_units, SCALE_T=scale_t, P_WARPS=PRODUCER_WARPS,
        P_REGS=PRODUCER_REGS_CLUSTER if cluster else PRODUCER_REGS, Q_FP8=q_fp8, FINAL=final,
        HAS_SINK=has_sink, HAS_LSE=has_lse, OUT_SCALE_T=out_scale_t, F_REGS=FOLLOW_REGS,
        PDL=pdl, D576=d576, F16=f16, SUB=SUB_N, STAGED=staged, CLUSTER=cluster, num_warps=4)


@gluon.jit
def _produce(k_bufs, kr_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free,
             early, t, lo, hi,
             n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
             c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0,
             FMT: gl.constexpr, D576: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
             P_WARPS: gl.constexpr, STAGED: gl.constexpr,
             SUB: gl.constexpr, rank, CLUSTER: gl.constexpr, EARLY: gl.constexpr):
    """The producer partition: V4 rows through the staging buffer where ``STAGED`` (half of
    each tile where ``CLUSTER``), else a tile at a time (``_produce_tiles``)."""
    if CLUSTER and FMT == 1:
        _produce_v32_pair(k_bufs, kr_bufs, stage_raw, stage_rope, bias_bufs, ready, empty,
                          peer_free, t, lo, hi,
                          n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr,
                          i0_s0, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN,
                          STAGES, P_WARPS, rank)
    elif STAGED:
        _produce_v4(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free, early,
                    t, lo, hi,
                    n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                    c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN, SUB, STAGES,
                    P_WARPS, rank, CLUSTER, EARLY)
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
    if FMT == 2:
        # plain bf16 rows, [BN, 64] slices: 16 bytes per thread, 8 threads a 128-byte line.
        # At 32 bytes per thread (the byte tiles' layout below) each 16-byte cp.async
        # covered half of every sector it touched, so every sector was asked for twice: H200
        # h64 W128+512 B64 30.1 -> 27.7 µs (78 -> 85 % of copy), docs/perf-log.md, "bf16 rows in whole sectors"
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
        if FMT == 0:
            x0, x1, x2, x3, x4, x5, x6, rope, sc = _gather_v4(cache, s0, bs, idx, valid, cb)
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            _store_v4(kb, 0, BN, x0, x1, x2, x3, x4, x5, x6, rope, sc)
        elif FMT == 1:
            # V3.2 records: 512 e4m3 bytes, four fp32 scales (one per 128 dims), 64 bf16 RoPE
            # dims. The RoPE dims need no decoding: copied asynchronously into their own stage
            # while the 512 latent dims are dequantized (and 16 registers lighter than a load)
            rec, x0, x1, x2, x3, x4, x5, x6, x7, sa, sb, sc, sd = _gather_v32(
                cache, s0, bs, idx, valid, cb)
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            _store_v32_rows(kb, kr_bufs.index(st), rec, valid, LR, x0, x1, x2, x3, x4, x5, x6,
                            x7, sa, sb, sc, sd)
        elif FMT == 2:
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
        # copies here left one tile in flight at a time (bf16 rows at 63-75 % of copy).
        fence_async_shared()
        barrier()
        mbarrier.arrive(ready.index(st))
        if EARLY:
            idx = idx1
            idx1 = idx_next
        else:
            idx = idx_next
    if FMT == 2:
        async_copy.wait_group(0)    # nothing left in flight when the partition ends


@gluon.jit
def _produce_v4(k_bufs, stage_raw, stage_rope, bias_bufs, ready, empty, peer_free, early, t,
                lo, hi, n_tiles,
                n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN: gl.constexpr,
                SUB: gl.constexpr, STAGES: gl.constexpr, P_WARPS: gl.constexpr,
                rank, CLUSTER: gl.constexpr, EARLY: gl.constexpr):
    # V4 rows go global -> staging buffer by cp.async, SUB rows at a time, one chunk ahead:
    # chunk j+1's gather is in flight, holding no registers, while chunk j is dequantized
    # (gathering a whole tile into registers left the producer waiting on its loads:
    # docs/perf-log.md, "Lead and follow consumers", "V4 rows staged by cp.async"). Each thread reads back exactly the bytes its own cp.async
    # wrote (one layout for both), so its wait_group is all the staging buffer needs.
    # In a cluster (``CLUSTER``) the chunk is this CTA's half of each tile, sent on to the
    # peer: chunks are then BN columns apart, one per tile.
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
        _cluster_sync(tid, _CLUSTER_WAIT)
    else:
        idx = _early_slots(early, STEP, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0,
                           SUB, rows_b, EARLY)
    for i in range(n_tiles):
        st = i % STAGES
        for h in gl.static_range(CH):     # static: shared-memory slices need constant starts
            async_copy.wait_group(0)
            x0 = stage_raw.slice(0 * SUB, SUB).load(LB)
            x1 = stage_raw.slice(1 * SUB, SUB).load(LB)
            x2 = stage_raw.slice(2 * SUB, SUB).load(LB)
            x3 = stage_raw.slice(3 * SUB, SUB).load(LB)
            x4 = stage_raw.slice(4 * SUB, SUB).load(LB)
            x5 = stage_raw.slice(5 * SUB, SUB).load(LB)
            x6 = stage_raw.slice(6 * SUB, SUB).load(LB)
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
                    _pair_handoff(empty, peer_free, i, rank, tid, STAGES)
                else:
                    mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            if CLUSTER:     # static slice starts: one branch per rank
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
    if CLUSTER:
        _pair_drain(empty, peer_free, n_tiles, rank, tid, STAGES)


@gluon.jit
def _pair_handoff(empty, peer_free, i, rank, tid, STAGES: gl.constexpr):
    """Before tile ``i`` is written into stage i % STAGES of both CTAs: wait until this CTA's
    consumers have released the stage, tell the peer's producer so (a remote arrive on its
    ``peer_free``; a stage's first use needs no release), and wait for the peer's word that
    its consumers have too. Only the producers touch the peer's barriers, so the consumers'
    loops are unchanged (a remote arrive there made the lead spill)."""
    st = i % STAGES
    phase = ((i // STAGES) & 1) ^ 1
    mbarrier.wait(empty.index(st), phase)
    if i >= STAGES:
        gl.inline_asm_elementwise(_REMOTE_ARRIVE, "=r,r,r,r", [tid, tid * 0 + st * 8,
                                                                tid * 0 + (1 - rank)],
                                  dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.wait(peer_free.index(st), phase)


@gluon.jit
def _pair_drain(empty, peer_free, n_tiles, rank, tid, STAGES: gl.constexpr):
    """A cluster producer's last hand-offs, as if for tiles n_tiles .. n_tiles + STAGES - 1:
    this CTA must not exit while the peer may still arrive here or its copy may still read
    this CTA's last halves (the peer's consumers are done with them once it has handed them
    back)."""
    for s in gl.static_range(STAGES):
        _pair_handoff(empty, peer_free, n_tiles + s, rank, tid, STAGES)


@gluon.jit
def _store_chunk(kb, bias, r0: gl.constexpr, x0, x1, x2, x3, x4, x5, x6, rope, sc, valid,
                 SUB: gl.constexpr):
    """One dequantized chunk of V4 rows into rows [r0, r0 + SUB) of a stage, and its bias."""
    _store_v4(kb, r0, SUB, x0, x1, x2, x3, x4, x5, x6, rope, sc)
    bias.slice(r0, SUB).store(gl.where(valid, 0.0, float("-inf")))


@gluon.jit
def _store_peer_rows(kb, bias, r0: gl.constexpr, rope, valid, SUB: gl.constexpr):
    """What a cluster CTA writes itself of the peer's V4 rows [r0, r0 + SUB): their RoPE
    dims (copied from the cache, no decoding) and their bias."""
    _panel(kb, 7, r0, SUB).store(rope)
    bias.slice(r0, SUB).store(gl.where(valid, 0.0, float("-inf")))


@gluon.jit
def _thread_ids(WARPS: gl.constexpr):
    """0 .. 32·WARPS - 1, one per thread of the calling partition: the operand that lets
    inline PTX run once per thread and elect thread 0."""
    return gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))


@gluon.jit
def _cluster_sync(tid, ASM: gl.constexpr):
    """One of the ``barrier.cluster`` steps (``_CLUSTER_*``), by every thread of the caller."""
    gl.inline_asm_elementwise(ASM, "=r,r", [tid], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dequant_bf16(x, sb):
    """e4m3 bytes × 2^(sb - 127) as bf16, the multiply in bf16x2: each byte pair is converted
    exactly (e4m3x2 -> f16x2 -> two f32 -> bf16x2) and scaled by one mul.rn.bf16x2, which
    rounds like the fp32 product's rounding to bf16 (the reference's), NaN bytes stay NaN.
    One instruction a pair fewer than two fp32 multiplies."""
    f = gl.where(sb == 0, 0x40, sb << 7)        # 2^(sb - 127) as bf16 bits (sb 0: subnormal)
    f = gl.broadcast(f | (f << 16), x.to(gl.int32))[0]
    return gl.inline_asm_elementwise(_DEQUANT_PAIRS, "=r,=r,r,r,r,r,r", [x, f],
                                     dtype=gl.bfloat16, is_pure=True, pack=4)


# One e4m3 byte pair (16-bit register {pair}) -> bf16x2 output {out}, scaled by $3
_DEQUANT_PAIR = """
    cvt.rn.f16x2.e4m3x2 w, {pair};
    mov.b32 {{h0, h1}}, w;
    cvt.f32.f16 a, h0;
    cvt.f32.f16 b, h1;
    cvt.rn.bf16x2.f32 w, b, a;
    mul.rn.bf16x2 {out}, w, $3;"""
# four bytes ($2) -> two bf16x2 outputs ($0, $1)
_DEQUANT_PAIRS = gl.constexpr("""{
    .reg .b16 p0, p1, h0, h1;
    .reg .b32 w;
    .reg .f32 a, b;
    mov.b32 {p0, p1}, $2;""" + _DEQUANT_PAIR.format(pair="p0", out="$0")
                              + _DEQUANT_PAIR.format(pair="p1", out="$1") + """
    }""")


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
def _v4_records(cache, s0, bs, idx, valid):
    """Byte address of each slot's 576-byte V4 record (e4m3 dims, then RoPE dims) and its
    eight UE8M0 scale bytes, loaded as one int64 (0 where not ``valid``); a block holds
    ``bs`` records, then their scales."""
    # Spelled out, not through _record: with the block's address shared by both pointers
    # (b86fd5b) the h128 clusters ran 5-7 % slower (H200, docs/perf-log.md, "Refactor regression undone"), though
    # the PTX had the same instructions in a different order
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
def _store_e4m3(kb, TILE: gl.constexpr, x):
    """Plain e4m3 bytes (per-tensor scale, applied outside the kernel) as the stage's bf16 or
    fp16: exact either way (fp16 takes one conversion per two bytes, bf16 three)."""
    kb.slice(64 * TILE, 64, dim=1).store(x.to(gl.float8e4nv, bitcast=True).to(kb.dtype))


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
def _slots(c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, BN: gl.constexpr,
           layout: gl.constexpr):
    """Slot ids of virtual columns [c, c + BN) (-1 where unusable or at/after ``hi``), in
    ``layout`` (the portable kernel's ``_tile_slots`` with an explicit layout)."""
    row, col, n = slot_row(c, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0)
    cols = col + gl.arange(0, BN, layout=layout)
    return gl.load(row + cols, mask=cols < n, other=-1)


@gluon.jit
def _store_v4(kb, r0: gl.constexpr, rows: gl.constexpr, x0, x1, x2, x3, x4, x5, x6, rope, sc):
    """Dequantized V4 rows into rows [r0, r0 + rows) of stage ``kb``: seven e4m3 64-dim
    tiles, then the bf16 RoPE dims."""
    _panel(kb, 0, r0, rows).store(_dequant(x0, sc, 0))
    _panel(kb, 1, r0, rows).store(_dequant(x1, sc, 1))
    _panel(kb, 2, r0, rows).store(_dequant(x2, sc, 2))
    _panel(kb, 3, r0, rows).store(_dequant(x3, sc, 3))
    _panel(kb, 4, r0, rows).store(_dequant(x4, sc, 4))
    _panel(kb, 5, r0, rows).store(_dequant(x5, sc, 5))
    _panel(kb, 6, r0, rows).store(_dequant(x6, sc, 6))
    _panel(kb, 7, r0, rows).store(rope)


@gluon.jit
def _panel(kb, j: gl.constexpr, r0: gl.constexpr, rows: gl.constexpr):
    """Dims [64 j, 64 j + 64) of rows [r0, r0 + rows) of a [BN, 512] stage, for a store.
    With ``PANEL_VIEWS`` the view is panel j of the stage seen as the [8, BN, 64] panels
    its 128-byte swizzle lays out (the same bytes): Triton 3.7+ folds a column slice's
    offset into the swizzle's XOR, so each panel's store address was a register of its own
    (seven more live in the producer loop, where 3.6 used one with immediate offsets), and
    ptxas then kept the V4 dequantization behind the stage hand-off's wait instead of
    overlapping it (``gluon_compat``, 3.7; H100 timing pending)."""
    if PANEL_VIEWS:
        view = reinterpret(kb, kb.dtype, 8, kb.shape[0], 64, gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2)).index(j)
        if rows != kb.shape[0]:
            view = view.slice(r0, rows)
    elif rows == kb.shape[0]:
        view = kb.slice(64 * j, 64, dim=1)
    else:
        view = kb.slice(r0, rows).slice(64 * j, 64, dim=1)
    return view


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
    cp.async covers whole sectors (``_produce_tiles``' bf16 note): H200 V3.2 h64 1.09-1.12x,
    docs/perf-log.md, "bf16 rows in whole sectors"."""
    rows: gl.constexpr = gl.SliceLayout(1, LR)
    rope = gl.convert_layout(rec, rows) + V32_ROPE
    cr = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
    async_load(
        krb, rope.to(gl.pointer_type(gl.bfloat16))[:, None] + cr[None, :],
        mask=gl.convert_layout(valid, rows)[:, None])


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
                      rank):
    """The producer of a cluster over the V3.2 cache: this CTA's 32-row half of every tile,
    stored here and copied into the peer's stage. The RoPE dims of the peer's half are copied
    here from the cache, like this CTA's own (they need no decoding, and the cluster copies
    cost by the byte), and its bias is written here.

    The first two pairs of panels (and their scales) of the next tile are copied into
    ``stage_raw`` / ``stage_sc`` by cp.async a tile ahead; the last two are loaded into
    registers at the top of the tile, so their latency passes while the first two are
    stored. Loading whole tiles into registers left the latency exposed: per-tile %clock64
    stamps (H200, h128 b64 s_q2, docs/perf-log.md, "V3.2 cluster timeline") had the lead waiting 1,200 of a
    4,600-cycle tile for its stage. Registers cannot carry the next tile instead: a
    pair-by-pair register pipeline ran 0.92x, because ptxas puts every load of the loop on
    one scoreboard and the first use of any waits for all (8 KB of shared memory is all
    there is for staging: V3.2 h128 b64 s_q2 1.026x). Nor can the register half be loaded
    at the end of the tile before: the first load after the back edge, or the hand-off's
    wait loop entered with loads in flight, then waits for all of them (0.84-0.86x,
    docs/perf-log.md, "V3.2 cluster bounds")."""
    LB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [P_WARPS, 1], [1, 0])
    rows_b: gl.constexpr = gl.SliceLayout(1, LB)
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))
    SUB: gl.constexpr = PAIR_SUB
    gl.static_assert(BN == 2 * PAIR_SUB)
    tid = _thread_ids(P_WARPS)
    first = lo + rank * SUB
    other = lo + (1 - rank) * SUB       # the peer's half: only its RoPE dims are copied here
    _cluster_sync(tid, _CLUSTER_ARRIVE)
    idx = _slots(first, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
    idx_o = _slots(other, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB, rows_b)
    _cluster_sync(tid, _CLUSTER_WAIT)
    # both halves of a tile come from one source (source 0's columns are padded to BN). The
    # staging of the first tile and (in the loop) of the next one stay written out: folded
    # into _stage_v32, these values stop being loop-carried, ptxas reschedules the dequant,
    # and V3.2 h128 b148 / b256 ran 0.97-0.99x (H200, docs/perf-log.md, "Symmetric consumers (dropped)")
    cache, s0, s1, bs, cap = tile_source(first < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                         c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap)
    valid = _usable(idx, cap)
    _stage_v32(stage_raw, stage_sc, _record(cache, s0, bs, idx, V32_RECORD), valid, cb)
    for i in range(n_tiles):
        st = i % STAGES
        c = first + i * BN
        idx_next = _slots(c + BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                          rows_b)
        c_o = other + i * BN
        idx_o_next = _slots(c_o + BN, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                            rows_b)
        cache, s0, s1, bs, cap = tile_source(c < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                             c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap)
        # recomputed although the staging below had them: carried over the back edge
        # instead, V3.2 h128 ran 0.989-0.999x (H200, docs/perf-log.md, "V3.2 cluster bounds")
        valid = _usable(idx, cap)
        rec = _record(cache, s0, bs, idx, V32_RECORD)
        x4, x5, x6, x7, sc, sd = _load_v32_tail(rec, valid, cb)
        valid_o = _usable(idx_o, cap)
        rec_o = _record(cache, s0, bs, idx_o, V32_RECORD)
        _pair_handoff(empty, peer_free, i, rank, tid, STAGES)
        bias = gl.where(valid, 0.0, float("-inf"))
        bias_o = gl.where(valid_o, 0.0, float("-inf"))
        # the RoPE dims of both halves by cp.async (32 bytes per thread: _rope_v32's whole-
        # sector layout measured 0.994x here, H200 h128 b64 / b148, docs/perf-log.md, "bf16 rows in whole sectors");
        # the latent dims a pair of panels at a time, sent as soon as stored (the two staged
        # pairs as one batch: one fence and one copy issue fewer, 1.00-1.03x over four
        # batches, docs/perf-log.md, "V3.2 cluster bounds"), so the copies overlap the rest's dequantization
        # (V3.2 h128: 201.7 -> 189.9 us over one batch; V4's producer lost 2.5-4 % to a
        # second batch's barrier, docs/perf-log.md, "Cluster exchange")
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
    _pair_drain(empty, peer_free, n_tiles, rank, tid, STAGES)


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


@gluon.jit
def _send_half(ready, st, rank, tid, BN: gl.constexpr, SUB: gl.constexpr, PTX: gl.constexpr,
               EXPECT: gl.constexpr):
    """Dequantized 64-dim panels of this CTA's half of stage ``st`` (which: ``PTX``, one of
    the ``_SEND_*``) into the peer's, completing on the peer's ready[st] (thread 0 issues);
    then, where ``EXPECT`` > 0, this CTA's arrive on its own ready[st], expecting that many
    panels from the peer: it completes once they are here too (the rest of the peer's half
    each CTA writes itself: ``cluster_ptx``)."""
    zero = tid * 0
    k_off = zero + (st * (BN * 1024) + rank * (SUB * 128))
    gl.inline_asm_elementwise(PTX, "=r,r,r,r,r", [tid, k_off, zero + st * 8, zero + (1 - rank)],
                              dtype=gl.int32, is_pure=False, pack=1)
    if EXPECT > 0:
        mbarrier.expect(ready.index(st), EXPECT * PANEL_TX)


@gluon.jit
def _store_pair_v32(k_bufs, st, rank, PAIR: gl.constexpr, xa, xb, scale, SUB: gl.constexpr):
    """One ``_store_v32`` pair into this CTA's half (rank ``rank``) of stage ``st``."""
    if rank == 0:   # static slice starts: one branch per rank
        _store_v32(k_bufs.index(st).slice(0, SUB), PAIR, xa, xb, scale)
    else:
        _store_v32(k_bufs.index(st).slice(SUB, SUB), PAIR, xa, xb, scale)


@gluon.jit
def _send_pair_v32(k_bufs, ready, st, rank, tid, PAIR: gl.constexpr, xa, xb, scale,
                   BN: gl.constexpr, SUB: gl.constexpr, PTX: gl.constexpr):
    """One ``_store_v32`` pair of this CTA's half of stage ``st``, then its copy to the peer."""
    _store_pair_v32(k_bufs, st, rank, PAIR, xa, xb, scale, SUB)
    fence_async_shared()    # generic stores -> the bulk copy (async proxy); all warps first
    barrier()
    _send_half(ready, st, rank, tid, BN, SUB, PTX, 0)


@gluon.jit
def _store_v32(kb, PAIR: gl.constexpr, xa, xb, scale):
    """Dims [128 PAIR, 128 PAIR + 128) of V3.2 rows (two byte tiles sharing one fp32 scale):
    the fp32 product rounded to bf16, as the reference rounds it (FlashMLA's sm_90 kernel
    rounds the scale to bf16 first, docs/semantics.md §2.1: within tolerance of this, not bit-equal)."""
    kb.slice(128 * PAIR, 64, dim=1).store(_scaled(xa, scale[:, None]))
    kb.slice(128 * PAIR + 64, 64, dim=1).store(_scaled(xb, scale[:, None]))


@gluon.jit
def _scaled(x, scale):
    """e4m3 bytes × an fp32 scale (per row, broadcast), the product rounded to bf16."""
    return (x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16)


@gluon.jit
def _dequant(x, sc64, TILE: gl.constexpr):
    """e4m3 bytes × 2^(scale byte - 127) as bf16: exact where the product fits bf16, else
    rounded (or overflowed) as the reference rounds its fp32 product."""
    sb = ((sc64 >> (8 * TILE)) & 0xFF).to(gl.int32)
    return _dequant_bf16(x, sb[:, None])


@gluon.jit
def _lead(q_ptr, q_s0, q_s1, q_smem, qr_smem, k_bufs, kr_bufs, bias_bufs, p_smem, rows, ready,
          empty, p_full, p_free, done, n_tiles, scale2, part_o, part_ml, t, tp, h0, H, sp,
          n_splits, out_ptr, out_s0, out_s1, lse_ptr, lse_s0, lse_s1, mx_ptr, mx_s0, mx_s1,
          sink_ptr, out_scale, out_scale_ptr, BN: gl.constexpr, STAGES: gl.constexpr,
          TRACK_MAX: gl.constexpr, FINAL: gl.constexpr,
          HAS_SINK: gl.constexpr, HAS_LSE: gl.constexpr, OUT_SCALE_T: gl.constexpr,
          Q_FP8: gl.constexpr, D576: gl.constexpr, CLUSTER: gl.constexpr,
          P_IN_KR: gl.constexpr):
    # The scoring warpgroup: all of q·kᵀ ([64, BN], one wgmma reading q once: the two-way
    # column split read it twice), the softmax inside one warpgroup (no cross-warpgroup
    # reductions), then p into shared memory for _follow and p·v for output dims [0, 256)
    # from registers. _follow's p·v of tile i overlaps this warpgroup's q·k of tile i+1.
    # q is loaded here, not before the partitions start, so the producer's first gather does
    # not wait behind it (H200, one program: docs/perf-log.md, "Fixed per-call costs").
    if CLUSTER:
        tid = _thread_ids(4)
        _cluster_sync(tid, _CLUSTER_ARRIVE_INIT)
    _load_q_smem(q_ptr, q_s0, q_s1, q_smem, qr_smem, t, h0, H, Q_FP8, D576)
    if CLUSTER:
        _cluster_sync(tid, _CLUSTER_WAIT)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 256, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    acc = gl.zeros([HEADS, 256], gl.float32, O_L)
    s_init = gl.zeros([HEADS, BN], gl.float32, S_L)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([HEADS], gl.float32, ROW_S)
    mx = gl.full([HEADS], float("-inf"), gl.float32, ROW_S)
    for i in range(n_tiles):
        st = i % STAGES
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        kb = k_bufs.index(st)
        s = warpgroup_mma(q_smem, kb.permute((1, 0)), s_init, use_acc=False, is_async=True)
        if D576:    # the 64 RoPE dims of 576-wide keys score too (they are not values)
            s = warpgroup_mma(qr_smem, kr_bufs.index(st).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        bias = bias_bufs.index(st).load(gl.SliceLayout(0, S_L))
        s = s * scale2 + bias[None, :]
        p, alpha, m_new, l_i, m_tile = softmax_step(s, m_i, l_i)
        if TRACK_MAX:
            mx = gl.maximum(mx, m_tile)
        p16 = p.to(p_smem.dtype)
        mbarrier.wait(p_free, (i & 1) ^ 1)     # _follow is done with the last p
        _p_buf(p_smem, kr_bufs, st, P_IN_KR).store(p16)
        rows.index(0).store(alpha)
        fence_async_shared()                   # generic stores -> _follow's wgmma
        barrier()
        mbarrier.arrive(p_full)
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p16, P_L), kb.slice(0, 256, dim=1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        m_i = m_new
        barrier()
        mbarrier.arrive(empty.index(st))
    empty_row = l_i == 0.0
    inv_l = 1.0 / gl.where(empty_row, 1.0, l_i)
    lse2 = gl.where(empty_row, float("-inf"), m_i + gl.log2(gl.where(empty_row, 1.0, l_i)))
    h_s = h0 + gl.arange(0, HEADS, layout=ROW_S)
    lse = gl.where(empty_row, float("inf"), lse2 * LN2)
    gate = gl.full([HEADS], 1.0, gl.float32, ROW_S)
    if FINAL and HAS_SINK:
        gate = sink_gate(lse, gl.load(sink_ptr + h_s, mask=h_s < H, other=0.0), empty_row)
    # the row factors for _follow's half of the output
    rows.index(1).store(inv_l)
    rows.index(2).store(gate)
    rows.index(3).store(empty_row.to(gl.float32))
    barrier()
    mbarrier.arrive(done)
    _write_rows(acc, 0, gl.convert_layout(inv_l, ROW_O), gl.convert_layout(gate, ROW_O),
                gl.convert_layout(empty_row, ROW_O), part_o, t, tp, h0, H, sp, n_splits, out_ptr,
                out_s0, out_s1, out_scale, out_scale_ptr, _free_stage(k_bufs, n_tiles, 0, STAGES),
                O_L, FINAL, HAS_SINK, OUT_SCALE_T)
    if FINAL:
        if HAS_LSE:
            gl.store(lse_ptr + t.to(gl.int64) * lse_s0 + h_s * lse_s1, lse, mask=h_s < H)
        if TRACK_MAX:
            gl.store(mx_ptr + t.to(gl.int64) * mx_s0 + h_s * mx_s1, mx * LN2, mask=h_s < H)
    else:
        row_s = (tp.to(gl.int64) * H + h_s) * n_splits + sp
        gl.store(part_ml + row_s * 2, lse2, mask=h_s < H)
        if TRACK_MAX:
            gl.store(part_ml + row_s * 2 + 1, mx, mask=h_s < H)


@gluon.jit
def _load_q_smem(q_ptr, q_s0, q_s1, q_smem, qr_smem, t, h0, H, Q_FP8: gl.constexpr,
                 D576: gl.constexpr):
    """The program's [64, 512] q rows into shared memory as bf16, in two 256-column halves (a
    64-register peak; an e4m3 q is decoded here, exactly), and for 576-wide rows their 64
    RoPE dims into ``qr_smem``; visible to this warpgroup's wgmma."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    hq = h0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, 256, layout=gl.SliceLayout(0, QL))
    row = q_ptr + t.to(gl.int64) * q_s0 + hq[:, None] * q_s1
    for j in gl.static_range(2):
        q = gl.load(row + (256 * j + dq[None, :]), mask=(hq < H)[:, None], other=0)
        if Q_FP8:
            q = q.to(gl.float8e4nv, bitcast=True)
        q_smem.slice(256 * j, 256, dim=1).store(q.to(q_smem.dtype))
    if D576:
        q = gl.load(row + (512 + gl.arange(0, 64, layout=gl.SliceLayout(0, QL))[None, :]),
                    mask=(hq < H)[:, None], other=0)
        if Q_FP8:
            q = q.to(gl.float8e4nv, bitcast=True)
        qr_smem.store(q.to(qr_smem.dtype))
    fence_async_shared()    # generic stores -> this warpgroup's wgmma reads
    barrier()


@gluon.jit
def _follow(k_bufs, kr_bufs, p_smem, rows, ready, empty, p_full, p_free, done, n_tiles, part_o,
            t, tp, h0, H, sp, n_splits, out_ptr, out_s0, out_s1, out_scale, out_scale_ptr,
            STAGES: gl.constexpr, FINAL: gl.constexpr,
            HAS_SINK: gl.constexpr, OUT_SCALE_T: gl.constexpr, CLUSTER: gl.constexpr,
            P_IN_KR: gl.constexpr):
    # p·v for output dims [256, 512) with _lead's p (shared memory) and row rescale
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 256, 16])
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    acc = gl.zeros([HEADS, 256], gl.float32, O_L)
    if CLUSTER:
        tid = _thread_ids(4)
        _cluster_sync(tid, _CLUSTER_ARRIVE)
        _cluster_sync(tid, _CLUSTER_WAIT)
    for i in range(n_tiles):
        st = i % STAGES
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        mbarrier.wait(p_full, i & 1)
        acc = acc * rows.index(0).load(ROW_O)[:, None]
        acc = warpgroup_mma(_p_buf(p_smem, kr_bufs, st, P_IN_KR),
                            k_bufs.index(st).slice(256, 256, dim=1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        barrier()
        mbarrier.arrive(p_free)
        mbarrier.arrive(empty.index(st))
    mbarrier.wait(done, 0)
    _write_rows(acc, 256, rows.index(1).load(ROW_O), rows.index(2).load(ROW_O),
                rows.index(3).load(ROW_O) != 0.0, part_o, t, tp, h0, H, sp, n_splits, out_ptr,
                out_s0, out_s1, out_scale, out_scale_ptr, _free_stage(k_bufs, n_tiles, 1, STAGES),
                O_L, FINAL, HAS_SINK, OUT_SCALE_T)


@gluon.jit
def _p_buf(p_smem, kr_bufs, st, P_IN_KR: gl.constexpr):
    """Where _lead puts tile ``st``'s p for _follow: ``p_smem``, or where ``P_IN_KR`` the
    tile's own RoPE stage, free once q·kᵀ has read it and refilled only after _follow's
    release of the stage (the 8 KB it saves hold the V3.2 cluster producer's staging)."""
    if P_IN_KR:
        return kr_bufs.index(st)
    else:
        return p_smem


@gluon.jit
def _write_rows(acc, d0, inv_l, gate, empty_row, part_o, t, tp, h0, H, sp, n_splits, out_ptr,
                out_s0, out_s1, out_scale, out_scale_ptr, stage, O_L: gl.constexpr,
                FINAL: gl.constexpr, HAS_SINK: gl.constexpr, OUT_SCALE_T: gl.constexpr):
    """Output dims [d0, d0 + 256) of the program's rows: bf16 out when this is the token's
    only split (the combine kernel's arithmetic with one split, so the same bits), else the
    partial the combine kernel reads (``part_o``'s dtype: bf16, or fp32 where
    ``sparse_attention_triton.PARTIAL_DTYPE`` says so).

    bf16 rows go through ``stage`` (a K stage nobody reads or fills any more:
    ``_free_stage``), so each warp stores 512 contiguous bytes of one row. Stored straight
    from the wgmma fragments, each thread wrote 4 bytes at a time, and the epilogue cost
    4-16 % of the kernel (H200, docs/perf-log.md, "FlashMLA timed per layer"). fp32 partials are stored
    directly: through the stage they were 5-6 % slower at batch 2 and b64 h64 s_q1."""
    o = acc * inv_l[:, None]
    if FINAL:
        if HAS_SINK:
            o = o * gate[:, None]
        if OUT_SCALE_T:
            out_scale = gl.load(out_scale_ptr).to(gl.float32)
        o = gl.where(empty_row[:, None], 0.0, o * out_scale).to(gl.bfloat16)
        _store_staged(o, stage, out_ptr, t.to(gl.int64) * out_s0, out_s1, h0, H, d0)
    elif part_o.dtype.element_ty == gl.bfloat16:
        _store_staged(o.to(gl.bfloat16), stage, part_o,
                      (tp.to(gl.int64) * H * n_splits + sp) * 512, n_splits * 512, h0, H, d0)
    else:
        h_o = h0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, O_L))
        d_o = d0 + gl.arange(0, 256, layout=gl.SliceLayout(0, O_L))
        row_o = (tp.to(gl.int64) * H + h_o) * n_splits + sp
        gl.store(part_o + row_o[:, None] * 512 + d_o[None, :], o, mask=(h_o < H)[:, None])


@gluon.jit
def _store_staged(o, stage, ptr, off0, row_stride, h0, H, d0):
    """bf16 [64, 256] rows (heads h0 ..) into global memory at ptr + off0 + head · row_stride
    + d0 + column, through ``stage`` (free shared memory), so each warp stores 512 contiguous
    bytes of one row. The row pointers are computed here, after the shared-memory store:
    passed in ready-made, they were 16 live 64-bit addresses per thread next to the
    accumulator, and V4 h64 launches of one split ran about 10 % slower (H200, docs/perf-log.md, "bf16 split partials")."""
    # the stage's first half, as the k_bufs allocation lays out [stage, rows, 256-dim panels]
    buf = reinterpret(stage, gl.bfloat16, 2, HEADS, 256, gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2)).index(0)
    buf.store(o)
    barrier()
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    h_b = h0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, BL))
    d_b = d0 + gl.arange(0, 256, layout=gl.SliceLayout(0, BL))
    row = ptr + (off0 + h_b.to(gl.int64) * row_stride)
    gl.store(row[:, None] + d_b[None, :], buf.load(BL), mask=(h_b < H)[:, None])


@gluon.jit
def _free_stage(k_bufs, n_tiles, later: gl.constexpr, STAGES: gl.constexpr):
    """A K stage nobody reads or fills any more once this partition's loop is done: the
    stage of tile n_tiles - 2 for _lead (``later`` False: _follow released it before
    _lead's last p store), of tile n_tiles - 1 for _follow (``later``: after _lead's
    ``done``), and an unused one where there are fewer tiles. The producer fills no stage
    past the last tile; a cluster peer copies into a stage only for a tile."""
    gl.static_assert(STAGES == 2)
    return k_bufs.index((n_tiles + later) % STAGES)


@gluon.jit
def _ws_kernel(
        q_ptr, q_s0, q_s1, H,
        c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0, K0, l0_ptr, l0_div, l0_off, l0_lag,
        c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, K1, l1_ptr, l1_div, l1_off, l1_lag,
        scale2, scale_ptr, part_o, part_ml, n_splits, t0,
        out_ptr, out_s0, out_s1, lse_ptr, lse_s0, lse_s1, mx_ptr, mx_s0, mx_s1, sink_ptr,
        out_scale, out_scale_ptr, FMT: gl.constexpr,
        HAS_L0: gl.constexpr, HAS_L1: gl.constexpr, HAS_SRC1: gl.constexpr,
        BN: gl.constexpr, STAGES: gl.constexpr, TRACK_MAX: gl.constexpr,
        N_UNITS: gl.constexpr, SCALE_T: gl.constexpr, P_WARPS: gl.constexpr,
        P_REGS: gl.constexpr, Q_FP8: gl.constexpr, FINAL: gl.constexpr,
        HAS_SINK: gl.constexpr, HAS_LSE: gl.constexpr, OUT_SCALE_T: gl.constexpr,
        F_REGS: gl.constexpr, PDL: gl.constexpr, D576: gl.constexpr, F16: gl.constexpr,
        SUB: gl.constexpr, STAGED: gl.constexpr, CLUSTER: gl.constexpr,
        num_warps: gl.constexpr):
    gl.static_assert(num_warps == 4)    # the lead warpgroup; _follow and the producer add 8
    gl.static_assert(not F16 or (FMT == 3 and Q_FP8))     # fp16 only where it is exact
    gl.static_assert(not STAGED or FMT == 0)
    gl.static_assert(not CLUSTER or ((STAGED or FMT == 1) and N_UNITS == 2))  # rank: head block
    if PDL:     # launched early: wait for the kernel before (it wrote q / lengths / indices);
        grid_wait()     # the combine kernel may then be launched, it waits for this grid
        grid_launch_dependents()
    unit = gl.program_id(0) % N_UNITS
    tp = gl.program_id(0) // N_UNITS   # the launch's own token index (partials' rows)
    t = t0 + tp                         # tokens [t0, t0 + grid / N_UNITS) (run's phases)
    sp = gl.program_id(1)
    h0 = unit * HEADS
    if SCALE_T:
        scale2 = gl.load(scale_ptr).to(gl.float32) * LOG2E
    EARLY: gl.constexpr = EARLY_SLOTS and not CLUSTER and (FMT == 0 or FMT == 3)
    V32_STAGED: gl.constexpr = CLUSTER and FMT == 1
    if EARLY:           # in flight while key_run waits for the lengths
        e0, e1 = _load_early(i0_ptr, i0_s0, K0, i1_ptr, i1_s0, K1 if HAS_SRC1 else 0, t,
                             2 * BN, num_warps)
    # the token's virtual key list, cut into n_splits runs of whole tiles (as the portable
    # kernel does: source 0's usable columns padded to BN, then source 1's)
    n0, n1, n0p, lo, hi = key_run(l0_ptr, l0_div, l0_off, l0_lag, l1_ptr, l1_div, l1_off,
                                  l1_lag, t, K0, K1, sp, n_splits, HAS_L0, HAS_L1, HAS_SRC1,
                                  BN)
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BN)

    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    # e4m3 keys and queries are exact in fp16 as in bf16, and their conversion to fp16 is one
    # instruction per two values (to bf16: three); p in fp16 is finer than in bf16 on [2^-14, 1]
    KT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
    q_smem = gl.allocate_shared_memory(KT, [HEADS, 512], SMEM)
    k_bufs = gl.allocate_shared_memory(KT, [STAGES, BN, 512], SMEM)
    if D576:    # the RoPE dims of q and of each stage's keys (24 KB more: 231,272 B of 232,448)
        qr_smem = gl.allocate_shared_memory(KT, [HEADS, 64], SMEM)
        kr_bufs = gl.allocate_shared_memory(KT, [STAGES, BN, 64], SMEM)
    else:       # never read
        qr_smem = q_smem
        kr_bufs = k_bufs
    if STAGED:      # V4 rows' staging buffer (one chunk of raw records; _produce_v4)
        # seven [SUB, 64] byte tiles stacked (and an unused eighth: shapes are powers of
        # two); a warp's eight-lane phase reads two adjacent rows, 128 contiguous bytes
        stage_raw = gl.allocate_shared_memory(gl.uint8, [8 * SUB, 64],
                                              gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        # (and in a cluster, after them, the RoPE dims of the peer's rows)
        stage_rope = gl.allocate_shared_memory(gl.bfloat16, [2 * SUB if CLUSTER else SUB, 64],
                                               gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    elif V32_STAGED:    # the V3.2 cluster producer's next panels and (in stage_rope) their
        # scales: _stage_v32
        stage_raw = gl.allocate_shared_memory(gl.uint8, [V32_STAGED_PANELS, PAIR_SUB, 64],
                                              gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        stage_rope = gl.allocate_shared_memory(gl.float32, [V32_STAGED_PANELS // 2, PAIR_SUB],
                                               gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:           # never read
        stage_raw = k_bufs
        stage_rope = k_bufs
    bias_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BN],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if EARLY:           # read by the producer once the partitions start
        early = gl.allocate_shared_memory(gl.int32, [2, 2 * BN],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
        early.index(0).store(e0)
        early.index(1).store(e1)
    else:           # never read
        early = bias_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if CLUSTER:     # the peer CTA's consumers have released the stage (_pair_handoff)
        peer_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    else:           # never used
        peer_free = empty
    if V32_STAGED:  # p goes into the tile's RoPE stage (_p_buf)
        p_smem = kr_bufs
    else:
        p_smem = gl.allocate_shared_memory(KT, [HEADS, BN], SMEM)
    # per-row factors from _lead to _follow: 0 the tile's rescale, 1-3 the epilogue's
    rows = gl.allocate_shared_memory(gl.float32, [4, HEADS],
                                     gl.SwizzledSharedLayout(1, 1, 1, [0]))
    lf_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    p_full = lf_bars.index(0)
    p_free = lf_bars.index(1)
    done = lf_bars.index(2)
    for b in gl.static_range(3):
        mbarrier.init(lf_bars.index(b), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)       # _lead and _follow
        if CLUSTER:
            mbarrier.init(peer_free.index(s), count=1)   # the peer's producer (remote)
    fence_async_shared()
    barrier()
    gl.warp_specialize([
        (_lead, (q_ptr, q_s0, q_s1, q_smem, qr_smem, k_bufs, kr_bufs, bias_bufs, p_smem, rows,
                 ready, empty, p_full, p_free, done, n_tiles, scale2, part_o, part_ml, t, tp, h0,
                 H, sp, n_splits, out_ptr, out_s0, out_s1, lse_ptr, lse_s0, lse_s1, mx_ptr,
                 mx_s0, mx_s1, sink_ptr, out_scale, out_scale_ptr, BN, STAGES, TRACK_MAX,
                 FINAL, HAS_SINK, HAS_LSE, OUT_SCALE_T, Q_FP8, D576, CLUSTER, V32_STAGED)),
        (_follow, (k_bufs, kr_bufs, p_smem, rows, ready, empty, p_full, p_free, done, n_tiles,
                   part_o, t, tp, h0, H, sp, n_splits, out_ptr, out_s0, out_s1, out_scale,
                   out_scale_ptr, STAGES, FINAL, HAS_SINK, OUT_SCALE_T, CLUSTER,
                   V32_STAGED)),
        (_produce, (k_bufs, kr_bufs, stage_raw, stage_rope, bias_bufs, ready, empty,
                    peer_free, early, t, lo,
                    hi, n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr,
                    i0_s0, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, FMT, D576, BN,
                    STAGES, P_WARPS, STAGED, SUB, unit, CLUSTER, EARLY)),
    ], [4, P_WARPS], [F_REGS, P_REGS])
