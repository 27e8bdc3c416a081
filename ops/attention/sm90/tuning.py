"""The sm_90 kernel's compile-time parameters: ``launch_constexprs`` builds those of one launch
variant, shared by the launcher (ops/attention/launch.py) and the compile-only check
(``variants``) so both build the same kernel. The shape it compiles to (ring stages, register
split, persistent tokens) is ``policy.Sm90``; measurements behind each value are in
lab/perf-log.md, in the section its comment names.
"""
from __future__ import annotations

from triton.experimental.gluon import language as gl

from sparse_mla.ops.attention.policy import DEFAULT, Sm90

HEADS = gl.constexpr(64)         # rows of one program: the wgmma M of each warpgroup
# V4 rows outside clusters and plain e4m3 rows: the first two tiles' slot ids are loaded
# together with the lengths, before the partitions start, instead of after them by the
# producer (one dependent round trip less before the first gather), and the producer then
# loads ids two tiles ahead (``gather._early_slots``). Faster for V4 at h64 and plain e4m3;
# slower for plain bf16 rows, so not for them; V3.2 rows' producer spills with it
# (lab/perf-log.md, "Slot ids loaded with the lengths")
EARLY_SLOTS = gl.constexpr(True)


def launch_constexprs(fmt, *, has_l0, has_l1, has_src1, track_max, n_units, scale_t, q_fp8,
                      final, has_sink, has_lse, out_scale_t, pdl, d576, f16, staged, cluster,
                      persist=False, shape: Sm90 = DEFAULT.sm90):
    """``sm90_kernel``'s compile-time parameters (and ``num_warps``) for one launch variant:
    ``fmt`` is the cache format's code (``fmt_codes``); ``shape`` the policy's ``Sm90``. Shared
    by the launch and by the compile-only check (``variants``), so both build the same kernel.
    ``RANK_VIEWS`` is ``compat.RANK_VIEWS`` (V4 clusters only, per Triton version).
    ``persist``: programs loop over tokens, ``shape.persist_tokens`` at most."""
    from sparse_mla.ops.attention.sm90 import compat
    return dict(PERSIST=shape.persist_tokens if persist else 0,
        RANK_VIEWS=bool(compat.RANK_VIEWS and cluster and staged and fmt == 0),
        FMT=fmt, HAS_L0=has_l0, HAS_L1=has_l1, HAS_SRC1=has_src1, BN=shape.block_n,
        STAGES=shape.stages, TRACK_MAX=track_max, N_UNITS=n_units, SCALE_T=scale_t,
        P_WARPS=shape.producer_warps,
        P_REGS=shape.producer_regs_cluster if cluster else shape.producer_regs, Q_FP8=q_fp8,
        FINAL=final, HAS_SINK=has_sink, HAS_LSE=has_lse, OUT_SCALE_T=out_scale_t,
        F_REGS=shape.follow_regs, PDL=pdl, D576=d576, F16=f16, SUB=shape.sub_n, STAGED=staged,
        CLUSTER=cluster, num_warps=4)
