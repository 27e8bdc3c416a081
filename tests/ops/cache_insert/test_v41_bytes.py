"""DeepSeek-V4.1's records byte for byte as vLLM's writers lay them down (docs/semantics.md §12).

The encoder here is written from vLLM's description, not from ops/common/quant.py: numpy,
float32 RoPE with each product rounded on its own, float64 for the exponent, and an explicit
table of the 127 finite positive e4m3 values for round-to-nearest-even. It pins
* the SWA rule of vLLM's CUDA writer (``csrc/fused_deepseek_v4_qnorm_rope_kv_insert_kernel.cu``,
  0.32.0:376 / 0.33.0:379): RoPE in fp32, every element rounded to bf16 and back, then the
  32-dim absmax and the e4m3 cast; the compressed writers keep the fp32 row (no rounding);
* the two page layouts: page footer (vLLM 0.32.0, formats ``v41`` / ``v41_fp4``) and
  token-inline (vLLM 0.33.0, ``v41_inline`` / ``v41_fp4_inline``: ``[512 e4m3 | 16 UE8M0]``
  and ``[256 B e2m1 | 32 e4m3]`` per token, ``flashmla_sparse.py:99-109``,
  ``cache_utils.py:39-49``, ``fused_compress_quant_cache.py:465-466, 528-530``);
and then every layout round-trips insert -> gather_dequant -> decode, with NaN-poisoned
unused bytes, blocks padded past their page and odd block sizes.
"""
import math

import numpy as np
import pytest
import torch

from sparse_mla.ops.attention import KeySource, sparse_attention_reference
from sparse_mla.ops.cache_insert import compressed_insert_v41, gather_dequant, rope_kv_insert_v41
from sparse_mla.ops.common import formats
from sparse_mla.ops.flashmla_decode import flash_mla_with_kvcache
from sparse_mla.tests.helpers import seeded, storage_bytes, triton_devices, triton_params
from sparse_mla.tests.ops.flashmla_decode.test_triton import check_decode

DEVICES = triton_params()
POISON = 0xFF
LAYOUT_528 = ("v41", "v41_inline")
LAYOUT_288 = ("v41_fp4", "v41_fp4_inline")


# ---------------------------------------------------------------------------------------------
# The independent encoder


def _e4m3_table():
    """(values [127] float64, bytes [127]) of the finite non-negative e4m3fn codes 0x00..0x7E:
    exponent field e (bias 7), mantissa m; e = 0 is subnormal (m · 2^-9)."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals), np.arange(0x7F)


E4M3_VALUES, E4M3_CODES = _e4m3_table()


def e4m3_rne(x: np.ndarray) -> np.ndarray:
    """Bytes of float64 ``x`` (already within ±448) rounded to the nearest e4m3 value, ties to
    the even code (mantissa LSB 0); the sign bit is kept for values that round to zero."""
    a = np.abs(x)[..., None]
    d = np.abs(E4M3_VALUES - a)
    best = d.min(axis=-1, keepdims=True)
    tie_ok = (d == best) & (E4M3_CODES % 2 == 0)
    # the nearest code; where two are equally near, the even one
    code = np.where(tie_ok.any(-1), np.argmax(tie_ok, -1), np.argmax(d == best, -1))
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def bf16_round(x32: np.ndarray) -> np.ndarray:
    """float32 -> bf16 (round to nearest even on the bits) -> float32, finite inputs."""
    b = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)


def rope_fp32(row: np.ndarray, cs: np.ndarray) -> np.ndarray:
    """GPT-J RoPE on dims 448..511 of float32 ``row`` with ``cs`` = cos[0:32] || sin[0:32]:
    e' = e·c - o·s, o' = e·s + o·c, each product and sum rounded to float32."""
    y = row.astype(np.float32).copy()
    e, o = y[448::2].copy(), y[449::2].copy()
    c, s = cs[:32].astype(np.float32), cs[32:].astype(np.float32)
    y[448::2] = np.float32(e * c) - np.float32(o * s)
    y[449::2] = np.float32(e * s) + np.float32(o * c)
    return y


def mxfp8_encode(x32: np.ndarray):
    """(512 data bytes, 16 scale bytes) of one float32 row: per 32 dims
    amax = max(max|x|, fl32(1e-4)), e = ceil(log2(amax / 448)) (exact: amax / 448 in float64
    is a power of two only where it is one exactly), byte = e4m3_rne(clamp(x · 2^-e, ±448)),
    scale byte = clamp(e + 127, 0, 255)."""
    t = x32.astype(np.float64).reshape(16, 32)
    amax = np.maximum(np.abs(t).max(-1), float(np.float32(1e-4)))
    m, k = np.frexp(amax / 448.0)                 # amax / 448 = m · 2^k, m in [0.5, 1)
    e = np.where(m == 0.5, k - 1, k)
    scaled = np.clip(t * np.exp2(-e)[:, None], -448.0, 448.0)
    return e4m3_rne(scaled).reshape(512), np.clip(e + 127, 0, 255).astype(np.uint8)


def swa_528_encode(kv_bf16: torch.Tensor, cs_row: torch.Tensor, round_bf16=True):
    """vLLM's SWA writer for one token: RoPE in fp32, (``round_bf16``) every element to bf16
    and back, MXFP8. ``round_bf16=False`` is the rule the compressed writers follow (and the
    one this project's SWA writer followed before)."""
    y = rope_fp32(kv_bf16.float().numpy(), cs_row.numpy())
    return mxfp8_encode(bf16_round(y) if round_bf16 else y)


def place(raw: np.ndarray, fmt: str, block_size: int, stride0: int, slot: int, data, scales):
    """Write one token's record into ``raw`` (a block's bytes, ``stride0`` apart) where vLLM
    puts it: 0.32.0 page footer (data rows, then scale rows) or 0.33.0 token-inline."""
    d, s = len(data), len(scales)
    b, o = divmod(slot, block_size)
    base = b * stride0
    if fmt.endswith("_inline"):
        raw[base + o * (d + s): base + o * (d + s) + d] = data
        raw[base + o * (d + s) + d: base + (o + 1) * (d + s)] = scales
    else:
        raw[base + o * d: base + (o + 1) * d] = data
        raw[base + block_size * d + o * s: base + block_size * d + (o + 1) * s] = scales


def _identity(max_pos=1):
    return torch.cat([torch.ones(max_pos, 32), torch.zeros(max_pos, 32)], dim=1)


def _random_cos_sin(n, g):
    ang = torch.rand(n, 32, generator=g, dtype=torch.float64) * 6.3
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=1).float()


def _rounding_sensitive_case():
    """A row and RoPE table where the bf16 round trip changes the record: cos = 1 + 2^-20
    (not a bf16) turns RoPE dims of 1.75 = 448 · 2^-8 into 1.75 · (1 + 2^-20) in fp32, just
    above the tile's power of two (scale 2^-7, and 1.75 · 2^7 = 224 per byte); rounded to
    bf16 they are 1.75 again (scale 2^-8, bytes 448)."""
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    kv[0, :448] = 0.5
    kv[0, 448:] = 1.75
    cs = torch.zeros(1, 64)
    cs[0, :32] = 1.0 + 2.0 ** -20
    return kv, cs


# ---------------------------------------------------------------------------------------------
# (a) the SWA 528 B rule


def test_encoder_tables_are_e4m3():
    """The table is the e4m3fn value set (torch's decode of each byte), and e4m3_rne rounds
    midpoints to the even code, carrying into the next binade."""
    got = torch.tensor(E4M3_CODES, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    assert np.array_equal(got.numpy(), E4M3_VALUES)
    assert e4m3_rne(np.array([17.0, 19.0, 31.0, 448.0, -2.0 ** -10, 1.125 * 2.0 ** -6]))\
        .tolist() == [0x58, 0x5A, 0x60, 0x7E, 0x80, 0x09]


def test_rounding_sensitive_row_exists():
    """The old rule (quantize the fp32 row) and vLLM's (round to bf16 first) give different
    bytes on this input, so the tests below can tell them apart."""
    kv, cs = _rounding_sensitive_case()
    new = swa_528_encode(kv[0], cs[0], round_bf16=True)
    old = swa_528_encode(kv[0], cs[0], round_bf16=False)
    assert new[1][14] == 127 - 8 and old[1][14] == 127 - 7          # tile 14: dims 448..479
    assert new[0][448] == 0x7E and old[0][448] == 0x76              # 448 vs 224
    assert not np.array_equal(new[0], old[0])


@pytest.mark.parametrize("fmt", LAYOUT_528)
def test_swa_528_reference_equals_vllms_rule(fmt):
    """The reference's SWA cache bytes, every byte of the storage (poison and block padding
    included), equal the encoder's under vLLM's rule, on random rows at random positions and
    on the rounding-sensitive row; the old fp32 rule's bytes differ on that row."""
    g = seeded(41)
    n, bs, nb = 40, 5, 10
    kv = (torch.randn(n, 512, generator=g) * 3).to(torch.bfloat16)
    cs = _random_cos_sin(64, g)
    pos = torch.randint(0, 63, (n,), generator=g)
    kv_s, cs_s = _rounding_sensitive_case()
    kv[7], cs[63], pos[7] = kv_s[0], cs_s[0], 63
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[3] = -1
    q = torch.zeros(n, 1, 512, dtype=torch.bfloat16)
    page = formats.get_format(fmt).page_bytes(bs) + 48          # blocks padded past the page
    cache = formats.alloc_paged_cache(fmt, nb, bs, page_bytes=page, fill=POISON)
    rope_kv_insert_v41(q, kv, cache, slots, pos, cs, cache_format=fmt, impl="reference")
    want = np.full(nb * page, POISON, dtype=np.uint8)
    old = want.copy()
    for t in range(n):
        if slots[t] < 0:
            continue
        place(want, fmt, bs, page, int(slots[t]), *swa_528_encode(kv[t], cs[pos[t]]))
        place(old, fmt, bs, page, int(slots[t]),
              *swa_528_encode(kv[t], cs[pos[t]], round_bf16=False))
    got = storage_bytes(cache).numpy()
    assert np.array_equal(got, want)
    assert not np.array_equal(got, old)


@pytest.mark.parametrize("fmt", LAYOUT_528)
def test_compressed_528_keeps_the_fp32_row(fmt):
    """The compressed writer (vLLM's Triton ``_rope_quant_insert_mxfp8_kernel``) quantizes the
    fp32 RoPE output: on the rounding-sensitive row its bytes are the old rule's."""
    kv, cs = _rounding_sensitive_case()
    cache = formats.alloc_paged_cache(fmt, 2, 3, fill=POISON)
    compressed_insert_v41(kv, cache, torch.tensor([4]), torch.tensor([0]), cs, 1,
                          cache_format=fmt, impl="reference")
    want = np.full(storage_bytes(cache).numel(), POISON, dtype=np.uint8)
    place(want, fmt, 3, cache.stride(0), 4, *swa_528_encode(kv[0], cs[0], round_bf16=False))
    assert np.array_equal(storage_bytes(cache).numpy(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", LAYOUT_528)
def test_swa_528_triton_rounds_as_the_reference(device, fmt):
    """The Triton SWA writer on the rounding-sensitive row and random rows: its bytes equal
    the encoder's (interpreted launches take the exact software e4m3 route)."""
    g = seeded(7)
    n, bs, nb = 6, 3, 4
    kv = (torch.randn(n, 512, generator=g) * 3).to(torch.bfloat16)
    cs = _random_cos_sin(8, g)
    kv_s, cs_s = _rounding_sensitive_case()
    kv[0], cs[7] = kv_s[0], cs_s[0]
    pos = torch.tensor([7, 1, 2, 3, 4, 5])
    slots = torch.tensor([10, 0, 5, -1, 2, 11])
    page = formats.get_format(fmt).page_bytes(bs) + 16
    cache = formats.alloc_paged_cache(fmt, nb, bs, page_bytes=page, fill=POISON, device=device)
    q = torch.zeros(n, 1, 512, dtype=torch.bfloat16, device=device)
    rope_kv_insert_v41(q, kv.to(device), cache, slots.to(device), pos.to(device), cs.to(device),
                       cache_format=fmt, impl="triton")
    want = np.full(nb * page, POISON, dtype=np.uint8)
    for t in range(n):
        if slots[t] >= 0:
            place(want, fmt, bs, page, int(slots[t]), *swa_528_encode(kv[t], cs[pos[t]]))
    assert np.array_equal(storage_bytes(cache).cpu().numpy(), want)


# ---------------------------------------------------------------------------------------------
# (c) the token-inline layout


@pytest.mark.parametrize("footer,inline", [("v41", "v41_inline"), ("v41_fp4", "v41_fp4_inline")])
@pytest.mark.parametrize("bs", [1, 7, 32])
def test_inline_records_are_the_footer_records_moved(footer, inline, bs):
    """The same rows written to a footer cache and an inline one: token o's inline record at
    block · stride0 + o · B is [its footer data row | its footer scale row], and every other
    byte of the inline storage (block padding) is untouched poison. The footer records' own
    bytes are pinned by test_v41_formats.py and the encoder above."""
    g = seeded(bs)
    nb = 3
    n = nb * bs
    k = (torch.randn(n, 512, generator=g) * 2).to(torch.bfloat16)
    slots = torch.randperm(n, generator=g)
    pos = torch.zeros(n, dtype=torch.long)
    caches = {}
    for fmt in (footer, inline):
        f = formats.get_format(fmt)
        caches[fmt] = formats.alloc_paged_cache(fmt, nb, bs, page_bytes=f.page_bytes(bs) + 528,
                                                fill=POISON)
        compressed_insert_v41(k, caches[fmt], slots, pos, _identity(), 1, cache_format=fmt,
                              impl="reference")
    d, s = (512, 16) if footer == "v41" else (256, 32)
    src = storage_bytes(caches[footer]).numpy()
    want = np.full(storage_bytes(caches[inline]).numel(), POISON, dtype=np.uint8)
    f0, i0 = caches[footer].stride(0), caches[inline].stride(0)
    for slot in range(n):
        b, o = divmod(slot, bs)
        data = src[b * f0 + o * d: b * f0 + (o + 1) * d]
        sc = src[b * f0 + bs * d + o * s: b * f0 + bs * d + (o + 1) * s]
        place(want, inline, bs, i0, slot, data, sc)
    assert np.array_equal(storage_bytes(caches[inline]).numpy(), want)


def test_inline_formats_describe_vllm_033():
    """The descriptors: 528 / 288 B per token, the token's record is its data then its scales,
    no tail; the 512 B page alignment vLLM 0.33 keeps (``kv_page_alignment``)."""
    for fmt, d, s in ((formats.V41_INLINE, 512, 16), (formats.V41_FP4_INLINE, 256, 32)):
        assert fmt.bytes_per_token == fmt.token_data_bytes == d + s
        assert not fmt.scale_in_tail and fmt.scale_bytes == s
        assert [fmt.token_data_addr(32, o) for o in (0, 3)] == [0, 3 * (d + s)]
        assert [fmt.token_scale_addr(32, o) for o in (0, 3)] == [d, 3 * (d + s) + d]
        assert fmt.page_bytes(32) == math.ceil(32 * (d + s) / 512) * 512
    assert formats.V41_RECORD_OF == {"v41": "v41", "v41_fp4": "v41_fp4", "v41_inline": "v41",
                                     "v41_fp4_inline": "v41_fp4"}
    assert "v41_inline" in formats.V41_SWA_FORMATS
    assert "v41_fp4_inline" not in formats.V41_SWA_FORMATS       # NVFP4: compressed only
    assert {"v41_inline", "v41_fp4_inline"} <= set(formats.V41_COMPRESSED_FORMATS)


# ---------------------------------------------------------------------------------------------
# (b) insert -> gather_dequant -> decode, each layout


def _mxfp8_values(data, scales):
    return (torch.tensor(data).view(torch.float8_e4m3fn).double().reshape(16, 32)
            * torch.exp2(torch.tensor(scales, dtype=torch.float64) - 127)[:, None]).reshape(512)


# (fmt, block size, page padding bytes, writer)
ROUND_TRIP = [("v41", 32, 0, "swa"), ("v41_inline", 32, 2112, "swa"),
              ("v41", 7, 48, "compressed"), ("v41_inline", 5, 16, "compressed"),
              ("v41_fp4", 64, 0, "compressed"), ("v41_fp4_inline", 13, 272, "compressed")]


# the reference on CPU, then the Triton kernels on each device they run on here
RUNS = [pytest.param("cpu", "reference", id="reference")] + [
    pytest.param(d, "triton", id="triton-" + d.replace(":", "")) for d in triton_devices()]


@pytest.mark.parametrize("device,impl", RUNS)
@pytest.mark.parametrize("fmt,bs,pad,writer", ROUND_TRIP)
def test_insert_gather_decode_round_trip(device, impl, fmt, bs, pad, writer):
    """Write rows with one impl, read them back with gather_dequant and the decode, each in
    the layout the cache was written in: gather gives the records' values (the encoder's for
    528 B rows; for 288 B rows the same values through either layout), the decode over the
    cache equals (reference) or is within §9's tolerance of (Triton) the reference attention
    over those gathered rows as a plain bf16 cache. Unused bytes are NaN poison, blocks are
    padded past their page, ids include -1 and out-of-cache ones."""
    g = seeded(bs + pad)
    nb = 5
    n = nb * bs - 2                      # the last two slots stay poison
    kv = (torch.randn(n, 512, generator=g) / 4).to(torch.bfloat16)
    cs = _random_cos_sin(16, g)
    pos = torch.randint(0, 16, (n,), generator=g)
    slots = torch.arange(n)
    f = formats.get_format(fmt)
    cache = formats.alloc_paged_cache(fmt, nb, bs, page_bytes=f.page_bytes(bs) + pad,
                                      fill=POISON, device=device)
    if writer == "swa":
        q0 = torch.zeros(n, 1, 512, dtype=torch.bfloat16, device=device)
        rope_kv_insert_v41(q0, kv.to(device), cache, slots.to(device), pos.to(device),
                           cs.to(device), cache_format=fmt, impl=impl)
    else:
        compressed_insert_v41(kv.to(device), cache, slots.to(device), pos.to(device),
                              cs.to(device), 1, cache_format=fmt, impl=impl)
    # gather every block of the cache in order as one request
    rows = torch.full((1, nb * bs, 512), float("nan"), dtype=torch.bfloat16, device=device)
    table = torch.arange(nb, dtype=torch.int32, device=device).unsqueeze(0)
    gather_dequant(rows, cache, torch.tensor([n], dtype=torch.int32, device=device), None,
                   table, cache_format=fmt, offset=0, impl=impl)
    rows = rows[0].cpu()
    assert rows[:n].isfinite().all() and rows[n:].isnan().all()
    if f.codec == "v41":
        for t in range(0, n, 3):
            y = rope_fp32(kv[t].float().numpy(), cs[pos[t]].numpy())
            want = _mxfp8_values(*mxfp8_encode(bf16_round(y) if writer == "swa" else y))
            assert torch.equal(rows[t].double(), want.to(torch.bfloat16).double())
    # decode: 2 batch rows, 3 query tokens each, lists over the written slots
    b, s_q, h, topk = 2, 3, 4, 24
    idx = torch.randint(0, n, (b, s_q, topk), generator=g, dtype=torch.int32)
    idx[0, 0, :2] = torch.tensor([-1, nb * bs + 7])       # skipped: -1, out of the cache
    lens = torch.tensor([topk, topk - 5], dtype=torch.int32)
    q = (torch.randn(b, s_q, h, 512, generator=g) / 2).to(torch.bfloat16)
    sink = torch.randn(h, generator=g)
    got = flash_mla_with_kvcache(q.to(device), cache, idx.to(device), topk_length=lens.to(device),
                                 attn_sink=sink.to(device), kv_format=fmt, impl=impl)
    plain = rows.reshape(nb, bs, 512).clone()
    plain[torch.isnan(plain)] = 0                          # never read: ids skip them
    want = sparse_attention_reference(q.reshape(b * s_q, h, 512),
                                      [KeySource(plain, "plain_bf16", bs,
                                                 idx.reshape(b * s_q, topk), lens, s_q)],
                                      sink, 512 ** -0.5)
    out, lse = got
    out = out.cpu().reshape(b * s_q, h, 512)
    lse = lse.cpu().transpose(1, 2).reshape(b * s_q, h)
    if impl == "reference":
        assert torch.equal(out.view(torch.int16), want[0].view(torch.int16))
        assert torch.equal(lse, want[1])
    else:
        check_decode(want, (out, lse))
