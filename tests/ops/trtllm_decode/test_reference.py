"""The reference implementation against hand-made cases whose expected outputs are computed
here with an explicit float64 softmax (tests/ops/trtllm_decode/cases.py), not with the shared
oracle. Unused pool rows are NaN, so any key the op should not read poisons the output."""
import pytest
import torch

from sparse_mla.ops import trtllm_decode as td
from sparse_mla.ops.trtllm_decode import reference
from sparse_mla.tests.helpers import seeded
from sparse_mla.tests.ops.trtllm_decode.cases import I32, attend, fill, poisoned_pool, rows

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
SCALE = 512 ** -0.5
# bf16 output of values of magnitude ~1: half an ulp is 2^-8 relative; 1e-2 absolute +
# 1/128 relative covers the final rounding and the fp32-vs-fp64 accumulation.
TOL = dict(atol=1e-2, rtol=1 / 128)


def _dsv4(q, swa, idx, cmp, lens, seq, **kw):
    kw.setdefault("bmm1_scale", SCALE)
    return td.trtllm_batch_decode_sparse_mla_dsv4(q, swa, None, idx, cmp, lens, seq,
                                                  impl="reference", **kw)


def _check(out, want):
    torch.testing.assert_close(out.double(), want.to(torch.float64), **TOL)


class Pools:
    """NaN-poisoned SWA / compressed pools (fp32 while being filled)."""

    def __init__(self, gen, swa_pages=4, cmp_pages=2, page=64, dim=512):
        self.g, self.dim = gen, dim
        self.swa = poisoned_pool(swa_pages, page, dim)
        self.cmp = poisoned_pool(cmp_pages, page, dim)

    def put(self, which, slots, dtype=BF16, scale=1.0):
        fill(self.swa if which == "swa" else self.cmp, slots, self.g, dtype, scale)

    def keys(self, swa_slots, cmp_slots):
        return torch.cat([rows(self.swa, swa_slots), rows(self.cmp, cmp_slots)])


def _row(swa_slots, cmp_slots, topk):
    r = torch.full((topk,), -1, dtype=I32)
    r[:len(swa_slots)] = torch.tensor(swa_slots, dtype=I32)
    r[128:128 + len(cmp_slots)] = torch.tensor(cmp_slots, dtype=I32)
    return r


def test_window_partly_valid_from_seq_lens():
    g = seeded(1)
    p = Pools(g)
    swa_cols = list(range(10, 138))                 # all 128 columns hold real rows ...
    p.put("swa", swa_cols)
    cmp_cols = [3, 70, 5, 100, 7, 8, 9, 11]          # ... and 8 compressed columns too
    p.put("cmp", cmp_cols)
    idx = _row(swa_cols, cmp_cols, 136).unsqueeze(0)
    q = torch.randn(1, 1, 4, 512, generator=g).to(BF16)
    lens = torch.tensor([132], dtype=I32)           # only 4 compressed columns active
    seq = torch.tensor([5], dtype=I32)              # position 4: 5 visible window columns
    out = _dsv4(q, p.swa.to(BF16), idx, p.cmp.to(BF16), lens, seq)
    want = attend(q[0, 0], p.keys(swa_cols[:5], cmp_cols[:4]), SCALE)
    _check(out[0, 0], want)
    wrong = attend(q[0, 0], p.keys(swa_cols, cmp_cols[:4]), SCALE)
    assert (want - wrong).abs().max() > 0.05        # the case can tell the two apart


def test_mtp_rows_varlen_each_token_its_own_window():
    g = seeded(2)
    p = Pools(g, swa_pages=8)
    # request 0: q_len 3, seq_len 10 -> visible 8, 9, 10; request 1: q_len 2, seq_len 300 -> 128
    cu = torch.tensor([0, 3, 5], dtype=I32)
    seq = torch.tensor([10, 300], dtype=I32)
    visible = [8, 9, 10, 128, 128]
    topk = 140
    idx, keys = [], []
    lens = torch.tensor([128 + 3, 128 + 0, 128 + 12, 128 + 5, 128 + 1], dtype=I32)
    for t in range(5):
        sw = [t * 80 + j for j in range(128)]
        cm = [(t * 13 + 7 * j) % 128 for j in range(12)]
        p.put("swa", sw[:visible[t]])                # columns beyond the window stay NaN
        p.put("cmp", cm[:int(lens[t]) - 128])
        idx.append(_row(sw, cm, topk))
        keys.append((sw[:visible[t]], cm[:int(lens[t]) - 128]))
    q = torch.randn(5, 8, 512, generator=g).to(BF16)
    out = _dsv4(q, p.swa.to(BF16), torch.stack(idx), p.cmp.to(BF16), lens, seq,
                cum_seq_lens_q=cu, max_q_len=3)
    for t in range(5):
        _check(out[t], attend(q[t], p.keys(*keys[t]), SCALE))


def test_mtp_dense_query_form():
    g = seeded(3)
    p = Pools(g)
    seq = torch.tensor([6, 129], dtype=I32)          # visible: [5, 6] and [128, 128]
    visible = [5, 6, 128, 128]
    idx, keys = [], []
    for t in range(4):
        sw = [(t * 50 + j) % 256 for j in range(128)]
        p.put("swa", sw[:visible[t]])
        idx.append(_row(sw, [t], 132))
        p.put("cmp", [t])
        keys.append((sw[:visible[t]], [t]))
    q = torch.randn(2, 2, 16, 512, generator=g).to(BF16)
    lens = torch.full((4,), 129, dtype=I32)
    out = _dsv4(q, p.swa.to(BF16), torch.stack(idx), p.cmp.to(BF16), lens, seq)
    assert out.shape == (2, 2, 16, 512)
    for t in range(4):
        _check(out[t // 2, t % 2], attend(q[t // 2, t % 2], p.keys(*keys[t]), SCALE))


def test_minus_one_inside_compressed_range_is_skipped():
    g = seeded(4)
    p = Pools(g)
    sw = list(range(128))
    p.put("swa", sw)
    cm = [1, 2, -1, 4, -1, 6]
    p.put("cmp", [c for c in cm if c >= 0])
    idx = _row(sw, cm, 136).unsqueeze(0)
    q = torch.randn(1, 4, 512, generator=g).to(BF16)
    out = _dsv4(q, p.swa.to(BF16), idx, p.cmp.to(BF16), torch.tensor([134], dtype=I32),
                torch.tensor([500], dtype=I32), cum_seq_lens_q=torch.tensor([0, 1], dtype=I32),
                max_q_len=1)
    _check(out[0], attend(q[0], p.keys(sw, [1, 2, 4, 6]), SCALE))


@pytest.mark.parametrize("tensor_scales", [False, True])
def test_fp8_non_unit_scales(tensor_scales):
    g = seeded(5)
    q_scale, kv_scale = 0.25, 0.5
    swa_f = torch.randn(3, 64, 512, generator=g)
    cmp_f = torch.randn(1, 64, 512, generator=g)
    q_f = torch.randn(2, 4, 512, generator=g)
    # per-tensor fp8 storage (docs/semantics.md §2.3): x8 = e4m3(x / scale); dequant x8 * scale
    swa8, cmp8 = (swa_f / kv_scale).to(E4M3), (cmp_f / kv_scale).to(E4M3)
    q8 = (q_f / q_scale).to(E4M3)
    sw = [[5 + j for j in range(128)], [2 * j for j in range(64)] + [-1] * 64]
    cm = [[1, 9, 33], [60, 61]]
    lens = torch.tensor([131, 130], dtype=I32)
    idx = torch.stack([_row(sw[0], cm[0], 132), _row(sw[1], cm[1], 132)])
    b1, b2 = SCALE * q_scale * kv_scale, kv_scale
    if tensor_scales:
        b1, b2 = torch.tensor([b1]), torch.tensor([b2])
    out = _dsv4(q8, swa8, idx, cmp8, lens, torch.tensor([1000, 2000], dtype=I32),
                cum_seq_lens_q=torch.tensor([0, 1, 2], dtype=I32), max_q_len=1,
                bmm1_scale=b1, bmm2_scale=b2)
    for t in range(2):
        k = torch.cat([rows(swa8.float() * kv_scale, [s for s in sw[t] if s >= 0]),
                       rows(cmp8.float() * kv_scale, cm[t])])
        _check(out[t], attend(q8[t].float() * q_scale, k, SCALE))


@pytest.mark.parametrize("sink", ["+inf", "-inf", "finite"])
def test_sinks(sink):
    g = seeded(6)
    p = Pools(g)
    sw = list(range(40))
    p.put("swa", sw)
    p.put("cmp", [0, 1])
    idx = _row(sw, [0, 1], 132).unsqueeze(0)
    H = 4
    sinks = {"+inf": torch.full((H,), float("inf")), "-inf": torch.full((H,), float("-inf")),
             "finite": torch.tensor([-1.0, 0.0, 2.0, 5.0])}[sink]
    q = torch.randn(1, H, 512, generator=g).to(BF16)
    out = _dsv4(q, p.swa.to(BF16), idx, p.cmp.to(BF16), torch.tensor([130], dtype=I32),
                torch.tensor([40], dtype=I32), cum_seq_lens_q=torch.tensor([0, 1], dtype=I32),
                max_q_len=1, sinks=sinks)
    want = attend(q[0], p.keys(sw, [0, 1]), SCALE, sink=sinks)
    _check(out[0], want)
    if sink == "+inf":
        assert torch.equal(out, torch.zeros_like(out))
    if sink == "finite":
        assert (want - attend(q[0], p.keys(sw, [0, 1]), SCALE)).abs().max() > 0.05


@pytest.mark.parametrize("topk", [128, 136])
def test_lens_128_only_reads_no_compressed_key(topk):
    g = seeded(7)
    p = Pools(g)                                    # compressed pool stays all-NaN
    sw = list(range(64, 192))
    p.put("swa", sw)
    idx = _row(sw, [0, 1, 2, 3, 4, 5, 6, 7][:topk - 128], topk).unsqueeze(0)
    q = torch.randn(1, 2, 512, generator=g).to(BF16)
    out = _dsv4(q, p.swa.to(BF16), idx, p.cmp.to(BF16), torch.tensor([128], dtype=I32),
                torch.tensor([4096], dtype=I32), cum_seq_lens_q=torch.tensor([0, 1], dtype=I32),
                max_q_len=1)
    _check(out[0], attend(q[0], p.keys(sw, []), SCALE))


def test_all_invalid_row_and_rows_outside_requests_give_zero():
    g = seeded(8)
    p = Pools(g)
    p.put("swa", [0])
    idx = torch.full((3, 132), -1, dtype=I32)
    idx[2, 0] = 0                                   # token 2 lies outside cum_seq_lens_q
    out = torch.full((3, 4, 512), 7.0, dtype=BF16)
    q = torch.randn(3, 4, 512, generator=g).to(BF16)
    _dsv4(q, p.swa.to(BF16), idx, p.cmp.to(BF16), torch.tensor([128, 132, 129], dtype=I32),
          torch.tensor([1, 1], dtype=I32), cum_seq_lens_q=torch.tensor([0, 1, 2], dtype=I32),
          max_q_len=1, sinks=torch.tensor([0.0, 1.0, -5.0, float("-inf")]), out=out)
    assert torch.equal(out, torch.zeros_like(out))


def _layout_views(pool, how):
    """Same rows, different tensor layouts FlashInfer accepts; "padded": pages 3 rows apart
    more than page_size (flat token addressing reads slot s at row s of the span)."""
    if how == "hnd3":
        return pool, "HND"
    if how == "hnd4":
        return pool.unsqueeze(1), "HND"
    if how == "nhd4":
        return pool.unsqueeze(2), "NHD"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["hnd3", "hnd4", "nhd4"])
def test_cache_layouts_agree(how):
    g = seeded(9)
    p = Pools(g)
    sw = list(range(100, 228))
    p.put("swa", sw)
    p.put("cmp", [10, 20])
    idx = _row(sw, [10, 20], 132).unsqueeze(0)
    q = torch.randn(1, 4, 512, generator=g).to(BF16)
    swa, layout = _layout_views(p.swa.to(BF16), how)
    cmp, _ = _layout_views(p.cmp.to(BF16), how)
    out = _dsv4(q, swa, idx, cmp, torch.tensor([130], dtype=I32), torch.tensor([999], dtype=I32),
                cum_seq_lens_q=torch.tensor([0, 1], dtype=I32), max_q_len=1, kv_layout=layout)
    _check(out[0], attend(q[0], p.keys(sw, [10, 20]), SCALE))


def test_packed_pool_uses_flat_token_addressing():
    """A pool whose pages are 80 rows apart but hold 64 tokens: slot s is row s of the span
    (docs/semantics.md §2.3 packed pools), so slot 80 is page 1 offset 0."""
    g = seeded(10)
    backing = poisoned_pool(1, 3 * 80, 512)
    fill(backing, [0, 5, 80, 81, 160 + 63], g)
    swa = backing.to(BF16).view(3, 80, 512)[:, :64]   # [3, 64, 512], stride(0) = 80 rows
    cmp = poisoned_pool(1, 64, 512)
    fill(cmp, [0], g)
    sw = [0, 5, 80, 81, 223]
    idx = _row(sw, [0], 132).unsqueeze(0)
    q = torch.randn(1, 2, 512, generator=g).to(BF16)
    out = _dsv4(q, swa, idx, cmp.to(BF16), torch.tensor([129], dtype=I32),
                torch.tensor([5], dtype=I32), cum_seq_lens_q=torch.tensor([0, 1], dtype=I32),
                max_q_len=1)
    keys = torch.cat([rows(backing, sw), rows(cmp, [0])])
    _check(out[0], attend(q[0], keys, SCALE))


def test_out_variant_writes_given_buffer_and_returns_it():
    g = seeded(11)
    p = Pools(g)
    p.put("swa", [0, 1])
    idx = _row([0, 1], [], 128).unsqueeze(0)
    q = torch.randn(1, 1, 3, 512, generator=g).to(BF16)
    buf = torch.full((1, 1, 3, 512), float("nan"), dtype=BF16)
    ret = _dsv4(q, p.swa.to(BF16), idx, p.cmp.to(BF16), torch.tensor([128], dtype=I32),
                torch.tensor([2], dtype=I32), out=buf)
    assert ret is buf
    _check(buf[0, 0], attend(q[0, 0], p.keys([0, 1], []), SCALE))


# ---------------------------------------------------------------------------------------------
# V3.2 (576-dim q/k, 512-dim v)

def _v32(q, cache, bt, seq, **kw):
    kw.setdefault("bmm1_scale", 576 ** -0.5)
    return td.trtllm_batch_decode_with_kv_cache_mla(
        q, cache, None, 128, 512, 64, bt, seq, 2048, bt.shape[-1], impl="reference", **kw)


@pytest.mark.parametrize("form", ["tokens", "tokens_3d_table", "dense"])
def test_v32_counts_minus_one_and_rope_dims(form):
    g = seeded(12)
    cache = poisoned_pool(4, 64, 576)
    tables = [[3, 70, -1, 9, 100, 101, 102, 103], [200, 201, 202, 203, 204, 205, 206, 207],
              [-1, -1, -1, -1, -1, -1, -1, -1], [1, 2, 3, 4, 5, 6, 7, 8]]
    counts = [5, 8, 8, 0]                       # token 3: no usable column
    for t, c in zip(tables, counts):
        fill(cache, [s for s in t[:c] if s >= 0], g)
    q = torch.randn(4, 16, 576, generator=g).to(BF16)
    bt = torch.tensor(tables, dtype=I32)
    seq = torch.tensor(counts, dtype=I32)
    if form == "tokens":
        out = _v32(q, cache.to(BF16), bt, seq)
    elif form == "tokens_3d_table":
        out = _v32(q, cache.to(BF16).unsqueeze(1), bt.unsqueeze(1), seq)
    else:                                       # [B=4, Q=1, H, 576]
        out = _v32(q.unsqueeze(1), cache.to(BF16), bt.unsqueeze(1), seq).squeeze(1)
    for t in range(4):
        keys = rows(cache, [s for s in tables[t][:counts[t]] if s >= 0])
        _check(out[t], attend(q[t], keys, 576 ** -0.5))
    # the 64 RoPE dims take part in the scores
    keys0 = rows(cache, [3, 70, 9, 100])
    nope = attend(q[0, :, :512], keys0[:, :512], 576 ** -0.5)
    assert (nope - attend(q[0], keys0, 576 ** -0.5)).abs().max() > 0.01


def test_v32_fp8_varlen_mtp_request_count():
    g = seeded(13)
    kv_scale, q_scale = 0.5, 2.0
    cache_f = torch.randn(2, 32, 576, generator=g)
    cache8 = (cache_f / kv_scale).to(E4M3)
    q8 = (torch.randn(3, 2, 576, generator=g) / q_scale).to(E4M3)
    cu = torch.tensor([0, 2, 3], dtype=I32)     # request 0: 2 tokens, request 1: 1 token
    seq = torch.tensor([3, 100], dtype=I32)     # request 1: more than K -> all K columns
    bt = torch.tensor([[0, 1, 2, 3], [4, -1, 6, 7], [10, 20, 30, 40]], dtype=I32)
    out = _v32(q8, cache8, bt, seq, cum_seq_lens_q=cu, max_q_len=2,
               bmm1_scale=576 ** -0.5 * q_scale * kv_scale, bmm2_scale=kv_scale)
    deq = cache8.float() * kv_scale
    for t, cols in enumerate([[0, 1, 2], [4, 6], [10, 20, 30, 40]]):
        _check(out[t], attend(q8[t].float() * q_scale, rows(deq, cols), 576 ** -0.5))


@pytest.mark.parametrize("B,Q", [(1, 1), (3, 2), (70, 3)])
def test_dense_batch_sources_count_like_torch_definition(B, Q):
    """A dense batch's key sources carry seq_lens / sparse_topk_lens as they are (the kernels
    derive the counts); ``KeySource.usable`` must give the PyTorch definition's counts,
    out-of-range lens and seq_len < q_len included."""
    g = torch.Generator().manual_seed(7 * B + Q)
    topk, T, H = 128 + 64, B * Q, 1
    seq_lens = torch.randint(-2, 300, (B,), generator=g, dtype=I32)
    topk_lens = torch.randint(100, topk + 40, (T,), generator=g, dtype=I32)
    query = torch.zeros(B, Q, H, 512, dtype=torch.bfloat16)
    pool = torch.zeros(4, 16, 512, dtype=torch.bfloat16)
    idx = torch.zeros(T, topk, dtype=I32)
    out = torch.empty(B, Q, H, 512, dtype=torch.bfloat16)
    _, sources, _ = reference.dsv4_problem(query, pool, idx, pool, topk_lens, seq_lens, out,
                                           "HND", None, None)
    want = reference.dsv4_lengths(T, B, Q, topk_lens, seq_lens, None, topk)
    for src, w in zip(sources, want):
        assert [src.usable(t) for t in range(T)] == w.tolist()
    v32_q = torch.zeros(B, Q, H, 576, dtype=torch.bfloat16)
    _, (src,), _ = reference.v32_problem(v32_q, torch.zeros(4, 16, 576, dtype=torch.bfloat16),
                                         torch.zeros(T, 200, dtype=I32), seq_lens, out, None,
                                         None)
    want = reference.v32_lengths(T, B, Q, seq_lens, None, 200)
    assert [src.usable(t) for t in range(T)] == want.tolist()
    assert (want > 0).any()          # the case is not trivially all-zero
