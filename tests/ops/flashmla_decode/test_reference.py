"""The decode / prefill reference against softmax worked out independently in float64."""
import torch

from sparse_mla.ops.cache_insert import quantize_insert_v4
from sparse_mla.ops.common import formats
from sparse_mla.ops.flashmla_decode import flash_mla_sparse_fwd, flash_mla_with_kvcache

SCALE = 512 ** -0.5


def _exact_rows(n):
    """Rows whose V4 quantization is exact: one power of two per 64-wide tile, bf16 RoPE."""
    rows = torch.zeros(n, 512)
    for i in range(n):
        rows[i, :448] = torch.tensor([2.0 ** ((i + t) % 5 - 2) * (-1) ** t for t in range(448)])
        rows[i, 448:] = (i + 1) * 0.125
    return rows


def _expected(q, keys, sink):
    s = SCALE * (q.double() @ keys.double().T)
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ keys.double()
    return o * torch.sigmoid(lse - sink).unsqueeze(-1), lse


def test_decode_union_of_main_and_extra_with_sinks_and_holes():
    rows = _exact_rows(6)
    main = formats.alloc_paged_cache("v4", 2, 4, fill=0xFF)       # NaN poison in unused slots
    quantize_insert_v4(rows[:4].to(torch.bfloat16), main, torch.tensor([0, 1, 2, 5]))
    extra = formats.alloc_paged_cache("v4", 2, 2, fill=0xFF)
    quantize_insert_v4(rows[4:].to(torch.bfloat16), extra, torch.tensor([3, 0]))
    q = torch.randn(1, 1, 3, 512).to(torch.bfloat16)
    # main: slots 0, 5 valid; -1 skipped; column 3 (slot 1) beyond topk_length
    idx = torch.tensor([[[0, -1, 5, 1]]], dtype=torch.int32)
    eidx = torch.tensor([[[3, 0]]], dtype=torch.int32)
    sink = torch.tensor([0.5, float("inf"), float("-inf")])
    out, lse = flash_mla_with_kvcache(
        q, main, idx, topk_length=torch.tensor([3], dtype=torch.int32), attn_sink=sink,
        extra_k_cache=extra, extra_indices_in_kvcache=eidx, impl="reference")
    keys = rows[[0, 3, 4, 5]]                                    # slot 5 holds rows[3]
    exp_o, exp_lse = _expected(q[0, 0].float(), keys, sink.double())
    assert lse.shape == (1, 3, 1)
    torch.testing.assert_close(lse[0, :, 0].double(), exp_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0, 0].double(), exp_o, rtol=2 / 128, atol=1e-3)
    assert out[0, 0, 1].eq(0).all()                              # +inf sink -> 0
    assert not out.isnan().any()


def test_decode_no_valid_key_gives_zero_and_inf_lse_whatever_the_sink():
    cache = formats.alloc_paged_cache("v4", 1, 4, fill=0xFF)
    q = torch.randn(2, 1, 2, 512).to(torch.bfloat16)
    idx = torch.tensor([[[-1, -1]], [[0, 1]]], dtype=torch.int32)   # row 1: length 0
    out, lse = flash_mla_with_kvcache(q, cache, idx, topk_length=torch.tensor([2, 0],
                                      dtype=torch.int32),
                                      attn_sink=torch.tensor([float("-inf"), 3.0]),
                                      impl="reference")
    assert out.eq(0).all() and lse.isinf().all() and (lse > 0).all()


def test_prefill_validity_rules_and_max_logits():
    kv = torch.randn(5, 1, 512).to(torch.bfloat16)
    q = torch.randn(2, 2, 512).to(torch.bfloat16)
    # row 0: -3 and 5 (= s_kv) invalid, 1 and 4 valid; row 1: topk_length 1 keeps only id 2
    idx = torch.tensor([[[1, -3, 5, 4]], [[2, 0, 1, 3]]], dtype=torch.int32)
    out, mx, lse = flash_mla_sparse_fwd(q, kv, idx, SCALE,
                                        topk_length=torch.tensor([4, 1], dtype=torch.int32),
                                        impl="reference")
    for t, ids in ((0, [1, 4]), (1, [2])):
        keys = kv[ids, 0].float()
        s = SCALE * (q[t].double() @ keys.double().T)
        torch.testing.assert_close(mx[t].double(), s.amax(-1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[t].double(), torch.logsumexp(s, -1), rtol=1e-6,
                                   atol=1e-6)
        torch.testing.assert_close(out[t].double(), torch.softmax(s, -1) @ keys.double(),
                                   rtol=2 / 128, atol=1e-3)


def test_decode_extra_length_and_garbage_past_both_lengths():
    """Each list has its own length; whatever lies past a length (INT_MAX, -2, a poisoned
    slot, a real row) is never a key (docs/semantics.md §5.1)."""
    rows = _exact_rows(6)
    main = formats.alloc_paged_cache("v4", 2, 4, fill=0xFF)
    quantize_insert_v4(rows[:4].to(torch.bfloat16), main, torch.tensor([0, 1, 2, 5]))
    extra = formats.alloc_paged_cache("v4", 2, 2, fill=0xFF)
    quantize_insert_v4(rows[4:].to(torch.bfloat16), extra, torch.tensor([3, 0]))
    q = torch.randn(2, 1, 2, 512).to(torch.bfloat16)
    # row 0: main slots 0, 5 (then INT_MAX, 1: past length 3); extra slot 3 (then 0, -2)
    # row 1: main slot 2 (then 7: poisoned, -2); nothing from extra (length 0)
    idx = torch.tensor([[[0, -1, 5, 2 ** 31 - 1, 1]], [[2, 7, -2, 0, 1]]], dtype=torch.int32)
    eidx = torch.tensor([[[3, 0, -2]], [[0, 3, 2 ** 31 - 1]]], dtype=torch.int32)
    sink = torch.tensor([0.25, -1.0])
    out, lse = flash_mla_with_kvcache(
        q, main, idx, topk_length=torch.tensor([3, 1], dtype=torch.int32), attn_sink=sink,
        extra_k_cache=extra, extra_indices_in_kvcache=eidx,
        extra_topk_length=torch.tensor([1, 0], dtype=torch.int32), impl="reference")
    for t, keys in ((0, rows[[0, 3, 4]]), (1, rows[[2]])):
        exp_o, exp_lse = _expected(q[t, 0].float(), keys, sink.double())
        torch.testing.assert_close(lse[t, :, 0].double(), exp_lse, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[t, 0].double(), exp_o, rtol=2 / 128, atol=1e-3)


def test_prefill_sink_scales_out_but_not_lse_and_empty_rows():
    kv = torch.randn(5, 1, 512).to(torch.bfloat16)
    q = torch.randn(3, 2, 512).to(torch.bfloat16)
    # row 0: ids 1, 4 (5 = s_kv is invalid); row 1: id 2 (the rest past its length); row 2:
    # length 0
    idx = torch.tensor([[[1, 5, 4, -1]], [[2, 0, 1, 3]], [[0, 1, 2, 3]]], dtype=torch.int32)
    sink = torch.tensor([0.5, float("inf")])
    out, mx, lse = flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink,
                                        topk_length=torch.tensor([4, 1, 0], dtype=torch.int32),
                                        impl="reference")
    for t, ids in ((0, [1, 4]), (1, [2])):
        keys = kv[ids, 0].float()
        exp_o, exp_lse = _expected(q[t].float(), keys, sink.double())
        torch.testing.assert_close(lse[t].double(), exp_lse, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[t].double(), exp_o, rtol=2 / 128, atol=1e-3)
        s = SCALE * (q[t].double() @ keys.double().T)
        torch.testing.assert_close(mx[t].double(), s.amax(-1), rtol=1e-6, atol=1e-6)
    assert out[:, 1].eq(0).all()                                 # +inf sink -> 0
    assert out[2].eq(0).all() and (lse[2] == float("inf")).all()
    assert (mx[2] == float("-inf")).all()


def _v32_record(nope, scales, rope):
    """One 656-byte V3.2 record written byte by byte (docs/semantics.md §2.1): 512 e4m3, 4 fp32
    scales (one per 128 dims), 64 bf16 RoPE dims."""
    return torch.cat([nope.to(torch.float8_e4m3fn).view(torch.uint8),
                      scales.to(torch.float32).view(torch.uint8),
                      rope.to(torch.bfloat16).view(torch.uint8)])


def test_v32_decode_against_hand_built_records():
    """576-wide scores (512 dequantized dims + 64 RoPE dims), 512-wide values, the default
    scale 576^-0.5; records built by hand, not by the insert op the reference shares."""
    g = torch.Generator().manual_seed(4)
    cache = formats.alloc_paged_cache("v32", 2, 3, fill=0xFF)      # NaN poison elsewhere
    keys, values = [], []
    for slot in (0, 2, 4):
        nope = torch.randint(-8, 9, (512,), generator=g).float() / 4   # exact in e4m3
        scales = torch.tensor([2.0 ** -3, 2.0 ** -1, 1.0, 2.0 ** -2])
        rope = torch.randint(-16, 17, (64,), generator=g).float() / 16
        cache[slot // 3, slot % 3] = _v32_record(nope, scales, rope)
        v = nope * scales.repeat_interleave(128)
        keys.append(torch.cat([v, rope]))
        values.append(v)
    q = (torch.randint(-4, 5, (1, 1, 2, 576), generator=g).float() / 4).to(torch.bfloat16)
    idx = torch.tensor([[[4, -1, 0, 2]]], dtype=torch.int32)
    out, lse = flash_mla_with_kvcache(q, cache, idx, kv_format="v32", impl="reference")
    k, v = torch.stack([keys[2], keys[0], keys[1]]).double(), \
        torch.stack([values[2], values[0], values[1]]).double()
    s = 576 ** -0.5 * (q[0, 0].double() @ k.T)
    torch.testing.assert_close(lse[0, :, 0].double(), torch.logsumexp(s, -1), rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(out[0, 0].double(), torch.softmax(s, -1) @ v, rtol=2 / 128,
                               atol=1e-3)
    assert out.shape == (1, 1, 2, 512)


def test_v32_prefill_576_scores_512_values_and_rules():
    """d_qk 576 (V3.2): scores over all 576 dims, output the first 512, the default scale of
    the caller's choosing; -1, s_kv and INT_MAX ids and columns past topk_length unused (a NaN
    row sits there), a row without keys gives 0 / +inf / -inf; sinks as at 512."""
    g = torch.Generator().manual_seed(11)
    kv = (torch.randn(6, 1, 576, generator=g) / 4).to(torch.bfloat16)
    kv[5] = float("nan")
    q = torch.randn(3, 2, 576, generator=g).to(torch.bfloat16)
    scale = 576 ** -0.5
    idx = torch.tensor([[[1, -1, 6, 4, 2 ** 31 - 1]], [[2, 0, 5, 5, 5]], [[5, 5, 0, 1, 2]]],
                       dtype=torch.int32)
    sink = torch.tensor([0.5, float("-inf")])
    out, mx, lse = flash_mla_sparse_fwd(q, kv, idx, scale, attn_sink=sink,
                                        topk_length=torch.tensor([5, 2, 0], dtype=torch.int32),
                                        impl="reference")
    assert out.shape == (3, 2, 512)
    for t, ids in ((0, [1, 4]), (1, [2, 0])):
        k = kv[ids, 0].double()
        s = scale * (q[t].double() @ k.T)
        lse_t = torch.logsumexp(s, -1)
        o = torch.softmax(s, -1) @ k[:, :512] * torch.sigmoid(lse_t - sink.double())[:, None]
        torch.testing.assert_close(lse[t].double(), lse_t, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mx[t].double(), s.amax(-1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[t].double(), o, rtol=2 / 128, atol=1e-3)
    assert out[2].eq(0).all() and (lse[2] == float("inf")).all()
    assert (mx[2] == float("-inf")).all()
