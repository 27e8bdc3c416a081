"""The q fold in the portable kernel (ops/attention/portable.py): q rows normed and rotated
as they are loaded, bit for bit the bf16 q the unfused path writes (``qnorm_rope_kv_insert_v4``'s
q_out, docs/semantics.md §3.1), so the attention that follows is the same computation.

How the rounding is kept: an fp64 sum of squares (exact for bf16 inputs, so its order does
not matter), ``1 / sqrt(mean + eps32)`` in fp64 rounded once to fp32, ``x * r`` in fp32,
GPT-J RoPE as ``x*c - p*s`` / ``x*s + p*c`` with every product rounded on its own, then one
round to nearest even bf16. The attention kernels compile with fp fusion on, so the RoPE
products are PTX ``mul.rn.f32``, which neither LLVM nor ptxas contracts into a multiply-add.
"""
from __future__ import annotations

import triton
import triton.language as tl

from sparse_mla.ops.common import formats
from sparse_mla.ops.common.triton_utils import to_bf16

NOPE = tl.constexpr(formats.NOPE_DIM)     # dims 448..511 are rotated
ROPE_PAIRS = tl.constexpr(formats.ROPE_DIM // 2)
CS_W = tl.constexpr(formats.ROPE_DIM)     # cos_sin_cache row: cos[0:32] || sin[0:32]


@triton.jit
def mul_rn(a, b, INTERP: tl.constexpr):
    """``a * b`` in fp32 rounded on its own: never contracted into a multiply-add with what
    uses it (compiled: PTX ``mul.rn.f32``; ``INTERP``, the interpreter, contracts nothing and
    runs no PTX)."""
    if INTERP:
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def q_rms_factor(q_row, hmask, QROT: tl.constexpr, QEPS: tl.constexpr, HB: tl.constexpr):
    """[HB, 1] fp32 ``1 / sqrt(mean(q²) + eps)`` of the head block's rows (1 without the norm;
    rows past the heads read as zeros), the mean in fp64 in 128-dim chunks (registers)."""
    if QROT == 2:
        ss = tl.zeros((HB, ), tl.float64)
        for j in tl.static_range(4):
            x = tl.load(q_row + (128 * j + tl.arange(0, 128)[None, :]), mask=hmask[:, None],
                        other=0.0).to(tl.float32).to(tl.float64)
            ss += tl.sum(x * x, axis=1)
        r = (1.0 / tl.sqrt(ss / 512.0 + QEPS)).to(tl.float32)[:, None]
    else:
        r = tl.full((HB, 1), 1.0, tl.float32)
    return r


@triton.jit
def rotated_q(q_row, hmask, r, pos, cs_ptr, COL0: tl.constexpr, NC: tl.constexpr,
              INTERP: tl.constexpr):
    """Dims [COL0, COL0 + NC) of the head block's q rows, times ``r``, RoPE'd where they are
    RoPE dims (GPT-J pairs (2i, 2i+1) at ``pos``), rounded to nearest even bf16 (zeros past
    the heads; ``INTERP``: interpreted, where the plain cast truncates)."""
    d = COL0 + tl.arange(0, NC)[None, :]
    x = tl.load(q_row + d, mask=hmask[:, None], other=0.0).to(tl.float32) * r
    if COL0 + NC > NOPE:
        is_rope = d >= NOPE
        # the pair partner (d ^ 1): a second, cache-hitting load keeps the rows contiguous
        p = tl.load(q_row + (d ^ 1), mask=hmask[:, None] & is_rope,
                    other=0.0).to(tl.float32) * r
        k = tl.maximum(d - NOPE, 0) // 2
        c = tl.load(cs_ptr + pos * CS_W + k, mask=is_rope, other=1.0)
        s = tl.load(cs_ptr + pos * CS_W + ROPE_PAIRS + k, mask=is_rope, other=0.0)
        s = tl.where((d & 1) == 0, -s, s)
        x = tl.where(is_rope, mul_rn(x, c, INTERP) + mul_rn(p, s, INTERP), x)
    return to_bf16(x, INTERP)


@triton.jit
def q_position(qpos_ptr, t, q_max_pos):
    """Row ``t``'s position, clamped into the table (a kernel cannot raise; the op checks
    positions where value checks run)."""
    pos = tl.load(qpos_ptr + t).to(tl.int64)
    return tl.minimum(tl.maximum(pos, 0), q_max_pos - 1)
