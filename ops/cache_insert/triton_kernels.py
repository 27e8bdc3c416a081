"""Triton kernels for the cache-insert family; bit-exact with reference.py. Their launchers,
with the ops' signatures, are in triton_impl.py.

Exactness rules every kernel here follows (they are why the tests can compare bytes):
* no fused multiply-add: the launchers pass ``enable_fp_fusion=False`` so ``e*c - o*s`` rounds like
  PyTorch's separate multiplies and subtract;
* power-of-two exponents come from fp32 bits (``ceil_log2``/``exp2_int``), never ``log2``;
* the q RMS mean is accumulated in fp64 (see quant.rms_norm_no_weight);
* ``SOFT`` (``triton_utils.soft_fp8``: interpreted, below sm_89, or forced): e4m3 and bf16
  conversions in integer arithmetic, bit-identical to the hardware's;
* out-of-range slots / block ids are skipped, never written: a kernel cannot raise, but it must
  never touch memory outside the slots it was asked to write.
"""
from __future__ import annotations

import triton
import triton.language as tl

from sparse_mla.ops.common import formats
from sparse_mla.ops.common.triton_utils import (ceil_log2, e2m1_value, e4m3_decode, e4m3_sat,
                                                exp2_int, to_bf16, ue8m0_scale,
                                                v41_record_addrs)

MODE_V4 = 0          # 584 B paged cache (docs/semantics.md §2.2)
MODE_PLAIN_BF16 = 1  # [nb, bs, 512] bf16 (docs/semantics.md §2.3)
MODE_PLAIN_FP8 = 2   # [nb, bs, 512] e4m3, per-tensor scale (docs/semantics.md §2.3)
MODE_V41 = 3         # 528 B paged cache (docs/semantics.md §12)
MODE_V41_FP4 = 4     # 288 B paged cache (docs/semantics.md §12; compressed entries only)

# The byte layouts of ops/common/formats.py as the kernels' compile-time constants.
NOPE = tl.constexpr(formats.NOPE_DIM)                     # 448 e4m3 NoPE dims, then RoPE
E4M3_MAX = tl.constexpr(formats.E4M3_MAX)                 # 448.0
V4_DATA = tl.constexpr(formats.V4.token_data_bytes)       # 576 B data record per token
V4_ROPE = tl.constexpr(formats.V4.rope_offset)            # bf16 RoPE dims inside the record
V4_SCALE_BYTES = tl.constexpr(formats.V4.scale_offset)    # 8 scale bytes per token (tail)
V32_RECORD = tl.constexpr(formats.V32.token_data_bytes)   # 656 B record per token
V32_SCALES = tl.constexpr(formats.V32.scale_offset)       # 4 fp32 scales inside the record
V32_ROPE = tl.constexpr(formats.V32.rope_offset)          # bf16 RoPE dims inside the record
V41_DATA = tl.constexpr(formats.V41.data_bytes)           # 512 e4m3 bytes per token
V41_SCALES = tl.constexpr(formats.V41.scale_bytes)        # 16 UE8M0 bytes per token
FP4_DATA = tl.constexpr(formats.V41_FP4.data_bytes)       # 256 bytes of e2m1 pairs per token
FP4_SCALES = tl.constexpr(formats.V41_FP4.scale_bytes)    # 32 e4m3 scale bytes per token


@triton.jit
def _rotate(row_ptr, x, d, live, pos, cs_ptr, cs_stride, mul):
    """GPT-J RoPE on dims 448..511 of ``x`` (= row * mul, any shape whose dim index is ``d``).

    The pair partner of dim d is dim d ^ 1, read with a second (cache-hitting) load so rows
    stay contiguous. Rounding equals the reference's ``e*c - o*s`` / ``e*s + o*c``: the
    products round separately (no FMA) and ``a + (-b)`` is ``a - b`` exactly.
    """
    is_rope = d >= NOPE
    p = tl.load(row_ptr + (d ^ 1), mask=live & is_rope, other=0.0).to(tl.float32) * mul
    k = tl.maximum(d - NOPE, 0) // 2
    c = tl.load(cs_ptr + pos * cs_stride + k, mask=is_rope, other=1.0)
    s = tl.load(cs_ptr + pos * cs_stride + 32 + k, mask=is_rope, other=0.0)
    s = tl.where((d & 1) == 0, -s, s)
    return tl.where(is_rope, x * c + p * s, x)


@triton.jit
def _store_v4_token(cache_ptr, slot, stride0, BS, y, SOFT: tl.constexpr):
    """Quantize one token ``y`` [8, 64] fp32 (tiles 0..6 NoPE, tile 7 the rotated RoPE dims)
    and write its data record and scale bytes (docs/semantics.md §2.2)."""
    t = tl.arange(0, 8)[:, None]
    c = tl.arange(0, 64)[None, :]
    nope = t < 7
    y = to_bf16(y, SOFT).to(tl.float32)
    amax = tl.maximum(tl.max(tl.where(nope, tl.abs(y), 0.0), axis=1), 1e-4)
    # ceil(log2(amax / 448)) exactly: amax = m * 2^E, 448 = 1.75 * 2^8.
    abits = amax.to(tl.int32, bitcast=True)
    e = ((abits >> 23) & 0xFF) - 127 - 8 + ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)
    q = y * exp2_int(-e)[:, None]
    blk = (slot // BS).to(tl.int64)
    off = slot % BS
    base = cache_ptr + blk * stride0
    data = base + off * V4_DATA
    tl.store(data + t * 64 + c, e4m3_sat(q, SOFT), mask=nope)
    rope = (data + V4_ROPE).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope + (t - 7) * 64 + c, to_bf16(y, SOFT), mask=t == 7)
    k = tl.arange(0, 8)
    sbytes = tl.where(k < 7, tl.minimum(tl.maximum(e + 127, 0), 255), 0).to(tl.uint8)
    tl.store(base + BS * V4_DATA + off * V4_SCALE_BYTES + k, sbytes)


@triton.jit
def _store_v41_token(cache_ptr, slot, stride0, BS, y, SOFT: tl.constexpr,
                     INLINE: tl.constexpr):
    """Quantize one token ``y`` [16, 32] fp32 (rotated; the SWA writer rounds it to bf16
    first, the compressed one does not) as the 528 B MXFP8 record: one UE8M0 scale per 32
    dims (docs/semantics.md §12)."""
    t = tl.arange(0, 16)[:, None]
    c = tl.arange(0, 32)[None, :]
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-4)
    # ceil(log2(amax / 448)) exactly, as in _store_v4_token
    abits = amax.to(tl.int32, bitcast=True)
    e = ((abits >> 23) & 0xFF) - 127 - 8 + ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)
    base = cache_ptr + (slot // BS).to(tl.int64) * stride0
    data, scales = v41_record_addrs(base, slot % BS, BS, V41_DATA, V41_SCALES, INLINE)
    tl.store(data + t * 32 + c, e4m3_sat(y * exp2_int(-e)[:, None], SOFT))
    tl.store(scales + tl.arange(0, 16), tl.minimum(tl.maximum(e + 127, 0), 255).to(tl.uint8))


@triton.jit
def _e2m1_code(v):
    """Round-to-nearest-even, saturating e2m1 codes of fp32 ``v`` (int32 0..15, bit 3 the
    sign): the magnitude code counts the midpoints below |v|, a tie counting only where it
    rounds up to an even code."""
    a = tl.minimum(tl.abs(v), 6.0)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 28) & 8
    return mag | sign


@triton.jit
def _store_v41_fp4_token(cache_ptr, slot, stride0, BS, y, SOFT: tl.constexpr,
                         INLINE: tl.constexpr):
    """Quantize one token ``y`` [32, 16] fp32 as the 288 B NVFP4 record: e4m3 scale
    e4m3(clamp(amax · fl(1/6), 2^-9, 448)) per 16 dims, e2m1 codes of a correctly rounded
    x / scale, two per byte with the even dim in the low nibble (docs/semantics.md §12)."""
    amax = tl.max(tl.abs(y), axis=1)
    sf = tl.minimum(tl.maximum(amax * 0.16666666666666666, 0.001953125), 448.0)
    sbyte = e4m3_sat(sf, SOFT)
    s = e4m3_decode(sbyte, SOFT).to(tl.float32)
    codes = _e2m1_code(tl.math.div_rn(y, tl.broadcast_to(s[:, None], y.shape)))
    lo, hi = tl.split(tl.reshape(codes, (256, 2)))
    base = cache_ptr + (slot // BS).to(tl.int64) * stride0
    data, scales = v41_record_addrs(base, slot % BS, BS, FP4_DATA, FP4_SCALES, INLINE)
    tl.store(data + tl.arange(0, 256), (lo | (hi << 4)).to(tl.uint8))
    tl.store(scales + tl.arange(0, 32), sbyte)


@triton.jit
def v4_insert_kernel(k_ptr, k_stride, cache_ptr, stride0, slot_ptr, n_tokens, capacity, BS,
                      TPP: tl.constexpr, SOFT: tl.constexpr):
    t = tl.arange(0, 8)[:, None]
    c = tl.arange(0, 64)[None, :]
    for i in tl.static_range(TPP):
        tok = tl.program_id(0) * TPP + i
        slot = tl.load(slot_ptr + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
        if (slot >= 0) & (slot < capacity):
            x = tl.load(k_ptr + tok.to(tl.int64) * k_stride + t * 64 + c).to(tl.float32)
            _store_v4_token(cache_ptr, slot, stride0, BS, x, SOFT)


@triton.jit
def fused_insert_kernel(
        q_ptr, q_s0, q_s1, kv_ptr, kv_s0, cache_ptr, c_s0, c_s1, slot_ptr, n_insert, capacity,
        pos_ptr, cs_ptr, cs_stride, max_pos, qo_ptr, qo_s0, qo_s1, kv_scale_ptr, q_scale_inv_ptr,
        eps, H, HP, BS,
        HB: tl.constexpr, MODE: tl.constexpr, APPLY_NORM: tl.constexpr, SOFT: tl.constexpr,
        INLINE: tl.constexpr):
    """Grid (tokens, head blocks + 1): programs with pid(1) < #head blocks write q_out heads
    [pid*HB, pid*HB + HB); the last program of each token inserts its kv row. ``INLINE``: the
    528 B record token-inline rather than page-footer."""
    tok = tl.program_id(0)
    hb = tl.program_id(1)
    n_hb = tl.num_programs(1) - 1
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    # Out-of-table positions cannot raise here: clamp the lookup so no read leaves the table.
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    if hb < n_hb:
        d = tl.arange(0, 512)[None, :]
        h = hb * HB + tl.arange(0, HB)[:, None]
        live = h < H
        q_row = q_ptr + tok.to(tl.int64) * q_s0 + h * q_s1
        x = tl.load(q_row + d, mask=live, other=0.0).to(tl.float32)
        if APPLY_NORM:
            xd = x.to(tl.float64)
            ms = tl.sum(xd * xd, axis=1) / 512.0 + eps
            r = (1.0 / tl.sqrt(ms)).to(tl.float32)[:, None]
        else:
            r = tl.full((HB, 1), 1.0, tl.float32)
        y = _rotate(q_row, x * r, d, live, pos, cs_ptr, cs_stride, r)
        y = tl.where(live, y, 0.0)          # pad heads are +0.0 exactly
        out = qo_ptr + tok.to(tl.int64) * qo_s0 + h * qo_s1 + d
        if MODE == 2:
            tl.store(out, e4m3_sat(y * tl.load(q_scale_inv_ptr), SOFT), mask=h < HP)
        else:
            tl.store(out, to_bf16(y, SOFT), mask=h < HP)
    else:
        slot = tl.load(slot_ptr + tok, mask=tok < n_insert, other=-1).to(tl.int64)
        if (slot >= 0) & (slot < capacity):
            kv_row = kv_ptr + tok.to(tl.int64) * kv_s0
            if MODE == 0:
                t = tl.arange(0, 8)[:, None]
                d = t * 64 + tl.arange(0, 64)[None, :]
                x = tl.load(kv_row + d).to(tl.float32)
                y = _rotate(kv_row, x, d, t >= 0, pos, cs_ptr, cs_stride, 1.0)
                _store_v4_token(cache_ptr, slot, c_s0, BS, y, SOFT)
            elif MODE == 3:
                t = tl.arange(0, 16)[:, None]
                d = t * 32 + tl.arange(0, 32)[None, :]
                x = tl.load(kv_row + d).to(tl.float32)
                y = _rotate(kv_row, x, d, t >= 0, pos, cs_ptr, cs_stride, 1.0)
                # vLLM's CUDA SWA writer rounds the rotated row to bf16 before the absmax
                y = to_bf16(y, SOFT).to(tl.float32)
                _store_v41_token(cache_ptr, slot, c_s0, BS, y, SOFT, INLINE)
            else:
                d = tl.arange(0, 512)
                x = tl.load(kv_row + d).to(tl.float32)
                y = _rotate(kv_row, x, d, d >= 0, pos, cs_ptr, cs_stride, 1.0)
                dst = cache_ptr + (slot // BS) * c_s0 + (slot % BS) * c_s1 + d
                if MODE == 1:
                    tl.store(dst, to_bf16(y, SOFT))
                else:
                    tl.store(dst, e4m3_sat(y * (1.0 / tl.load(kv_scale_ptr)), SOFT))


@triton.jit
def compressed_insert_kernel(k_ptr, k_stride, cache_ptr, c_s0, c_s1, slot_ptr, n_tokens, capacity,
                             BS, pos_ptr, cs_ptr, cs_stride, max_pos, ratio, kv_scale_ptr,
                             MODE: tl.constexpr, TPP: tl.constexpr, SOFT: tl.constexpr,
                             INLINE: tl.constexpr):
    """Compressed entries (docs/semantics.md §12): token ``tok`` is written only when its
    slot is valid and (pos + 1) % ratio == 0, its row rotated at (pos // ratio) * ratio in fp32,
    then stored in the cache's record (``MODE``; ``INLINE``: V4.1 records token-inline) with
    no bf16 rounding (vLLM's Triton compressed writers quantize the fp32 row)."""
    for i in tl.static_range(TPP):
        tok = tl.program_id(0) * TPP + i
        slot = tl.load(slot_ptr + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
        pos = tl.load(pos_ptr + tok, mask=tok < n_tokens, other=0).to(tl.int64)
        if (slot >= 0) & (slot < capacity) & ((pos + 1) % ratio == 0):
            # the lookup is clamped to the table: a kernel cannot raise
            at = tl.minimum(tl.maximum(pos // ratio * ratio, 0), max_pos - 1)
            row = k_ptr + tok.to(tl.int64) * k_stride
            if MODE == 3:
                t = tl.arange(0, 16)[:, None]
                d = t * 32 + tl.arange(0, 32)[None, :]
            elif MODE == 4:
                t = tl.arange(0, 32)[:, None]
                d = t * 16 + tl.arange(0, 16)[None, :]
            elif MODE == 0:
                t = tl.arange(0, 8)[:, None]
                d = t * 64 + tl.arange(0, 64)[None, :]
            else:
                d = tl.arange(0, 512)
            y = _rotate(row, tl.load(row + d).to(tl.float32), d, d >= 0, at, cs_ptr, cs_stride,
                        1.0)
            if MODE == 3:
                _store_v41_token(cache_ptr, slot, c_s0, BS, y, SOFT, INLINE)
            elif MODE == 4:
                _store_v41_fp4_token(cache_ptr, slot, c_s0, BS, y, SOFT, INLINE)
            elif MODE == 0:
                _store_v4_token(cache_ptr, slot, c_s0, BS, y, SOFT)
            else:
                dst = cache_ptr + (slot // BS) * c_s0 + (slot % BS) * c_s1 + d
                if MODE == 1:
                    tl.store(dst, to_bf16(y, SOFT))
                else:
                    # the reciprocal correctly rounded, as the reference's torch.reciprocal
                    # (a compiled fp32 `/` may be the approximate div.full)
                    inv = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.load(kv_scale_ptr))
                    tl.store(dst, e4m3_sat(to_bf16(y, SOFT).to(tl.float32) * inv, SOFT))


@triton.jit
def plain_insert_kernel(k_ptr, k_stride, cache_ptr, c_s0, c_s1, slot_ptr, n_tokens, capacity,
                         BS, kv_scale_ptr, FP8: tl.constexpr, TPP: tl.constexpr,
                         SOFT: tl.constexpr):
    d = tl.arange(0, 512)
    for i in tl.static_range(TPP):
        tok = tl.program_id(0) * TPP + i
        slot = tl.load(slot_ptr + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
        if (slot >= 0) & (slot < capacity):
            x = tl.load(k_ptr + tok.to(tl.int64) * k_stride + d).to(tl.float32)
            dst = cache_ptr + (slot // BS) * c_s0 + (slot % BS) * c_s1 + d
            if FP8:
                tl.store(dst, e4m3_sat(x * (1.0 / tl.load(kv_scale_ptr)), SOFT))
            else:
                tl.store(dst, to_bf16(x, SOFT))


@triton.jit
def v32_insert_kernel(kvc_ptr, kvc_s0, pe_ptr, pe_s0, cache_ptr, stride0, slot_ptr, n_tokens,
                       capacity, BS, TPP: tl.constexpr, POW2: tl.constexpr, SOFT: tl.constexpr,
                       NOPE: tl.constexpr = False):
    # NOPE (GLM-5.3): vLLM zero-pads the k_pe rows of kv_a_proj, so the RoPE bytes are +0.0
    # bf16 and there is no k_pe tensor to read (pe_ptr is then unused).
    for i in tl.static_range(TPP):
        tok = tl.program_id(0) * TPP + i
        slot = tl.load(slot_ptr + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
        if (slot >= 0) & (slot < capacity):
            t = tl.arange(0, 4)[:, None]
            c = tl.arange(0, 128)[None, :]
            x = tl.load(kvc_ptr + tok.to(tl.int64) * kvc_s0 + t * 128 + c)
            x = to_bf16(x.to(tl.float32), SOFT).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            ratio = tl.math.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32))
            if POW2:
                e = ceil_log2(tl.maximum(ratio, 1e-4))
                scale = exp2_int(e)
                q = x * exp2_int(-e)[:, None]
            else:
                scale = tl.maximum(ratio, 1.1754943508222875e-38)   # FLT_MIN
                q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
            rec = cache_ptr + (slot // BS) * stride0 + (slot % BS) * V32_RECORD
            tl.store(rec + t * 128 + c, e4m3_sat(q, SOFT))
            tl.store((rec + V32_SCALES).to(tl.pointer_type(tl.float32)) + tl.arange(0, 4), scale)
            r = tl.arange(0, 64)
            if NOPE:
                pe = tl.zeros((64,), tl.bfloat16)
            else:
                pe = to_bf16(tl.load(pe_ptr + tok.to(tl.int64) * pe_s0 + r).to(tl.float32), SOFT)
            tl.store((rec + V32_ROPE).to(tl.pointer_type(tl.bfloat16)) + r, pe)


@triton.jit
def gather_dequant_kernel(out_ptr, out_s0, out_s1, cache_ptr, stride0, num_blocks, seq_ptr,
                           glen_ptr, bt_ptr, bt_s0, max_blocks, BS, offset, max_tokens,
                           MODE: tl.constexpr, HAS_GLEN: tl.constexpr, TB: tl.constexpr,
                           SOFT: tl.constexpr, INLINE: tl.constexpr):
    """``MODE``: the cache's record (``MODE_V4``, ``MODE_V41``, ``MODE_V41_FP4``; anything else
    is the V3.2 656 B record); ``INLINE``: a V4.1 record token-inline, not page-footer."""
    r = tl.program_id(0)
    i = tl.program_id(1) * TB + tl.arange(0, TB)
    seq_len = tl.load(seq_ptr + r).to(tl.int64)
    glen = tl.load(glen_ptr + r).to(tl.int64) if HAS_GLEN else seq_len
    pos = seq_len - glen + i
    dst = offset + i
    ok = (i < glen) & (pos >= 0) & (dst < max_tokens)
    col = pos // BS
    ok &= col < max_blocks
    blk = tl.load(bt_ptr + r * bt_s0 + col, mask=ok, other=-1).to(tl.int64)
    ok &= (blk >= 0) & (blk < num_blocks)
    base = cache_ptr + blk * stride0
    o = pos % BS
    d = tl.arange(0, 512)[None, :]
    p = tl.arange(0, 64)[None, :]
    okd = ok[:, None]
    out_row = out_ptr + r * out_s0 + dst[:, None] * out_s1
    if MODE == 3:
        data, scales = v41_record_addrs(base[:, None], o[:, None], BS, V41_DATA, V41_SCALES,
                                        INLINE)
        q = e4m3_decode(tl.load(data + d, mask=okd, other=0), SOFT).to(tl.float32)
        sb = tl.load(scales + d // 32, mask=okd, other=127).to(tl.int32)
        tl.store(out_row + d, to_bf16(q * ue8m0_scale(sb), SOFT), mask=okd)
    elif MODE == 4:
        data, scales = v41_record_addrs(base[:, None], o[:, None], BS, FP4_DATA, FP4_SCALES,
                                        INLINE)
        nib = (tl.load(data + d // 2, mask=okd, other=0).to(tl.int32) >> ((d & 1) * 4)) & 0xF
        sb = tl.load(scales + d // 16, mask=okd, other=0x38)
        s = e4m3_decode(sb, SOFT).to(tl.float32)
        tl.store(out_row + d, to_bf16(e2m1_value(nib) * s, SOFT), mask=okd)
    elif MODE == 0:
        data = base[:, None] + (o * V4_DATA)[:, None]
        m = okd & (d < NOPE)
        q = e4m3_decode(tl.load(data + d, mask=m, other=0), SOFT).to(tl.float32)
        sb = tl.load(base[:, None] + BS * V4_DATA + (o * V4_SCALE_BYTES)[:, None] + d // 64, mask=m,
                     other=127).to(tl.int32)
        tl.store(out_row + d, to_bf16(q * ue8m0_scale(sb), SOFT), mask=m)
        rope = tl.load((data + V4_ROPE).to(tl.pointer_type(tl.bfloat16)) + p, mask=okd)
        tl.store(out_row + NOPE + p, rope, mask=okd)
    else:
        rec = base[:, None] + (o * V32_RECORD)[:, None]
        q = e4m3_decode(tl.load(rec + d, mask=okd, other=0), SOFT).to(tl.float32)
        scale = tl.load((rec + V32_SCALES).to(tl.pointer_type(tl.float32)) + d // 128, mask=okd,
                        other=1.0)
        tl.store(out_row + d, to_bf16(q * scale, SOFT), mask=okd)
        rope = tl.load((rec + V32_ROPE).to(tl.pointer_type(tl.bfloat16)) + p, mask=okd)
        tl.store(out_row + 512 + p, rope, mask=okd)
