"""Triton kernels of the kpool insert (docs/semantics.md §13.1-13.2)."""
import triton
import triton.language as tl

from sparse_mla.ops.common.triton_utils import ceil_log2, e4m3_sat, exp2_int, to_bf16

D = tl.constexpr(128)


@triton.jit
def _butterfly(x, GROUPS: tl.constexpr, STRIDE: tl.constexpr):
    # pairs STRIDE apart: (a + b, a - b), in fp32
    v = tl.trans(tl.reshape(x, (GROUPS, 2, STRIDE)), 0, 2, 1)
    a, b = tl.split(v)
    return tl.reshape(tl.trans(tl.join(a + b, a - b), 0, 2, 1), (D,))


@triton.jit
def hadamard128(x):
    """x [128] fp32 times H_128 / sqrt(128), strides 1 .. 64 like reference.hadamard128."""
    x = _butterfly(x, 64, 1)
    x = _butterfly(x, 32, 2)
    x = _butterfly(x, 16, 4)
    x = _butterfly(x, 8, 8)
    x = _butterfly(x, 4, 16)
    x = _butterfly(x, 2, 32)
    x = _butterfly(x, 1, 64)
    return x * 0.08838834764831845


@triton.jit
def _member(k_ptr, g_ptr, ring_ptr, r_s0, r_s1, m, blk, phys, d):
    """A pool member's (key, gate) in fp32: batch row m, else ring slot ``phys``."""
    # vector masks (a scalar & vector mask is not a valid load mask under the interpreter)
    in_batch = (d * 0 + m) >= 0
    from_ring = ((d * 0 + m) < 0) & ((d * 0 + blk) >= 0)
    kb = tl.load(k_ptr + tl.maximum(m, 0).to(tl.int64) * D + d, mask=in_batch,
                 other=0.0).to(tl.float32)
    gb = tl.load(g_ptr + tl.maximum(m, 0).to(tl.int64) * D + d, mask=in_batch,
                 other=0.0).to(tl.float32)
    rb = ring_ptr + tl.maximum(blk, 0) * r_s0 + phys * D + d
    kr = tl.load(rb, mask=from_ring, other=0.0).to(tl.float32)
    gr = tl.load(rb + r_s1, mask=from_ring, other=0.0).to(tl.float32)
    return tl.where(in_batch, kb, kr), tl.where(in_batch, gb, gr)


@triton.jit
def pool_insert_kernel(k_ptr, g_ptr, ape_ptr, pos_ptr, slot_ptr, blk_ptr, mem_ptr, ring_ptr,
                       r_s0, r_s1, cache_ptr, c_s0, BS, KPOOL: tl.constexpr,
                       RING: tl.constexpr, UE8M0: tl.constexpr, SOFT: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, D)
        p = tl.load(pos_ptr + i).to(tl.int64)
        blk = tl.load(blk_ptr + i).to(tl.int64)
        first = p - (KPOOL - 1)
        mx = tl.full((D,), float("-inf"), tl.float32)
        for s in tl.static_range(KPOOL):
            m = tl.load(mem_ptr + i * KPOOL + s)
            kk, gg = _member(k_ptr, g_ptr, ring_ptr, r_s0, r_s1, m, blk, (first + s) % RING, d)
            mx = tl.maximum(mx, gg + tl.load(ape_ptr + s * D + d))
        all_in = True
        acc = tl.zeros((D,), tl.float32)
        den = tl.zeros((D,), tl.float32)
        for s in tl.static_range(KPOOL):
            m = tl.load(mem_ptr + i * KPOOL + s)
            all_in = all_in & (m >= 0)
            kk, gg = _member(k_ptr, g_ptr, ring_ptr, r_s0, r_s1, m, blk, (first + s) % RING, d)
            pr = tl.exp(gg + tl.load(ape_ptr + s * D + d) - mx)
            den += pr
            acc += kk * pr
        if (blk >= 0) | all_in:
            x = to_bf16(acc / den, SOFT).to(tl.float32)
            x = to_bf16(hadamard128(x), SOFT).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
            e = ceil_log2(amax * 0.002232142857142857)
            b = slot // BS
            o = slot % BS
            base = cache_ptr + b * c_s0
            tl.store(base + o * D + d, e4m3_sat(x * exp2_int(-e), SOFT))
            sp = (base + BS * D + o * 4).to(tl.pointer_type(tl.int32))
            if UE8M0:
                tl.store(sp, ((e + 127) & 0xFF) * 0x01010101)
            else:
                tl.store(sp, exp2_int(e).to(tl.int32, bitcast=True))


@triton.jit
def ring_write_kernel(k_ptr, g_ptr, tslot_ptr, write_ptr, ring_ptr, r_s0, r_s1,
                      RING: tl.constexpr):
    i = tl.program_id(0)
    if tl.load(write_ptr + i) != 0:
        t = tl.load(tslot_ptr + i).to(tl.int64)
        d = tl.arange(0, D)
        dst = ring_ptr + (t // RING) * r_s0 + (t % RING) * D + d
        tl.store(dst, tl.load(k_ptr + i.to(tl.int64) * D + d))
        tl.store(dst + r_s1, tl.load(g_ptr + i.to(tl.int64) * D + d))
