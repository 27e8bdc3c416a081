"""Dequantization into the sm_90 kernel's bf16 stages: e4m3 bytes times UE8M0 (V4) or fp32
(V3.2) scales, plain e4m3 converted, each rounded to bf16 as the reference rounds it, and the
stores into a stage's 64-dim panels (``_panel``: the view Triton 3.7+ needs, ``compat``).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sparse_mla.ops.attention.sm90.compat import PANEL_VIEWS, reinterpret


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
def _dequant(x, sc64, TILE: gl.constexpr):
    """e4m3 bytes × 2^(scale byte - 127) as bf16: exact where the product fits bf16, else
    rounded (or overflowed) as the reference rounds its fp32 product."""
    sb = ((sc64 >> (8 * TILE)) & 0xFF).to(gl.int32)
    return _dequant_bf16(x, sb[:, None])


@gluon.jit
def _scaled(x, scale):
    """e4m3 bytes × an fp32 scale (per row, broadcast), the product rounded to bf16."""
    return (x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16)


@gluon.jit
def _store_v4(kb, r0: gl.constexpr, rows: gl.constexpr, x0, x1, x2, x3, x4, x5, x6, rope, sc,
              half=None):
    """Dequantized V4 rows into rows [r0, r0 + rows) of stage ``kb`` (with ``half``: rows
    [half · rows, half · rows + rows), ``_panel``): seven e4m3 64-dim tiles, then the bf16
    RoPE dims."""
    _panel(kb, 0, r0, rows, half).store(_dequant(x0, sc, 0))
    _panel(kb, 1, r0, rows, half).store(_dequant(x1, sc, 1))
    _panel(kb, 2, r0, rows, half).store(_dequant(x2, sc, 2))
    _panel(kb, 3, r0, rows, half).store(_dequant(x3, sc, 3))
    _panel(kb, 4, r0, rows, half).store(_dequant(x4, sc, 4))
    _panel(kb, 5, r0, rows, half).store(_dequant(x5, sc, 5))
    _panel(kb, 6, r0, rows, half).store(_dequant(x6, sc, 6))
    _panel(kb, 7, r0, rows, half).store(rope)


@gluon.jit
def _panel(kb, j: gl.constexpr, r0: gl.constexpr, rows: gl.constexpr, half=None):
    """Dims [64 j, 64 j + 64) of rows [r0, r0 + rows) of a [BN, 512] stage, for a store.
    With ``PANEL_VIEWS`` the view is panel j of the stage seen as the [8, BN, 64] panels
    its 128-byte swizzle lays out (the same bytes): Triton 3.7+ folds a column slice's
    offset into the swizzle's XOR, so each panel's store address was a register of its own
    (seven more live in the producer loop, where 3.6 used one with immediate offsets), and
    ptxas then kept the V4 dequantization behind the stage hand-off's wait instead of
    overlapping it (``compat``, 3.7; lab/perf-log.md, "Session 35: Triton 3.8").

    ``half`` (a run-time index, ``compat.RANK_VIEWS``: a cluster CTA's rank or its peer's)
    replaces ``r0``: rows [half · rows, half · rows + rows), the stage seen as its
    [8 · BN / rows, rows, 64] pieces of panels (the same bytes; ``rows`` a multiple of the
    swizzle's 8 rows), so one code path serves both ranks where static row starts need a
    branch per rank."""
    if half is not None:
        PIECES: gl.constexpr = kb.shape[0] // rows
        view = reinterpret(kb, kb.dtype, 8 * PIECES, rows, 64, gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2)).index(j * PIECES + half)
    elif PANEL_VIEWS:
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
def _store_v32(kb, PAIR: gl.constexpr, xa, xb, scale):
    """Dims [128 PAIR, 128 PAIR + 128) of V3.2 rows (two byte tiles sharing one fp32 scale):
    the fp32 product rounded to bf16, as the reference rounds it (FlashMLA's sm_90 kernel
    rounds the scale to bf16 first, docs/semantics.md §2.1: within tolerance of this, not
    bit-equal)."""
    kb.slice(128 * PAIR, 64, dim=1).store(_scaled(xa, scale[:, None]))
    kb.slice(128 * PAIR + 64, 64, dim=1).store(_scaled(xb, scale[:, None]))


@gluon.jit
def _store_e4m3(kb, TILE: gl.constexpr, x):
    """Plain e4m3 bytes (per-tensor scale, applied outside the kernel) as the stage's bf16 or
    fp16: exact either way (fp16 takes one conversion per two bytes, bf16 three)."""
    kb.slice(64 * TILE, 64, dim=1).store(x.to(gl.float8e4nv, bitcast=True).to(kb.dtype))


@gluon.jit
def _dequant_v41(x, sc_lo, sc_hi, TILE: gl.constexpr, upper):
    """Dims [64 TILE, 64 TILE + 64) of 528 B V4.1 rows: e4m3 bytes × 2^(scale - 127), one
    UE8M0 scale per 32 dims (scale bytes 0-7 in ``sc_lo``, 8-15 in ``sc_hi``, one int64 per
    row); ``upper``: the columns in the tile's second 32 dims. Rounded as ``_dequant_bf16``
    rounds V4's (each thread's 16 columns lie in one half, so a pair's scale is one byte)."""
    sc = sc_lo if TILE < 4 else sc_hi
    sa = ((sc >> (16 * (TILE % 4))) & 0xFF).to(gl.int32)
    sb = ((sc >> (16 * (TILE % 4) + 8)) & 0xFF).to(gl.int32)
    return _dequant_bf16(x, gl.where(upper, sb[:, None], sa[:, None]))


@gluon.jit
def _store_v41(kb, r0: gl.constexpr, rows: gl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7, sc_lo,
               sc_hi, upper):
    """Dequantized 528 B rows into rows [r0, r0 + rows) of stage ``kb``: eight e4m3 64-dim
    tiles (all 512 dims, RoPE included, are quantized in V4.1)."""
    _panel(kb, 0, r0, rows).store(_dequant_v41(x0, sc_lo, sc_hi, 0, upper))
    _panel(kb, 1, r0, rows).store(_dequant_v41(x1, sc_lo, sc_hi, 1, upper))
    _panel(kb, 2, r0, rows).store(_dequant_v41(x2, sc_lo, sc_hi, 2, upper))
    _panel(kb, 3, r0, rows).store(_dequant_v41(x3, sc_lo, sc_hi, 3, upper))
    _panel(kb, 4, r0, rows).store(_dequant_v41(x4, sc_lo, sc_hi, 4, upper))
    _panel(kb, 5, r0, rows).store(_dequant_v41(x5, sc_lo, sc_hi, 5, upper))
    _panel(kb, 6, r0, rows).store(_dequant_v41(x6, sc_lo, sc_hi, 6, upper))
    _panel(kb, 7, r0, rows).store(_dequant_v41(x7, sc_lo, sc_hi, 7, upper))


# Four e2m1 codes -> two bf16x2 outputs ($0, $1), times the bf16x2 factor $3 (the e4m3 scale,
# exact in bf16, as is every product). $2 holds bytes (b, b, b', b'): each byte of the row
# twice, for the layout (one output pair per byte). No conversions: PRMT looks the codes'
# magnitudes up in two 8-entry byte tables held in registers ($7: bytes 0-3 and $11: 4-7 of
# the bf16 values' high bytes, $15 and $19 their low bytes: 0, 0.5, 1, 1.5, 2, 3, 4, 6 are
# 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0), a sign-replicating PRMT
# makes each code's sign bit the high byte's top bit, and two more PRMTs interleave low and
# high bytes into bf16 pairs.
_FP4_PAIRS = gl.constexpr("""{
    .reg .b32 d, m, t, s, hi, lo, w0, w1;
    prmt.b32 d, $2, $2, 0x2020;
    and.b32 m, d, 0x7777;
    shl.b32 t, d, 4;
    prmt.b32 s, t, d, 0xD9C8;
    prmt.b32 hi, $7, $11, m;
    prmt.b32 lo, $15, $19, m;
    and.b32 s, s, 0x80808080;
    or.b32 hi, hi, s;
    prmt.b32 w0, lo, hi, 0x5140;
    prmt.b32 w1, lo, hi, 0x7362;
    mul.rn.bf16x2 $0, w0, $3;
    mul.rn.bf16x2 $1, w1, $3;
    }""")
# the tables' bytes (m = 0-3, 4-7) as little-endian words, as int32 values
_E2M1_HI0 = gl.constexpr(0x3F3F3F00)
_E2M1_HI1 = gl.constexpr(0x40404040)
_E2M1_LO0 = gl.constexpr(0xC0800000 - (1 << 32))
_E2M1_LO1 = gl.constexpr(0xC0804000 - (1 << 32))


@gluon.jit
def _dequant_fp4(x, sc, rows: gl.constexpr, P_WARPS: gl.constexpr):
    """Dims [128 k, 128 k + 128) of 288 B V4.1 rows from their bytes [64 k, 64 k + 64) ``x``
    (a [rows, 64] tile, 16 bytes per thread) and their scales 8k..8k+7 ``sc`` (one int64 per
    row): e2m1 × e4m3 scale, exact in bf16. Returns [rows, 128] bf16, 32 dims per thread.

    The tile is seen as [rows, 8 scale groups, 8 bytes, 2] (each byte twice: one output per
    nibble), so a scale is one value per (row, group) broadcast over its 16 dims, and the
    result's dims come out in order."""
    L4: gl.constexpr = gl.BlockedLayout([1, 2, 8, 2], [8, 4, 1, 1], [P_WARPS, 1, 1, 1],
                                        [3, 2, 1, 0])
    X3: gl.constexpr = gl.SliceLayout(3, L4)
    S2: gl.constexpr = gl.SliceLayout(2, X3)
    x3 = gl.convert_layout(gl.reshape(x, rows, 8, 8), X3)
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, S2)).to(gl.int64)
    sb = ((gl.convert_layout(sc, gl.SliceLayout(1, S2))[:, None] >> (8 * g)[None, :]) & 0xFF)
    s = sb.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32)
    f = s.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    f = (f | (f << 16))[:, :, None, None]
    x4, f = gl.broadcast(x3[:, :, :, None], f)
    hi0 = gl.full([rows, 8, 8, 2], _E2M1_HI0, gl.int32, L4)
    x4, hi0 = gl.broadcast(x4, hi0)
    f, hi0 = gl.broadcast(f, hi0)
    hi1 = gl.full([rows, 8, 8, 2], _E2M1_HI1, gl.int32, L4)
    lo0 = gl.full([rows, 8, 8, 2], _E2M1_LO0, gl.int32, L4)
    lo1 = gl.full([rows, 8, 8, 2], _E2M1_LO1, gl.int32, L4)
    y = gl.inline_asm_elementwise(
        _FP4_PAIRS, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [x4, f, hi0, hi1, lo0, lo1], dtype=gl.bfloat16, is_pure=True, pack=4)
    return gl.reshape(y, rows, 128)


@gluon.jit
def _store_fp4(kb, r0: gl.constexpr, rows: gl.constexpr, x0, x1, x2, x3, s0, s1, s2, s3,
               P_WARPS: gl.constexpr):
    """Dequantized 288 B rows into rows [r0, r0 + rows) of stage ``kb``: four byte tiles of
    128 dims each (column slices of two 64-dim panels)."""
    kr = kb.slice(r0, rows)
    kr.slice(0, 128, dim=1).store(_dequant_fp4(x0, s0, rows, P_WARPS))
    kr.slice(128, 128, dim=1).store(_dequant_fp4(x1, s1, rows, P_WARPS))
    kr.slice(256, 128, dim=1).store(_dequant_fp4(x2, s2, rows, P_WARPS))
    kr.slice(384, 128, dim=1).store(_dequant_fp4(x3, s3, rows, P_WARPS))
