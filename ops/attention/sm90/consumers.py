"""The two consumer warpgroups of the sm_90 kernel, split as FlashMLA's sm_90 decode kernel
splits them: ``_lead`` loads q, computes the whole score tile q·kᵀ, the softmax and p·v for
output dims [0, 256); ``_follow`` does p·v for [256, 512) with the lead's p from shared
memory, so its p·v of tile i overlaps the lead's q·k of tile i+1. Both then write their half
of the rows (``epilogue``).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from sparse_mla.ops.attention.portable import sink_gate, softmax_step
from sparse_mla.ops.attention.sm90 import persist
from sparse_mla.ops.attention.sm90.cluster import (_CLUSTER_ARRIVE, _CLUSTER_ARRIVE_INIT,
                                                   _CLUSTER_WAIT, _cluster_sync, _thread_ids)
from sparse_mla.ops.attention.sm90.compat import barrier
from sparse_mla.ops.attention.sm90.epilogue import _free_stage, _write_rows
from sparse_mla.ops.attention.sm90.tuning import HEADS

LN2 = gl.constexpr(0.6931471805599453)


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
def _lead(q_ptr, q_s0, q_s1, q_smem, qr_smem, k_bufs, kr_bufs, bias_bufs, p_smem, rows, ready,
          empty, p_full, p_free, done, n_tiles, scale2, part_o, part_ml, t, tp, h0, H, sp,
          n_splits, out_ptr, out_s0, out_s1, lse_ptr, lse_s0, lse_s1, mx_ptr, mx_s0, mx_s1,
          sink_ptr, out_scale, out_scale_ptr, BN: gl.constexpr, STAGES: gl.constexpr,
          TRACK_MAX: gl.constexpr, FINAL: gl.constexpr,
          HAS_SINK: gl.constexpr, HAS_LSE: gl.constexpr, OUT_SCALE_T: gl.constexpr,
          Q_FP8: gl.constexpr, D576: gl.constexpr, CLUSTER: gl.constexpr,
          P_IN_KR: gl.constexpr, rows_free, PERSIST: gl.constexpr, tok_tab, n_mine, t0, tp_step):
    # The scoring warpgroup: all of q·kᵀ ([64, BN], one wgmma reading q once: the two-way
    # column split read it twice), the softmax inside one warpgroup (no cross-warpgroup
    # reductions), then p into shared memory for _follow and p·v for output dims [0, 256)
    # from registers. _follow's p·v of tile i overlaps this warpgroup's q·k of tile i+1.
    # q is loaded here, not before the partitions start, so the producer's first gather does
    # not wait behind it (lab/perf-log.md, "Fixed per-call costs").
    if CLUSTER:
        tid = _thread_ids(4)
        _cluster_sync(tid, _CLUSTER_ARRIVE_INIT)
    if PERSIST:     # tokens tp, tp + tp_step, ... (persist): the ring's tile count runs on
        if CLUSTER:
            _cluster_sync(tid, _CLUSTER_WAIT)
        g0 = 0
        for k in range(n_mine):
            tk = tp + k * tp_step
            n_k = persist.field(tok_tab, k, persist.N_TILES, 4)
            h0k = h0 + persist.varying_zero(tk)
            _load_q_smem(q_ptr, q_s0, q_s1, q_smem, qr_smem, t0 + tk, h0k, H, Q_FP8, D576)
            _lead_token(q_smem, qr_smem, k_bufs, kr_bufs, bias_bufs, p_smem, rows, ready,
                        empty, p_full, p_free, done, n_k, scale2, part_o, part_ml, t0 + tk, tk,
                        h0k, H, sp, n_splits, out_ptr, out_s0, out_s1, lse_ptr, lse_s0, lse_s1,
                        mx_ptr, mx_s0, mx_s1, sink_ptr, out_scale, out_scale_ptr, BN, STAGES,
                        TRACK_MAX, FINAL, HAS_SINK, HAS_LSE, OUT_SCALE_T, D576, P_IN_KR, g0, k,
                        rows_free, True)
            g0 += n_k
    else:
        _load_q_smem(q_ptr, q_s0, q_s1, q_smem, qr_smem, t, h0, H, Q_FP8, D576)
        if CLUSTER:
            _cluster_sync(tid, _CLUSTER_WAIT)
        _lead_token(q_smem, qr_smem, k_bufs, kr_bufs, bias_bufs, p_smem, rows, ready, empty,
                    p_full, p_free, done, n_tiles, scale2, part_o, part_ml, t, tp, h0, H, sp,
                    n_splits, out_ptr, out_s0, out_s1, lse_ptr, lse_s0, lse_s1, mx_ptr, mx_s0,
                    mx_s1, sink_ptr, out_scale, out_scale_ptr, BN, STAGES, TRACK_MAX, FINAL,
                    HAS_SINK, HAS_LSE, OUT_SCALE_T, D576, P_IN_KR, 0, 0, rows_free, False)


@gluon.jit
def _lead_token(q_smem, qr_smem, k_bufs, kr_bufs, bias_bufs, p_smem, rows, ready, empty, p_full,
                p_free, done, n_tiles, scale2, part_o, part_ml, t, tp, h0, H, sp, n_splits,
                out_ptr, out_s0, out_s1, lse_ptr, lse_s0, lse_s1, mx_ptr, mx_s0, mx_s1,
                sink_ptr, out_scale, out_scale_ptr, BN: gl.constexpr, STAGES: gl.constexpr,
                TRACK_MAX: gl.constexpr, FINAL: gl.constexpr, HAS_SINK: gl.constexpr,
                HAS_LSE: gl.constexpr, OUT_SCALE_T: gl.constexpr, D576: gl.constexpr,
                P_IN_KR: gl.constexpr, g0, k, rows_free, PERSIST: gl.constexpr):
    # _lead's work on one token, q in shared memory: the ring's tiles g0 .. g0 + n_tiles - 1
    # (g0: tiles of the program's earlier tokens, k: their count; both 0 without PERSIST)
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
        g = g0 + i
        st = g % STAGES
        mbarrier.wait(ready.index(st), (g // STAGES) & 1)
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
        mbarrier.wait(p_free, (g & 1) ^ 1)     # _follow is done with the last p
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
        if PERSIST:     # the last tile's stage is held for the epilogue (persist)
            if i < n_tiles - 1:
                mbarrier.arrive(empty.index(st))
        else:
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
    if PERSIST:
        mbarrier.wait(rows_free, (k & 1) ^ 1)   # _follow has read the last token's
    rows.index(1).store(inv_l)
    rows.index(2).store(gate)
    rows.index(3).store(empty_row.to(gl.float32))
    barrier()
    mbarrier.arrive(done)
    if PERSIST:
        persist.write_half(acc, 0, gl.convert_layout(inv_l, ROW_O),
                           gl.convert_layout(gate, ROW_O), gl.convert_layout(empty_row, ROW_O),
                           k_bufs, empty, n_tiles, g0, t, h0, H, out_ptr, out_s0, out_s1,
                           out_scale, out_scale_ptr, STAGES, O_L, HAS_SINK, OUT_SCALE_T)
    else:
        _write_rows(acc, 0, gl.convert_layout(inv_l, ROW_O), gl.convert_layout(gate, ROW_O),
                    gl.convert_layout(empty_row, ROW_O), part_o, t, tp, h0, H, sp, n_splits,
                    out_ptr, out_s0, out_s1, out_scale, out_scale_ptr,
                    _free_stage(k_bufs, n_tiles, 0, STAGES), O_L, FINAL, HAS_SINK, OUT_SCALE_T)
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
def _follow(k_bufs, kr_bufs, p_smem, rows, ready, empty, p_full, p_free, done, n_tiles, part_o,
            t, tp, h0, H, sp, n_splits, out_ptr, out_s0, out_s1, out_scale, out_scale_ptr,
            STAGES: gl.constexpr, FINAL: gl.constexpr,
            HAS_SINK: gl.constexpr, OUT_SCALE_T: gl.constexpr, CLUSTER: gl.constexpr,
            P_IN_KR: gl.constexpr, rows_free, PERSIST: gl.constexpr, tok_tab, n_mine, t0,
            tp_step):
    # p·v for output dims [256, 512) with _lead's p (shared memory) and row rescale
    if CLUSTER:
        tid = _thread_ids(4)
        _cluster_sync(tid, _CLUSTER_ARRIVE)
        _cluster_sync(tid, _CLUSTER_WAIT)
    if PERSIST:     # as _lead's tokens (persist)
        g0 = 0
        for k in range(n_mine):
            tk = tp + k * tp_step
            n_k = persist.field(tok_tab, k, persist.N_TILES, 4)
            _follow_token(k_bufs, kr_bufs, p_smem, rows, ready, empty, p_full, p_free, done,
                          n_k, part_o, t0 + tk, tk, h0 + persist.varying_zero(tk), H, sp,
                          n_splits, out_ptr, out_s0, out_s1, out_scale, out_scale_ptr, STAGES,
                          FINAL, HAS_SINK, OUT_SCALE_T, P_IN_KR, g0, k, rows_free, True)
            g0 += n_k
    else:
        _follow_token(k_bufs, kr_bufs, p_smem, rows, ready, empty, p_full, p_free, done,
                      n_tiles, part_o, t, tp, h0, H, sp, n_splits, out_ptr, out_s0, out_s1,
                      out_scale, out_scale_ptr, STAGES, FINAL, HAS_SINK, OUT_SCALE_T, P_IN_KR,
                      0, 0, rows_free, False)


@gluon.jit
def _follow_token(k_bufs, kr_bufs, p_smem, rows, ready, empty, p_full, p_free, done, n_tiles,
                  part_o, t, tp, h0, H, sp, n_splits, out_ptr, out_s0, out_s1, out_scale,
                  out_scale_ptr, STAGES: gl.constexpr, FINAL: gl.constexpr,
                  HAS_SINK: gl.constexpr, OUT_SCALE_T: gl.constexpr, P_IN_KR: gl.constexpr, g0,
                  k, rows_free, PERSIST: gl.constexpr):
    # _follow's work on one token (g0, k: as _lead_token's)
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 256, 16])
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    acc = gl.zeros([HEADS, 256], gl.float32, O_L)
    for i in range(n_tiles):
        g = g0 + i
        st = g % STAGES
        mbarrier.wait(ready.index(st), (g // STAGES) & 1)
        mbarrier.wait(p_full, g & 1)
        acc = acc * rows.index(0).load(ROW_O)[:, None]
        acc = warpgroup_mma(_p_buf(p_smem, kr_bufs, st, P_IN_KR),
                            k_bufs.index(st).slice(256, 256, dim=1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        barrier()
        mbarrier.arrive(p_free)
        if PERSIST:     # the last tile's stage is held for the epilogue (persist)
            if i < n_tiles - 1:
                mbarrier.arrive(empty.index(st))
        else:
            mbarrier.arrive(empty.index(st))
    mbarrier.wait(done, k & 1)
    if PERSIST:
        inv_l = rows.index(1).load(ROW_O)
        gate = rows.index(2).load(ROW_O)
        empty_row = rows.index(3).load(ROW_O) != 0.0
        barrier()
        mbarrier.arrive(rows_free)          # _lead may write the next token's
        persist.write_half(acc, 256, inv_l, gate, empty_row, k_bufs, empty, n_tiles, g0, t, h0,
                           H, out_ptr, out_s0, out_s1, out_scale, out_scale_ptr, STAGES, O_L,
                           HAS_SINK, OUT_SCALE_T)
    else:
        _write_rows(acc, 256, rows.index(1).load(ROW_O), rows.index(2).load(ROW_O),
                    rows.index(3).load(ROW_O) != 0.0, part_o, t, tp, h0, H, sp, n_splits,
                    out_ptr, out_s0, out_s1, out_scale, out_scale_ptr,
                    _free_stage(k_bufs, n_tiles, 1, STAGES), O_L, FINAL, HAS_SINK, OUT_SCALE_T)


@gluon.jit
def _p_buf(p_smem, kr_bufs, st, P_IN_KR: gl.constexpr):
    """Where _lead puts tile ``st``'s p for _follow: ``p_smem``, or where ``P_IN_KR`` the
    tile's own RoPE stage, free once q·kᵀ has read it and refilled only after _follow's
    release of the stage (the 8 KB it saves hold the V3.2 cluster producer's staging)."""
    if P_IN_KR:
        return kr_bufs.index(st)
    else:
        return p_smem
