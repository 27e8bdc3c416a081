"""The sm_90 kernel's producer over DeepSeek-V4.1's 528 B MXFP8 rows (docs/semantics.md §12):
both sources in that record (a V4.1 layer's SWA cache and its 528 B compressed cache).

The shape of ``producers._produce_v4`` outside clusters: the raw records go through the
staging buffer by cp.async, SUB_N rows at a time, one chunk ahead of the dequantization, each
thread reading back exactly the bytes its own cp.async wrote (one layout for both), so its
wait_group is all the staging buffer needs. A 528 B record has no bf16 dims: its 512 e4m3
bytes fill all eight byte tiles of the staging buffer (V4 uses seven and copies its RoPE dims
separately), and its sixteen scale bytes come as two int64 per row.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                              mbarrier)

from sparse_mla.ops.attention.portable import tile_source
from sparse_mla.ops.attention.sm90.compat import barrier
from sparse_mla.ops.attention.sm90.dequant import _store_v41
from sparse_mla.ops.attention.sm90.gather import _early_slots, _issue_v41, _slots


@gluon.jit
def _produce_v41(k_bufs, stage_raw, bias_bufs, ready, empty, early, t, lo, hi, n_tiles,
                 n0p, n0, n1, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, i0_ptr, i0_s0,
                 c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap, i1_ptr, i1_s0, BN: gl.constexpr,
                 SUB: gl.constexpr, STAGES: gl.constexpr, P_WARPS: gl.constexpr,
                 EARLY: gl.constexpr):
    LB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [P_WARPS, 1], [1, 0])
    rows_b: gl.constexpr = gl.SliceLayout(1, LB)
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))
    upper = (cb >= 32)[None, :]     # the tile's columns under its second scale
    CH: gl.constexpr = BN // SUB
    idx = _early_slots(early, 0, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                       rows_b, EARLY)
    v, sl, sh = _issue_v41(stage_raw, idx,
                           tile_source(lo < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap, c1_ptr,
                                       c1_s0, c1_s1, c1_bs, c1_cap), cb, SUB)
    idx = _early_slots(early, SUB, lo, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                       rows_b, EARLY)
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
            x7 = stage_raw.slice(7 * SUB, SUB).load(LB)
            v_c = v
            sl_c = sl
            sh_c = sh
            c = lo + i * BN + (h + 1) * SUB
            v, sl, sh = _issue_v41(stage_raw, idx,
                                   tile_source(c < n0p, c0_ptr, c0_s0, c0_s1, c0_bs, c0_cap,
                                               c1_ptr, c1_s0, c1_s1, c1_bs, c1_cap), cb, SUB)
            idx = _slots(c + SUB, hi, n0p, n0, n1, i0_ptr, i1_ptr, t, i0_s0, i1_s0, SUB,
                         rows_b)
            if h == 0:
                mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            _store_v41(k_bufs.index(st), h * SUB, SUB, x0, x1, x2, x3, x4, x5, x6, x7, sl_c,
                       sh_c, upper)
            bias_bufs.index(st).slice(h * SUB, SUB).store(gl.where(v_c, 0.0, float("-inf")))
        # generic-proxy stores -> the wgmma (async proxy) reads; all producer warps first
        fence_async_shared()
        barrier()
        mbarrier.arrive(ready.index(st))
    async_copy.wait_group(0)    # the gather issued past the last chunk (all rows masked)
