"""Warp-specialized Hopper (sm_90) split kernel of the attention core, written in Gluon: the
entry kernel ``sm90_kernel`` (shared-memory plan, barriers, the three partitions).

Same contract as ``portable._split_kernel`` (one program per token × 64-head block × split of
the token's virtual key list; partial out / lse2 / max written for the combine kernel) for
keys in the V4 584 B cache, the V3.2 656 B cache or a plain bf16 / e4m3 cache of 512- or
576-wide rows, but the work is divided between warps instead of serialised in each warp:

* a 4-warp **producer** (``producers``) gathers BLOCK_N key rows (``gather``) into a bf16
  [BLOCK_N, 512] tile of a two-stage shared-memory ring, dequantized (``dequant``), then
  signals an mbarrier. V4 rows: 448 e4m3 bytes, 64 bf16 RoPE dims and the eight UE8M0 scale
  bytes as one int64, dequantized once; V3.2 rows: 512 e4m3 bytes times four fp32 scales;
  plain e4m3 rows are converted (their per-tensor scale is folded into the softmax / output
  scales outside); plain bf16 rows and V3.2's bf16 RoPE dims are copied with cp.async, never
  passing through registers. 576-wide keys (V3.2, 576-wide plain rows) put their last 64
  dims, which score but are not values, in a [BLOCK_N, 64] stage of their own (q's in a
  [64, 64] buffer): 231,272 of sm_90's 232,448 shared bytes (the V3.2 clusters put p in the
  RoPE stages and stage part of the next tile: 231,576);
* at 65-128 heads over the V4 or V3.2 cache (``CLUSTER``) the token's two head blocks run
  as a 2-CTA cluster: each producer dequantizes half of every tile and copies the
  dequantized dims into its peer's stage as well (``cluster``);
* two **consumer** warpgroups (``consumers``) run q·kᵀ and p·v on the tensor cores straight
  from the ring: ``_lead`` the scores, softmax and p·v for output dims [0, 256), ``_follow``
  p·v for [256, 512); each writes its half of the rows (``epilogue``). (The earlier split —
  scores by key columns, accumulator by output dims in one 8-warp partition — was slower:
  lab/perf-log.md, "Lead and follow consumers".)

Where a launch of one split a token has more units than SMs (V4 rows staged, V4.1 and V3.2
rows in clusters; bf16 q), its
programs are **persistent** (``persist``, ``PERSIST``): G per head block, each running tokens
tp, tp + G, ... with the ring running on across them, so a token's start and end overlap the
neighbouring tokens' work instead of costing a program each.

An e4m3 q is decoded once, into shared memory, by the lead warpgroup: to fp16 when the keys
are plain e4m3 too, and the dots then run on fp16 operands (exact, like bf16, but e4m3 -> fp16
is one conversion per two bytes and e4m3 -> bf16 three: the fp8 producer was conversion-bound;
the V4 producer, at two per pair, is not: lab/perf-log.md, "V3.2 and 576-wide rows on
sm_90"). Only used on sm_90 with a Triton in ``plan.SM90_TRITON`` (3.6-3.9: the Gluon API
differences between them are the shims of ``compat``); ``plan.plan_launch`` routes to the
portable kernel everywhere else and for tiny launches of one head block, and says why. The
launch parameters are ``tuning``'s. lab/perf-log.md has the measurements (including what was
tried and dropped: a software-pipelined producer, integer e4m3 decoding).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from sparse_mla.ops.attention import records
from sparse_mla.ops.attention.fmt_codes import PLAIN_FP8, V32, V4, V41_FIRST
from sparse_mla.ops.attention.portable import key_run
from sparse_mla.ops.attention.sm90 import hooks, persist
from sparse_mla.ops.attention.sm90.cluster import PAIR_SUB, V32_STAGED_PANELS
from sparse_mla.ops.attention.sm90.compat import barrier
from sparse_mla.ops.attention.sm90.consumers import _follow, _lead
from sparse_mla.ops.attention.sm90.gather import _load_early
from sparse_mla.ops.attention.sm90.producers import _produce
from sparse_mla.ops.attention.sm90.tuning import EARLY_SLOTS, HEADS
from sparse_mla.ops.common.triton_utils import grid_launch_dependents, grid_wait

LOG2E = gl.constexpr(1.4426950408889634)

# Installed on import, on purpose: every build of ``sm90_kernel`` needs the hook (its cluster
# variant's shared-memory offsets and the ``.maxnreg`` edit), and whatever compiles the kernel
# (the launcher, ``variants``, tests, tools/dev) imports this module first. The hook leaves
# every other kernel's build as it was (``hooks``), and ``install`` is idempotent.
hooks.install()


@records.takes_records
@gluon.jit
def sm90_kernel(
        q, src0, src1, scale, part, n_splits, t0, out, lse, mx, sink_ptr, out_scale,
        FMT: gl.constexpr,
        HAS_L0: gl.constexpr, HAS_L1: gl.constexpr, HAS_SRC1: gl.constexpr,
        BN: gl.constexpr, STAGES: gl.constexpr, TRACK_MAX: gl.constexpr,
        N_UNITS: gl.constexpr, SCALE_T: gl.constexpr, P_WARPS: gl.constexpr,
        P_REGS: gl.constexpr, Q_FP8: gl.constexpr, FINAL: gl.constexpr,
        HAS_SINK: gl.constexpr, HAS_LSE: gl.constexpr, OUT_SCALE_T: gl.constexpr,
        F_REGS: gl.constexpr, PDL: gl.constexpr, D576: gl.constexpr, F16: gl.constexpr,
        SUB: gl.constexpr, STAGED: gl.constexpr, CLUSTER: gl.constexpr,
        num_warps: gl.constexpr, RANK_VIEWS: gl.constexpr = False,
        n_tok=None, PERSIST: gl.constexpr = 0):
    # the records (ops/attention/records.py: RECORDS names their fields)
    q_ptr, q_s0, q_s1, H = q
    c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0, K0, l0_ptr, l0_div, l0_off, l0_lag = src0
    c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, K1, l1_ptr, l1_div, l1_off, l1_lag = src1
    scale2, scale_ptr = scale
    part_o, part_ml = part
    out_ptr, out_s0, out_s1 = out
    lse_ptr, lse_s0, lse_s1 = lse
    mx_ptr, mx_s0, mx_s1 = mx
    out_scale, out_scale_ptr = out_scale
    # RANK_VIEWS: the V4 cluster producer's stores indexed by rank at run time (compat, 3.7)
    # PERSIST (``persist``): each program (cluster) runs tokens tp, tp + G, ... < n_tok of
    # the launch (G programs a head block; at most PERSIST tokens each), one split each, its
    # ring running on across them
    gl.static_assert(num_warps == 4)    # the lead warpgroup; _follow and the producer add 8
    gl.static_assert(not F16 or (FMT == PLAIN_FP8 and Q_FP8))     # fp16 only where it is exact
    gl.static_assert(not STAGED or FMT == V4 or FMT >= V41_FIRST)   # V4 or V4.1 rows
    gl.static_assert(not CLUSTER or ((STAGED or FMT == V32) and N_UNITS == 2))  # rank: head block
    # persistent: V4 rows staged, V4.1 and V3.2 rows in a cluster
    gl.static_assert(not PERSIST or (FINAL and not Q_FP8 and (
        (STAGED and FMT == V4) or (CLUSTER and (FMT == V32 or FMT >= V41_FIRST)))))
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
    EARLY: gl.constexpr = (EARLY_SLOTS and not CLUSTER and not PERSIST
                           and (FMT == V4 or FMT == PLAIN_FP8 or FMT >= V41_FIRST))
    V32_STAGED: gl.constexpr = CLUSTER and FMT == V32
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
    if PERSIST:     # the program's tokens and their key runs (persist)
        tp_step = gl.num_programs(0) // N_UNITS
        n_mine = persist.token_count(tp, tp_step, n_tok)
        tok_tab = gl.allocate_shared_memory(gl.int32, [PERSIST, 8],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
        persist.fill_table(tok_tab, t0, tp, tp_step, n_tok, l0_ptr, l0_div, l0_off, l0_lag,
                           l1_ptr, l1_div, l1_off, l1_lag, K0, K1, HAS_L0, HAS_L1, HAS_SRC1,
                           BN, PERSIST, num_warps)
        # _follow has read the row factors of its last token (_lead rewrites them)
        rows_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(rows_free.index(0), count=1)
        rows_free = rows_free.index(0)
    else:           # never used
        tp_step = 1
        n_mine = 1
        tok_tab = bias_bufs
        rows_free = done
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
                 FINAL, HAS_SINK, HAS_LSE, OUT_SCALE_T, Q_FP8, D576, CLUSTER, V32_STAGED,
                 rows_free, PERSIST, tok_tab, n_mine, t0, tp_step)),
        (_follow, (k_bufs, kr_bufs, p_smem, rows, ready, empty, p_full, p_free, done, n_tiles,
                   part_o, t, tp, h0, H, sp, n_splits, out_ptr, out_s0, out_s1, out_scale,
                   out_scale_ptr, STAGES, FINAL, HAS_SINK, OUT_SCALE_T, CLUSTER,
                   V32_STAGED, rows_free, PERSIST, tok_tab, n_mine, t0, tp_step)),
        (_produce, (k_bufs, kr_bufs, stage_raw, stage_rope, bias_bufs, ready, empty,
                    peer_free, early, t, lo,
                    hi, n_tiles, n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr,
                    i0_s0, c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, FMT, D576, BN,
                    STAGES, P_WARPS, STAGED, SUB, unit, CLUSTER, EARLY, RANK_VIEWS, PERSIST,
                    tok_tab, n_mine, t0, tp, tp_step)),
    ], [4, P_WARPS], [F_REGS, P_REGS])
