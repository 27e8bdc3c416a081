"""Launch shape and tuning of the sm_90 kernel (``kernel.sm90_kernel``): the module constants its
launches are built from, and ``launch_constexprs``, the compile-time parameters of one launch
variant, shared by the launcher (ops/attention/launch.py) and the compile-only check
(``variants``) so both build the same kernel. ops/attention/plan.py reads ``STAGE_V4``,
``CLUSTER_V4``, ``CLUSTER_V32`` and ``CLUSTER_V41`` to pick the route. The measurements
behind each value are in lab/perf-log.md, in the section its comment names.
"""
from __future__ import annotations

from triton.experimental.gluon import language as gl

HEADS = gl.constexpr(64)         # rows of one program: the wgmma M of each warpgroup
BLOCK_N = 64         # keys per ring stage (64 KB of bf16)
SUB_N = 32           # V4 rows per staged gather chunk (18 KB of staging)
STAGE_V4 = True      # V4 rows gathered through the staging buffer (16-byte-aligned blocks)
STAGES = 2           # q (64 KB) + two stages fill the 227 KB of shared memory
PRODUCER_WARPS = 4
# setmaxnreg for the producer: fewer registers were slower (lab/perf-log.md, "Lead and follow
# consumers")
PRODUCER_REGS = 120
# in clusters (the lead keeps 208): faster for V4 and V3.2 at h128, slower for one CTA at h64
# (lab/perf-log.md, "Cluster exchange")
PRODUCER_REGS_CLUSTER = 128
FOLLOW_REGS = 168    # setmaxnreg for _follow (152 spills); _lead gets the rest of the
                     # 12-warp budget: 216
CLUSTER_V4 = True    # V4 rows at 65-128 heads: the token's two head blocks run as a 2-CTA
                     # cluster and each CTA dequantizes half of every tile (``cluster``)
CLUSTER_V4_MIN_TILES = 4   # (not V4 launches of one wave over fewer tiles a token:
                           # ``plan.cluster_pays``)
CLUSTER_V32 = True   # the same for V3.2 rows
CLUSTER_V41 = True   # the same for V4.1 rows (528 B, with 528 B or 288 B extra rows)
# V4 rows outside clusters and plain e4m3 rows: the first two tiles' slot ids are loaded
# together with the lengths, before the partitions start, instead of after them by the
# producer (one dependent round trip less before the first gather), and the producer then
# loads ids two tiles ahead (``gather._early_slots``). Faster for V4 at h64 and plain e4m3;
# slower for plain bf16 rows, so not for them; V3.2 rows' producer spills with it
# (lab/perf-log.md, "Slot ids loaded with the lengths")
EARLY_SLOTS = gl.constexpr(True)
# Persistent launches (``persist``; ``plan.persist_programs`` says where): V4 rows staged,
# one split a token, more units than SMs. At most PERSIST_TOKENS tokens a program (its token
# table's rows; past that the launch takes more programs than fit, in waves again)
PERSIST_V4 = True
# the same for V4.1 rows (528 B main rows, with 528 B / 288 B / 584 B extra rows) in 2-CTA
# clusters (65-128 heads): 1.057-1.059x (H100, Triton 3.6), 1.056-1.062x (H200, 3.6 / 3.8),
# outputs bit-identical. Not at 64 heads: 0-1 % on the H100 (3.6), 7-8 % slower on the H200
# under 3.8, whose ptxas (and 3.7's) spills that variant (lab/perf-history.md, "Issue 55:
# persistent programs over V4.1, V3.2 and prefill rows")
PERSIST_V41 = True
# the same for V3.2 rows in 2-CTA clusters (65-128 heads, ``_produce_v32_pair``): 1.035-1.037x
# at top-k 512, 1.001-1.019x on bench_flashmla's V3.2 row (H200, Triton 3.6 / 3.8; same
# section)
PERSIST_V32 = True
PERSIST_TOKENS = 8


def launch_constexprs(fmt, *, has_l0, has_l1, has_src1, track_max, n_units, scale_t, q_fp8,
                      final, has_sink, has_lse, out_scale_t, pdl, d576, f16, staged, cluster,
                      persist=False):
    """``sm90_kernel``'s compile-time parameters (and ``num_warps``) for one launch variant:
    ``fmt`` is the cache format's code (``launch.FMT_CODES``). Shared by the launch and by
    the compile-only check (``variants``), so both build the same kernel. ``RANK_VIEWS`` is
    ``compat.RANK_VIEWS`` read now (V4 clusters only), so a flip between launches builds the
    other kernel.
    ``persist``: programs loop over tokens, ``PERSIST_TOKENS`` at most (``persist``)."""
    from sparse_mla.ops.attention.sm90 import compat
    return dict(PERSIST=PERSIST_TOKENS if persist else 0,
        RANK_VIEWS=bool(compat.RANK_VIEWS and cluster and staged and fmt == 0),
        FMT=fmt, HAS_L0=has_l0, HAS_L1=has_l1, HAS_SRC1=has_src1, BN=BLOCK_N, STAGES=STAGES,
        TRACK_MAX=track_max, N_UNITS=n_units, SCALE_T=scale_t, P_WARPS=PRODUCER_WARPS,
        P_REGS=PRODUCER_REGS_CLUSTER if cluster else PRODUCER_REGS, Q_FP8=q_fp8, FINAL=final,
        HAS_SINK=has_sink, HAS_LSE=has_lse, OUT_SCALE_T=out_scale_t, F_REGS=FOLLOW_REGS,
        PDL=pdl, D576=d576, F16=f16, SUB=SUB_N, STAGED=staged, CLUSTER=cluster, num_warps=4)
