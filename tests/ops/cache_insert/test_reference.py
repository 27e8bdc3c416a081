"""The reference cache writers against values worked out by hand from docs/semantics.md
§2 and §3."""
import math

import pytest
import torch

from sparse_mla.ops.cache_insert import (fused_qnorm_rope_insert_plain, gather_dequant,
                                         insert_plain,
                                         qnorm_rope_kv_insert_v4, quantize_insert_v32,
                                         quantize_insert_v4)
from sparse_mla.ops.common import formats
from sparse_mla.tests.helpers import storage_bytes

POISON = 0xFF


def _identity_rope(max_pos=8):
    """cos = 1, sin = 0 at every position: RoPE leaves rows unchanged."""
    return torch.cat([torch.ones(max_pos, 32), torch.zeros(max_pos, 32)], dim=1)


def _quarter_turn_rope(max_pos=8):
    """Position 1 rotates every pair by 90 degrees exactly (cos 0, sin 1)."""
    cs = _identity_rope(max_pos)
    cs[1, :32], cs[1, 32:] = 0.0, 1.0
    return cs


def _hand_row():
    x = torch.zeros(512)
    x[0:64] = 1.0                       # amax 1    -> e = ceil(log2(1/448)) = -8,  byte 119
    # tile 1 stays 0                     # amax 1e-4 -> e = -22, byte 105, all q = 0
    x[128:192] = 3584.0                 # amax 3584 = 448 * 8 -> e = 3, byte 130, q = 448
    x[192], x[193] = 0.5, -0.25         # amax .5   -> e = -9, q = 256 (0x78), -128 (0xF0)
    x[448] = 1.5                        # RoPE dims are stored as bf16 (1.5 = 0x3FC0)
    x[449] = -2.0                       # bf16 -2.0 = 0xC000
    return x


def _block_token(cache, bs, slot):
    """(data record [576], scale bytes [8]) of ``slot`` read straight from the raw bytes."""
    raw = storage_bytes(cache)
    page = cache.stride(0)
    b, o = divmod(slot, bs)
    base = b * page
    return raw[base + o * 576: base + o * 576 + 576], raw[base + bs * 576 + o * 8:
                                                          base + bs * 576 + o * 8 + 8]


def test_v4_quantize_hand_values():
    bs = 4
    cache = formats.alloc_paged_cache("v4", 2, bs, fill=POISON)
    quantize_insert_v4(_hand_row().unsqueeze(0).to(torch.bfloat16), cache, torch.tensor([5]))
    data, scales = _block_token(cache, bs, 5)
    assert scales.tolist() == [119, 105, 130, 118, 105, 105, 105, 0]
    assert data[0:64].tolist() == [0x78] * 64           # 1.0 * 2^8 = 256
    assert data[64:128].tolist() == [0] * 64
    assert data[128:192].tolist() == [0x7E] * 64        # 448
    assert data[192:196].tolist() == [0x78, 0xF0, 0, 0]
    assert data[448:452].tolist() == [0xC0, 0x3F, 0x00, 0xC0]
    assert data[452:576].tolist() == [0] * 124


def test_v4_writes_only_the_asked_slots_in_padded_pages():
    bs, nb = 3, 4
    page = formats.V4.page_bytes(bs) + 576 * 2          # padded pages (hybrid allocator)
    cache = formats.alloc_paged_cache("v4", nb, bs, page_bytes=page, fill=POISON)
    k = torch.randn(3, 512, dtype=torch.bfloat16)
    quantize_insert_v4(k, cache, torch.tensor([4, -1, 11]))
    raw = storage_bytes(cache)
    expect = torch.full_like(raw, POISON)
    for row, slot in ((0, 4), (2, 11)):
        data, scales = formats_bytes(k[row])
        b, o = divmod(slot, bs)
        expect[b * page + o * 576: b * page + o * 576 + 576] = data
        expect[b * page + bs * 576 + o * 8: b * page + bs * 576 + o * 8 + 8] = scales
    assert torch.equal(raw, expect)


def formats_bytes(row):
    from sparse_mla.ops.common import quant
    data, scales = quant.quantize_v4(row.unsqueeze(0))
    return data[0], scales[0]


def test_v4_tiny_amax_clamp_and_ceil_exactness():
    """amax exactly 448 * 2^k keeps e = k (no rounding up past an exact power of two)."""
    from sparse_mla.ops.common import quant
    x = torch.zeros(1, 512)
    x[0, 0] = 448.0 * 2.0 ** -5
    x[0, 64] = 448.0 * 2.0 ** -5 * 1.0078125           # next bf16 up -> e = -4
    x[0, 128] = 1e-6                                   # below the 1e-4 clamp -> e = -22
    _, scales = quant.quantize_v4(x)
    assert scales[0, :3].tolist() == [127 - 5, 127 - 4, 127 - 22]


def test_fused_v4_rope_and_norm_hand_values():
    cs = _quarter_turn_rope()
    q = torch.full((1, 2, 512), 2.0, dtype=torch.bfloat16)
    q[0, 1, 448], q[0, 1, 449] = 4.0, -4.0              # head 1: one pair larger
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    kv[0, 448], kv[0, 449] = 2.0, 3.0
    cache = formats.alloc_paged_cache("v4", 1, 4, fill=POISON)
    out = qnorm_rope_kv_insert_v4(q, kv, cache, torch.tensor([2]), torch.tensor([1]), cs,
                                  q_head_padded=8)
    assert out.shape == (1, 8, 512) and out.dtype == torch.bfloat16
    # head 0: all 2.0 -> rsqrt(4 + 1e-6) * 2 = 1.0 in bf16; rope pair (1, 1) -> (-1, 1)
    h0 = out[0, 0].float()
    assert torch.equal(h0[:448], torch.ones(448))
    assert h0[448:].tolist() == [-1.0, 1.0] * 32
    # head 1: mean square = (510*4 + 16 + 16) / 512; pair 0 (4, -4) -> (4, 4) scaled
    r = 1.0 / math.sqrt((510 * 4 + 32) / 512 + 1e-6)
    assert out[0, 1, 0].item() == torch.tensor(2.0 * r).bfloat16().item()
    assert out[0, 1, 448].item() == torch.tensor(4.0 * r).bfloat16().item()
    assert out[0, 1, 449].item() == torch.tensor(4.0 * r).bfloat16().item()
    assert torch.count_nonzero(out[0, 2:]) == 0         # padded heads are exact zeros
    data, scales = _block_token(cache, 4, 2)
    rope = data[448:452].view(torch.bfloat16).float().tolist()
    assert rope == [-3.0, 2.0]                          # (2, 3) rotated by 90 degrees


def test_fused_v4_without_norm_and_short_slot_mapping():
    """apply_q_norm=False leaves q as is (identity RoPE); tokens past len(slot_mapping) are
    graph padding: their q is still written, their kv is not inserted."""
    q = torch.randn(3, 1, 512).to(torch.bfloat16)
    kv = torch.randn(3, 512).to(torch.bfloat16)
    cache = formats.alloc_paged_cache("v4", 1, 4, fill=POISON)
    before = storage_bytes(cache)
    out = qnorm_rope_kv_insert_v4(q, kv, cache, torch.tensor([0]), torch.zeros(3, dtype=torch.long),
                                  _identity_rope(), apply_q_norm=False)
    assert torch.equal(out, q)
    after = storage_bytes(cache)
    changed = (after != before).nonzero().flatten()
    assert changed.numel() > 0 and int(changed.max()) < 4 * 576 + 8   # only token 0's bytes


def test_v32_fp32_and_pow2_scales_hand_values():
    kv_c = torch.zeros(1, 512)
    kv_c[0, 0:128] = 448.0                     # scale 1.0: q = x
    kv_c[0, 128] = 1.0                         # fp32: scale = 1/448; pow2: 2^-8
    k_pe = torch.arange(64, dtype=torch.float32).unsqueeze(0)
    for fmt, scale1 in (("fp32", torch.tensor(1.0 / 448.0).item()), ("pow2", 2.0 ** -8)):
        cache = formats.alloc_paged_cache("v32", 1, 2, fill=POISON)
        quantize_insert_v32(kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16), cache,
                            torch.tensor([1]), scale_format=fmt)
        rec = storage_bytes(cache)[656:1312]
        scales = rec[512:528].view(torch.float32).tolist()
        assert scales[0] == 1.0 and scales[1] == scale1
        assert rec[0:128].tolist() == [0x7E] * 128
        q1 = rec[128:129].view(torch.float8_e4m3fn).float().item()
        assert q1 * scale1 == pytest.approx(1.0, rel=2 ** -3)
        # all-zero tiles: fp32 scale is FLT_MIN (vLLM), pow2 scale is 2^ceil(log2 1e-4) = 2^-13
        expect_empty = torch.finfo(torch.float32).tiny if fmt == "fp32" else 2.0 ** -13
        assert scales[2] == expect_empty and scales[3] == expect_empty
        assert torch.equal(rec[528:656].view(torch.bfloat16), k_pe[0].to(torch.bfloat16))
        assert storage_bytes(cache)[:656].eq(POISON).all()


def test_plain_bf16_and_fp8_hand_values():
    cs = _quarter_turn_rope()
    q = torch.full((1, 1, 512), 3.0, dtype=torch.bfloat16)
    kv = torch.full((1, 512), 2.0, dtype=torch.bfloat16)
    pos = torch.tensor([1])
    cache = torch.full((2, 4, 512), float("nan"), dtype=torch.bfloat16)
    q_out = torch.empty(1, 1, 512, dtype=torch.bfloat16)
    fused_qnorm_rope_insert_plain(q, kv, cache, torch.tensor([6]), pos, cs, q_out)
    assert q_out[0, 0, 0].item() == 1.0 and q_out[0, 0, 448:450].tolist() == [-1.0, 1.0]
    assert cache[1, 2, :448].eq(2.0).all() and cache[1, 2, 448:450].tolist() == [-2.0, 2.0]
    assert cache[0].isnan().all() and cache[1, [0, 1, 3]].isnan().all()
    # fp8: cache row = e4m3(kv' * (1 / kv_scale)), q_out = e4m3(q' * q_scale_inv)
    cache8 = torch.full((2, 4, 512), float("nan")).to(torch.float8_e4m3fn)
    q8 = torch.empty(1, 1, 512, dtype=torch.float8_e4m3fn)
    fused_qnorm_rope_insert_plain(q, kv, cache8, torch.tensor([6]), pos, cs, q8,
                                  kv_scale=torch.tensor([0.5]), q_scale_inv=torch.tensor([4.0]))
    assert q8[0, 0, 0].float().item() == 4.0 and q8[0, 0, 448].float().item() == -4.0
    assert cache8[1, 2, 0].float().item() == 4.0 and cache8[1, 2, 449].float().item() == 4.0
    assert cache8[1, 3].float().isnan().all()


def test_insert_plain_hand_values_and_skips():
    rows = torch.tensor([[1.0] * 512, [3.0] * 512, [-600.0] * 512])
    cache = torch.full((2, 2, 512), float("nan")).to(torch.bfloat16)
    insert_plain(rows, cache, torch.tensor([3, -1, 0]))
    assert bool((cache[1, 1] == 1.0).all()) and bool((cache[0, 0] == -600.0).all())
    assert bool(cache[0, 1].isnan().all()) and bool(cache[1, 0].isnan().all())
    c8 = torch.full((2, 2, 512), float("nan")).to(torch.float8_e4m3fn)
    insert_plain(rows, c8, torch.tensor([3, -1, 0]), torch.tensor([0.5]))
    assert bool((c8[1, 1].float() == 2.0).all())           # 1 / 0.5
    assert bool((c8[0, 0].float() == -448.0).all())        # -1200 saturates
    assert bool(c8[0, 1].float().isnan().all())


def test_gather_dequant_ranges_offsets_and_skips():
    bs = 2
    cache = formats.alloc_paged_cache("v4", 4, bs, fill=POISON)
    # exactly representable values: e4m3 codes times a power of two survive the round trip
    rows = torch.tensor([[float(i + 1)] * 448 + [0.5 * i] * 64 for i in range(8)])
    quantize_insert_v4(rows.to(torch.bfloat16), cache, torch.arange(8))
    # request 0: blocks [3, 0] -> positions 0..3 live in slots 6, 7, 0, 1
    # request 1: block table [2, -1]: position 2, 3 map to block -1 and are skipped
    block_table = torch.tensor([[3, 0], [2, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([4, 4], dtype=torch.int32)
    gather_lens = torch.tensor([3, 4], dtype=torch.int32)
    out = torch.full((2, 5, 512), float("nan"), dtype=torch.bfloat16)
    gather_dequant(out, cache, seq_lens, gather_lens, block_table, offset=2)
    # request 0 gathers positions 1..3 -> out rows 2..4 = slots 7, 0, 1
    assert torch.equal(out[0, 2:5], rows[[7, 0, 1]].to(torch.bfloat16))
    assert out[0, :2].isnan().all()
    # request 1 gathers positions 0..3 -> rows 2..5: slots 4, 5, skip (block -1), row 5 >= max
    assert torch.equal(out[1, 2:4], rows[[4, 5]].to(torch.bfloat16))
    assert out[1, 4].isnan().all() and out[1, :2].isnan().all()


def test_gather_dequant_v32_all_positions():
    cache = formats.alloc_paged_cache("v32", 2, 3, fill=POISON)
    kv_c = torch.tensor([[float(2 ** (i % 5))] * 512 for i in range(6)])
    k_pe = torch.randn(6, 64).to(torch.bfloat16)
    quantize_insert_v32(kv_c.to(torch.bfloat16), k_pe, cache, torch.arange(6),
                        scale_format="pow2")
    out = torch.zeros(1, 6, 576, dtype=torch.bfloat16)
    gather_dequant(out, cache, torch.tensor([5]), None, torch.tensor([[1, 0]]),
                   cache_format="v32")
    slots = [3, 4, 5, 0, 1]
    assert torch.equal(out[0, :5, :512], kv_c[slots].to(torch.bfloat16))
    assert torch.equal(out[0, :5, 512:], k_pe[slots])
    assert out[0, 5].eq(0).all()


def test_page_sizes_match_vllm():
    assert formats.V4.page_bytes(64) == 37_440
    assert formats.V4.page_bytes(2) == 1_728
    assert formats.V4.page_bytes(256) % 576 == 0
    assert formats.V32.page_bytes(64) == 64 * 656


def test_q_norm_inverse_sqrt_is_ieee_sqrt_then_division():
    """The q norm's 1/sqrt(mean) is the Triton kernel's: IEEE sqrt, then IEEE division
    (Python's math.sqrt and / are both correctly rounded). torch's CPU sqrt is not: about 1 %
    of these doubles would come back 1 ulp off."""
    from sparse_mla.ops.common import quant
    torch.manual_seed(3)
    x = torch.rand(20000, dtype=torch.float64) * 10 + 1e-6
    want = torch.tensor([1.0 / math.sqrt(v) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(quant.inv_sqrt(x), want)
