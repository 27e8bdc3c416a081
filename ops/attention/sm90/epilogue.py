"""The sm_90 kernel's epilogue: each consumer warpgroup's 256 output dims of the program's
rows, as final bf16 rows (one split per token: sink and output scale applied) or as the
partials the combine kernel (ops/attention/portable.py) merges.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sparse_mla.ops.attention.sm90.compat import barrier, reinterpret
from sparse_mla.ops.attention.sm90.tuning import HEADS


@gluon.jit
def _write_rows(acc, d0, inv_l, gate, empty_row, part_o, t, tp, h0, H, sp, n_splits, out_ptr,
                out_s0, out_s1, out_scale, out_scale_ptr, stage, O_L: gl.constexpr,
                FINAL: gl.constexpr, HAS_SINK: gl.constexpr, OUT_SCALE_T: gl.constexpr):
    """Output dims [d0, d0 + 256) of the program's rows: bf16 out when this is the token's
    only split (the combine kernel's arithmetic with one split, so the same bits), else the
    partial the combine kernel reads (``part_o``'s dtype: bf16, or fp32 where
    ``launch.PARTIAL_DTYPE`` says so).

    bf16 rows go through ``stage`` (a K stage nobody reads or fills any more:
    ``_free_stage``), so each warp stores 512 contiguous bytes of one row. Stored straight
    from the wgmma fragments, each thread wrote 4 bytes at a time, and the epilogue cost a
    large share of the kernel (lab/perf-log.md, "FlashMLA timed per layer"). fp32 partials
    are stored directly: through the stage they were slower (same section)."""
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
def _store_staged(o, stage, ptr, off0, row_stride, h0, H, d0, HALF: gl.constexpr = 0):
    """bf16 [64, 256] rows (heads h0 ..) into global memory at ptr + off0 + head · row_stride
    + d0 + column, through ``stage`` (free shared memory), so each warp stores 512 contiguous
    bytes of one row. The row pointers are computed here, after the shared-memory store:
    passed in ready-made, they were 16 live 64-bit addresses per thread next to the
    accumulator, and V4 h64 launches of one split ran slower (lab/perf-log.md, "bf16 split
    partials"). ``HALF``: which half of the stage (0: its key dims [0, 256), 1: [256, 512))."""
    # a stage holds its 64-dim panels one after another (what the cluster's bulk copies
    # address), so its first 32 KB are key dims [0, 256) and its last 32 KB [256, 512)
    buf = reinterpret(stage, gl.bfloat16, 2, HEADS, 256, gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2)).index(HALF)
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
