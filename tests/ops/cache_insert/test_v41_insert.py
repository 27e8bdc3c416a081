"""The DeepSeek-V4.1 writers (docs/semantics.md §12): the SWA insert (q RoPE, no norm, head
padding; 528 B or 584 B record) and the compressed-entry insert (rotation at
(pos // ratio) * ratio, written only when (pos + 1) % ratio == 0), and gather_dequant of the
528 B / 288 B records. Reference against hand-worked bytes; Triton (CUDA, or the interpreter,
whose launches take the exact software e4m3 route) against the reference byte for byte."""
import pytest
import torch

from sparse_mla.ops.cache_insert import (compressed_insert_v41, gather_dequant, rope_kv_insert_v41)
from sparse_mla.ops.common import formats, quant
from sparse_mla.tests.helpers import (INTERPRETING, cuda_params, seeded, storage_bytes,
                                      triton_params)
from sparse_mla.tests.ops.cache_insert.test_triton import _cos_sin
from sparse_mla.tests.ops.cache_insert.test_triton import _n_tokens as _n
from sparse_mla.tests.ops.cache_insert.test_triton import _rand, _slots

DEVICES = triton_params()
POISON = 0xFF
PAGED = ("v41", "v41_fp4", "v41_inline", "v41_fp4_inline", "v4")
V41_RECORDS = ("v41", "v41_fp4", "v41_inline", "v41_fp4_inline")


def _turns(max_pos=8):
    """Position p rotates every RoPE pair by p quarter turns, exactly (cos, sin in {0, ±1})."""
    cs = torch.zeros(max_pos, 64)
    for p in range(max_pos):
        c, s = ((1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.0, -1.0))[p % 4]
        cs[p, :32], cs[p, 32:] = c, s
    return cs


def _turned(x, p):
    """``x`` [512] with its RoPE pairs (e, o) turned p quarter turns: (e, o) -> (-o, e)."""
    y = x.clone()
    for _ in range(p % 4):
        e, o = y[448::2].clone(), y[449::2].clone()
        y[448::2], y[449::2] = -o, e
    return y


def _record(cache, fmt_name, slot, raw=None):
    """(data, scale bytes) of ``slot`` read from the raw storage (``raw``, default the
    cache's now) at the §12 addresses, written out here rather than taken from formats.py:
    page footer (v4, v41, v41_fp4): data at block * stride0 + off * D, scales at
    block * stride0 + P * D + off * S; token-inline (v41_inline, v41_fp4_inline): data at
    block * stride0 + off * (D + S), its scales right after."""
    d, s = {"v4": (576, 8), "v41": (512, 16), "v41_fp4": (256, 32), "v41_inline": (512, 16),
            "v41_fp4_inline": (256, 32)}[fmt_name]
    raw = storage_bytes(cache) if raw is None else raw
    bs = cache.shape[1]
    b, o = divmod(slot, bs)
    base = b * cache.stride(0)
    if fmt_name.endswith("_inline"):
        rec = base + o * (d + s)
        return raw[rec: rec + d], raw[rec + d: rec + d + s]
    return (raw[base + o * d: base + o * d + d],
            raw[base + bs * d + o * s: base + bs * d + o * s + s])


def test_swa_528_hand_bytes_q_unnormed_and_padded():
    cs = _turns()
    q = torch.full((1, 2, 512), 3.0, dtype=torch.bfloat16)
    q[0, 0, 448], q[0, 0, 449] = 1.5, -2.0
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    kv[0, 0:32] = 1.0
    kv[0, 448], kv[0, 449] = 1.5, -2.0
    page = formats.V41.page_bytes(32) + 4096            # padded pages
    cache = formats.alloc_paged_cache("v41", 3, 32, page_bytes=page, fill=POISON)
    before = storage_bytes(cache)
    out = rope_kv_insert_v41(q, kv, cache, torch.tensor([37]), torch.tensor([1]), cs,
                             q_head_padded=8)
    # q: no RMSNorm (3.0 stays 3.0); one quarter turn: (1.5, -2) -> (2, 1.5)
    assert out.shape == (1, 8, 512)
    assert torch.equal(out[0, 0, :448].float(), torch.full((448,), 3.0))
    assert out[0, 0, 448:450].float().tolist() == [2.0, 1.5]
    assert out[0, 1, 448:450].float().tolist() == [-3.0, 3.0]
    assert torch.count_nonzero(out[0, 2:]) == 0
    data, scales = _record(cache, "v41", 37)
    # tile 0: amax 1 -> e = -8 (byte 119), 1 * 2^8 = 256 (0x78); tile 14 (dims 448..479):
    # (2, 1.5) -> amax 2, e = -7 (120): 256 (0x78), 192 (0x74); other tiles zero (e = -22)
    assert scales.tolist() == [119] + [105] * 13 + [120, 105]
    assert data[0:32].tolist() == [0x78] * 32
    assert data[448:450].tolist() == [0x78, 0x74]
    assert torch.count_nonzero(data[32:448]) == 0 and torch.count_nonzero(data[450:]) == 0
    after = storage_bytes(cache)
    changed = (after != before).nonzero().flatten()
    base = page                                          # slot 37 is block 1, offset 5
    lo, hi = base + 5 * 512, base + 32 * 512 + 5 * 16 + 16
    assert int(changed.min()) >= lo and int(changed.max()) < hi


def test_swa_584_record_equals_the_v4_writer():
    """cache_format "v4": the V4 record of the rotated row (its RoPE dims as bf16)."""
    g = seeded(3)
    kv = torch.randn(4, 512, generator=g).to(torch.bfloat16)
    q = torch.randn(4, 1, 512, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 2, 3])
    cache = formats.alloc_paged_cache("v4", 2, 4, fill=POISON)
    out = rope_kv_insert_v41(q, kv, cache, torch.tensor([6, -1, 0, 3]), pos, _turns(),
                             cache_format="v4")
    for t, slot in ((0, 6), (2, 0), (3, 3)):
        data, scales = quant.quantize_v4(_turned(kv[t].float(), t).unsqueeze(0))
        got = _record(cache, "v4", slot)
        assert torch.equal(got[0], data[0]) and torch.equal(got[1], scales[0])
        assert torch.equal(out[t, 0].float(), _turned(q[t, 0].float(), t))


@pytest.mark.parametrize("fmt", PAGED + ("plain_bf16",))
@pytest.mark.parametrize("ratio", [1, 2])
def test_compressed_rotation_position_and_write_condition(fmt, ratio):
    g = seeded(ratio)
    n = 6
    k = torch.randn(n, 512, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 2, 3, 4, 5])
    slots = torch.tensor([0, 1, 2, -1, 4, 5])
    bs = 4
    if fmt == "plain_bf16":
        cache = torch.full((2, bs, 512), float("nan"), dtype=torch.bfloat16)
    else:
        cache = formats.alloc_paged_cache(fmt, 2, bs, fill=POISON)
    before = storage_bytes(cache)
    compressed_insert_v41(k, cache, slots, pos, _turns(), ratio, cache_format=fmt)
    written = set()
    for t in range(n):
        if slots[t] < 0 or (pos[t] + 1) % ratio:
            continue
        written.add(int(slots[t]))
        row = _turned(k[t].float(), (int(pos[t]) // ratio) * ratio)
        if fmt == "plain_bf16":
            assert torch.equal(cache[slots[t] // bs, slots[t] % bs], row.to(torch.bfloat16))
        else:
            data, scales = quant.quantize_record(row.unsqueeze(0), fmt)
            got = _record(cache, fmt, int(slots[t]))
            assert torch.equal(got[0], data[0]) and torch.equal(got[1], scales[0])
    assert written == ({0, 1, 2, 4, 5} if ratio == 1 else {1, 5})
    for slot in {0, 1, 2, 3, 4, 5, 6, 7} - written:      # untouched
        if fmt == "plain_bf16":
            assert torch.isnan(cache[slot // bs, slot % bs]).all()
        else:
            old, new = _record(cache, fmt, slot, before), _record(cache, fmt, slot)
            assert torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])


def test_compressed_plain_fp8_uses_the_bf16_row_and_reciprocal():
    k = torch.zeros(1, 512, dtype=torch.bfloat16)
    k[0, 0], k[0, 448], k[0, 449] = 3.0, 1.0, 2.0
    cache = torch.zeros(1, 2, 512, dtype=torch.float8_e4m3fn)
    compressed_insert_v41(k, cache, torch.tensor([1]), torch.tensor([3]), _turns(), 2,
                          cache_format="plain_fp8", kv_scale=torch.tensor([0.5]))
    row = cache[0, 1].float()
    # rotated at position 2 (half turn): (1, 2) -> (-1, -2); then times 1 / 0.5
    assert row[0].item() == 6.0 and row[448:450].tolist() == [-2.0, -4.0]
    assert torch.count_nonzero(cache[0, 0].float()) == 0


@pytest.mark.parametrize("fmt", V41_RECORDS)
def test_gather_dequant_v41_reference(fmt):
    g = seeded(5)
    bs, nb = 3, 4
    cache = formats.alloc_paged_cache(fmt, nb, bs, fill=POISON)
    rows = torch.randn(nb * bs, 512, generator=g) * 4
    compressed_insert_v41(rows.to(torch.bfloat16), cache, torch.arange(nb * bs),
                          torch.zeros(nb * bs, dtype=torch.long), _turns(), 1, cache_format=fmt)
    out = torch.full((1, 6, 512), float("nan"), dtype=torch.bfloat16)
    block_table = torch.tensor([[2, -1, 0]], dtype=torch.int32)
    gather_dequant(out, cache, torch.tensor([8], dtype=torch.int32), None, block_table,
                   cache_format=fmt, offset=0)
    for i, slot in ((0, 6), (1, 7), (2, 8), (6 - 6, 6)):
        data, scales = _record(cache, fmt, slot)
        assert torch.equal(out[0, i], quant.dequantize_record(data[None], scales[None], fmt)[0])
    assert torch.isnan(out[0, 3:6].float()).all()          # block -1: skipped
    assert out[0, 0].abs().max() > 0


# ---------------------------------------------------------------------------------------------
# Triton vs reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", formats.V41_SWA_FORMATS)
@pytest.mark.parametrize("heads,padded,bs", [(1, 1, 32), (8, 64, 3), (64, 64, 32),
                                             (128, 128, 64)])
def test_swa_triton_matches_reference(device, fmt, heads, padded, bs):
    g = seeded(heads + bs)
    n = _n(device, 2048)
    nb = n // bs + 2
    q = _rand((n, heads, 512), g, 0.5)
    kv = _rand((n, 1024), g)[:, :512]                   # row stride 1024
    pos = torch.randint(0, 5000, (n,), generator=g)
    cs = _cos_sin(5000, g)
    slots = _slots(max(1, n - 2), nb * bs, g)           # the last tokens are graph padding
    page = formats.get_format(fmt).page_bytes(bs) + 1024
    res = []
    for impl in ("reference", "triton"):
        cache = formats.alloc_paged_cache(fmt, nb, bs, page_bytes=page, fill=POISON,
                                          device=device)
        q_out = rope_kv_insert_v41(q.to(device), kv.to(device), cache, slots.to(device),
                                   pos.to(device), cs.to(device), q_head_padded=padded,
                                   cache_format=fmt, impl=impl)
        res.append((q_out.cpu().view(torch.int16), storage_bytes(cache).cpu()))
    assert torch.equal(res[0][0], res[1][0])
    assert torch.equal(res[0][1], res[1][1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", PAGED + ("plain_bf16", "plain_fp8"))
@pytest.mark.parametrize("ratio,bs", [(1, 64), (2, 64), (2, 5)])
def test_compressed_triton_matches_reference(device, fmt, ratio, bs):
    g = seeded(ratio * 100 + bs)
    n = _n(device, 3000)
    nb = n // bs + 2
    k = _rand((n, 512), g)
    pos = torch.randint(0, 5000, (n,), generator=g)
    pos[:4] = torch.tensor([0, 1, 2, 3])
    cs = _cos_sin(5000, g)
    slots = _slots(n, nb * bs, g)
    scale = torch.tensor([0.37]) if fmt == "plain_fp8" else None
    res = []
    for impl in ("reference", "triton"):
        if fmt.startswith("plain"):
            dt = torch.bfloat16 if fmt == "plain_bf16" else torch.float8_e4m3fn
            width = 512 * dt.itemsize
            cache = torch.full((nb, bs, width), POISON, dtype=torch.uint8).view(dt).to(device)
        else:
            page = formats.get_format(fmt).page_bytes(bs) + 512
            cache = formats.alloc_paged_cache(fmt, nb, bs, page_bytes=page, fill=POISON,
                                              device=device)
        compressed_insert_v41(k.to(device), cache, slots.to(device), pos.to(device),
                              cs.to(device), ratio, cache_format=fmt,
                              kv_scale=None if scale is None else scale.to(device), impl=impl)
        res.append(storage_bytes(cache).cpu())
    assert torch.equal(res[0], res[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", V41_RECORDS)
@pytest.mark.parametrize("bs", [3, 32, 64])
def test_gather_dequant_v41_triton_matches_reference(device, fmt, bs):
    g = seeded(bs)
    nb = 6
    cap = nb * bs
    cache = formats.alloc_paged_cache(fmt, nb, bs, page_bytes=formats.get_format(fmt)
                                      .page_bytes(bs) + 512, fill=POISON, device=device)
    compressed_insert_v41(_rand((cap, 512), g).to(device), cache,
                          torch.arange(cap, device=device),
                          torch.zeros(cap, dtype=torch.long, device=device),
                          _cos_sin(1, g).to(device), 1, cache_format=fmt)
    r, max_blocks = 3, 4
    block_table = torch.randint(0, 5, (r, max_blocks), generator=g, dtype=torch.int32)
    block_table[1, 2] = -1
    block_table[2, 0] = 99                               # out of range: skipped
    seq_lens = torch.randint(0, max_blocks * bs + 1, (r,), generator=g, dtype=torch.int32)
    gather_lens = torch.minimum(seq_lens, torch.randint(0, 2 * bs + 3, (r,), generator=g,
                                                        dtype=torch.int32))
    res = []
    for impl in ("reference", "triton"):
        out = torch.full((r, bs + 5, 512), float("nan"), dtype=torch.bfloat16, device=device)
        gather_dequant(out, cache, seq_lens.to(device), gather_lens.to(device),
                       block_table.to(device), offset=2, cache_format=fmt, impl=impl)
        res.append(out.view(torch.int16).cpu())
    assert torch.equal(res[0], res[1])


@pytest.mark.skipif(INTERPRETING, reason="interpreted kernels always take the software route")
@pytest.mark.parametrize("device", cuda_params())
def test_software_e4m3_route_matches_reference(device, monkeypatch):
    """The V4.1 kernels on the route GPUs below sm_89 take, forced on this GPU."""
    monkeypatch.setenv("SPARSE_MLA_SOFT_FP8", "1")
    for fmt in ("v41", "v41_inline"):
        test_swa_triton_matches_reference(device, fmt, 128, 128, 64)
    for fmt in PAGED + ("plain_fp8",):
        test_compressed_triton_matches_reference(device, fmt, 2, 64)
    for fmt in V41_RECORDS:
        test_gather_dequant_v41_triton_matches_reference(device, fmt, 32)


def test_validation_errors():
    k = torch.zeros(2, 512, dtype=torch.bfloat16)
    pos = torch.zeros(2, dtype=torch.long)
    cache = formats.alloc_paged_cache("v41", 1, 4)
    with pytest.raises(ValueError, match="cache_format must be one of"):
        compressed_insert_v41(k, cache, torch.tensor([0, 1]), pos, _turns(), 1,
                              cache_format="v32")
    with pytest.raises(ValueError, match="compress_ratio"):
        compressed_insert_v41(k, cache, torch.tensor([0, 1]), pos, _turns(), 0)
    with pytest.raises(ValueError, match="last dimension must be 288"):
        compressed_insert_v41(k, cache, torch.tensor([0, 1]), pos, _turns(), 1,
                              cache_format="v41_fp4")
    with pytest.raises(ValueError, match="kv_scale is required"):
        compressed_insert_v41(k, torch.zeros(1, 4, 512, dtype=torch.float8_e4m3fn),
                              torch.tensor([0, 1]), pos, _turns(), 1, cache_format="plain_fp8")
    with pytest.raises(ValueError, match="cache_format must be one of"):
        rope_kv_insert_v41(k.view(2, 1, 512), k, cache, torch.tensor([0, 1]), pos, _turns(),
                           cache_format="v41_fp4")
