"""Decode over DeepSeek-V4.1's records (docs/semantics.md §12): a 528 B main (SWA) cache with a
528 B or 288 B extra (compressed) cache, and the 584 B pair a V4.1 deployment on SM90 has.

The reference against attention over the same rows decoded independently (quant's decoders
into a plain bf16 cache); the Triton route (on Hopper the sm_90 kernel where both sources
hold V4.1 records it decodes, in 16-byte-aligned blocks, else the portable kernel) against the
reference
with docs/semantics.md §9's tolerances, on the corner cases of §9: NaN-poisoned unused rows,
-1 and out-of-cache ids, ids past the lengths, empty rows, ±inf sinks, padded block strides,
odd block sizes, 32-token SWA pages and 64-token compressed blocks. On Hopper the sm_90
kernel's decoding of 528 B rows with 528 B, 288 B or 584 B extra rows is also checked bit for
bit: its output over them equals its output over the same rows decoded by quant's decoders
into plain bf16 caches."""
import pytest
import torch

from sparse_mla.ops.attention import KeySource, sparse_attention_reference
from sparse_mla.ops.common import checks, formats, quant
from sparse_mla.ops.common.dispatch import last_choice
from sparse_mla.ops.flashmla_decode import flash_mla_with_kvcache
from sparse_mla.tests.helpers import (force_tiny_launches, hopper_with_sm90,
                                      split_kernel_name, triton_params)
from sparse_mla.tests.ops.flashmla_decode.cases import (decode_case, out_of_cache_ids,
                                                        plant)
from sparse_mla.tests.ops.flashmla_decode.test_triton import check_decode

DEVICES = triton_params()
INLINE = ("v41_inline", "v41_fp4_inline")


def _run(a, impl):
    a = dict(a)
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    return flash_mla_with_kvcache(q, cache, idx, impl=impl, **a)


def _decoded_plain(cache, fmt, bs):
    """Every slot of a paged cache decoded by quant's record decoders, as a plain bf16
    [nb, bs, 512] cache (NaN where the poison decodes to NaN)."""
    f = formats.get_format(fmt)
    blocks = checks.block_bytes_view(cache, f, bs)
    nb = cache.shape[0]
    rows = []
    width = f.token_data_bytes if f.scale_in_tail else f.data_bytes   # V4: its RoPE bf16 too
    for o in range(bs):
        data = blocks[:, f.token_data_addr(bs, o): f.token_data_addr(bs, o) + width]
        sc = blocks[:, f.token_scale_addr(bs, o): f.token_scale_addr(bs, o) + f.scale_bytes]
        rows.append(quant.dequantize_record(data, sc, fmt))
    return torch.stack(rows, dim=1).reshape(nb, bs, 512)


@pytest.mark.parametrize("fmt,extra_fmt", [("v41", "v41_fp4"), ("v41", "v41"), ("v4", "v4"),
                                           ("v41", None), ("v41_inline", "v41_fp4_inline"),
                                           ("v41_inline", "v41_inline"),
                                           ("v41_fp4_inline", None)])
def test_reference_reads_the_records_as_their_decoders_do(fmt, extra_fmt):
    b, s_q, h = 3, 2, 4
    a = decode_case("cpu", b=b, s_q=s_q, h=h, fmt=fmt, bs=32, topk=64,
                    extra=extra_fmt is not None, extra_fmt=extra_fmt, extra_bs=64,
                    extra_topk=32, seed=1)
    out, lse = _run(a, "reference")
    srcs = [KeySource(_decoded_plain(a["k_cache"], fmt, 32), "plain_bf16", 32,
                      a["indices"].reshape(b * s_q, -1), a["topk_length"], s_q)]
    if extra_fmt is not None:
        srcs.append(KeySource(_decoded_plain(a["extra_k_cache"], extra_fmt, 64), "plain_bf16",
                              64, a["extra_indices_in_kvcache"].reshape(b * s_q, -1),
                              a["extra_topk_length"], s_q))
    want_o, want_l = sparse_attention_reference(a["q"].reshape(b * s_q, h, 512), srcs,
                                                a["attn_sink"], 512 ** -0.5)
    assert out.float().abs().amax() > 0
    assert torch.equal(out.reshape(b * s_q, h, 512).view(torch.int16), want_o.view(torch.int16))
    assert torch.equal(lse.transpose(1, 2).reshape(b * s_q, h), want_l)


# (b, s_q, h, main block size, extra block size, topk, extra topk, main fmt, extra fmt,
#  page padding)
GPU_GRID = [(1, 1, 64, 32, 64, 128, 512, "v41", "v41_fp4", 0),
            (64, 2, 64, 32, 64, 128, 512, "v41", "v41_fp4", 1024),
            (64, 1, 128, 32, 64, 128, 512, "v41", "v41", 0),
            (33, 2, 16, 61, 53, 64, 128, "v41", "v41_fp4", 4),
            (3, 2, 128, 32, 64, 128, 512, "v4", "v41_fp4", 512),
            (5, 1, 8, 32, None, 128, 0, "v41", None, 0),
            (1, 1, 64, 32, 64, 128, 512, "v41", "v41", 0),
            (2, 2, 128, 32, 64, 128, 512, "v41", "v41", 1024),
            (33, 2, 64, 61, 53, 64, 128, "v41", "v41", 16),
            (7, 2, 128, 61, 53, 64, 128, "v41", "v41", 4),
            (9, 1, 64, 32, 64, 128, 512, "v41", "v4", 0),
            (40, 2, 128, 32, 64, 128, 512, "v41", "v41", 512),
            (16, 2, 128, 61, 53, 64, 128, "v41", "v41_fp4", 16),
            (24, 1, 128, 32, 53, 128, 512, "v41", "v4", 0),
            # token-inline records (vLLM 0.33): the portable kernel on every GPU; vLLM pads
            # the SWA block to lcm(528, 288) = 6336 B multiples (32 * 528 = 16896 -> 19008)
            (64, 2, 64, 32, 64, 128, 512, "v41_inline", "v41_fp4_inline", 2112),
            (33, 2, 16, 61, 53, 64, 128, "v41_inline", "v41_inline", 16),
            (5, 1, 128, 32, None, 128, 0, "v41_inline", None, 0),
            (3, 2, 64, 32, 64, 128, 512, "v41", "v41_fp4_inline", 0)]
CPU_GRID = [(2, 2, 3, 32, 64, 32, 16, "v41", "v41_fp4", 512),
            (2, 1, 5, 3, 5, 32, 16, "v41", "v41", 4),
            (1, 1, 16, 32, None, 32, 0, "v41", None, 0),
            (2, 2, 3, 32, 64, 32, 16, "v41_inline", "v41_fp4_inline", 2112),
            (2, 1, 5, 3, 5, 32, 16, "v41_inline", "v41_inline", 4),
            (1, 2, 4, 5, 3, 16, 8, "v41_fp4_inline", "v4", 0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(GPU_GRID)))
@pytest.mark.parametrize("shape", ["auto", "general"])
def test_triton_matches_reference(device, case, shape, monkeypatch, request):
    """Every grid case with the planner's launch shape and, forced, the general one (the
    interpreter's small cases are otherwise all tiny launches)."""
    if shape == "general":
        force_tiny_launches(request, False)
    grid = CPU_GRID if device == "cpu" else GPU_GRID
    if case >= len(grid):
        pytest.skip(f"the {device} grid has {len(grid)} shapes")
    b, s_q, h, bs, ebs, topk, etopk, fmt, efmt, pad = grid[case]
    a = decode_case(device, b=b, s_q=s_q, h=h, fmt=fmt, bs=bs, topk=topk, extra=bool(etopk),
                    extra_bs=ebs or 2, extra_topk=etopk or 64, seed=case, extra_fmt=efmt,
                    pad_bytes=pad, noncontig_q=case % 2 == 1)
    if efmt == fmt:
        a.pop("extra_kv_format", None)          # the default: the main cache's record
    # out-of-cache ids inside the lengths: skipped
    a["indices"] = plant(a["indices"], out_of_cache_ids(a["k_cache"].shape[0] * bs))
    ref = _run(a, "reference")
    got = _run(a, "triton")
    choice = last_choice("flashmla_sparse_decode")
    assert choice.impl == "triton"
    if device != "cpu" and hopper_with_sm90():
        if _sm90_decodes(fmt, efmt, pad) and choice.plan.route != "tiny":
            assert split_kernel_name() == "sm90_kernel"
            if h > 64 and b * s_q > 4:      # more than plan.CLUSTER_MIN_UNITS units
                assert choice.plan.route == "sm90_cluster"
                assert "2-CTA cluster" in choice.plan.reason
            else:
                assert choice.plan.route == "sm90"
                records = {"v41_fp4": "528 B + 288 B", "v4": "528 B + 584 B"}.get(efmt, "528 B")
                assert f"V4.1 {records} rows staged by cp.async" in choice.plan.reason
        else:
            assert split_kernel_name() == "_split_kernel"
            if fmt in INLINE or efmt in INLINE:     # said before the launch shape
                assert "token-inline ones (vLLM 0.33) run the portable kernel" in \
                    choice.plan.reason
            elif choice.plan.route == "tiny":
                assert choice.plan.reason.startswith("tiny launch of one head block")
            elif _sm90_decodes(fmt, efmt, 0):     # blocks misaligned
                assert choice.plan.reason == "v41 cache blocks not all 16-byte aligned"
            elif fmt != "v4":
                assert "V4.1 records" in choice.plan.reason
    elif device != "cpu":
        assert split_kernel_name() == "_split_kernel"
    check_decode(ref, got)


def _sm90_decodes(fmt, efmt, pad):
    """Whether the sm_90 kernel takes a grid case (given a launch that is not tiny): 528 B main
    rows alone or with 528 B, 288 B or 584 B extra rows, every block 16-byte aligned (pages
    are multiples of 16 B, so the padding decides)."""
    return fmt == "v41" and efmt in (None, "v41", "v41_fp4", "v4") and pad % 16 == 0


# (b, s_q, h, extra topk, seed): Hopper only
EXACT_GRID = [(4, 1, 64, 512, 0), (3, 2, 128, 512, 1), (40, 2, 64, 128, 2), (1, 1, 128, 64, 3),
              (80, 1, 128, 512, 4), (1, 1, 64, 512, 5), (1, 2, 64, 128, 6)]


@pytest.mark.parametrize("efmt", ["v41", "v41_fp4", "v4"])
@pytest.mark.parametrize("b,s_q,h,etopk,seed", EXACT_GRID)
def test_sm90_decodes_v41_rows_exactly(b, s_q, h, etopk, seed, efmt, monkeypatch, request):
    """The sm_90 kernel (2-CTA clusters at h128) over 528 B main + 528 B, 288 B or 584 B extra
    rows against the same kernel over those rows
    decoded by quant's decoders into plain bf16 caches (the same launch plan, the same
    consumers: equal outputs bit for bit iff the producer decodes each row exactly as the
    reference does), with -1 / out-of-cache ids, ids past the lengths, empty rows and ±inf
    sinks. Small launches of the plain rows are kept off the tiny shape, as V4.1 ones are."""
    from sparse_mla.ops.attention import sparse_attention_triton
    if not hopper_with_sm90():
        pytest.skip("needs the sm_90 Gluon kernel (an H100 / H200 with a Triton it supports)")
    force_tiny_launches(request, False)
    a = decode_case("cuda", b=b, s_q=s_q, h=h, fmt="v41", bs=32, topk=128, extra_bs=64,
                    extra_topk=etopk, seed=seed, extra_fmt=efmt, pad_bytes=512)
    a["indices"] = plant(a["indices"], out_of_cache_ids(a["k_cache"].shape[0] * 32))
    t = b * s_q
    q = a["q"].reshape(t, h, 512)
    keys = [(a["k_cache"], "v41", 32, a["indices"], a["topk_length"]),
            (a["extra_k_cache"], efmt, 64, a["extra_indices_in_kvcache"],
             a["extra_topk_length"])]
    outs, plans = [], []
    for plain in (False, True):
        srcs = [KeySource(_decoded_plain(c, f, bs) if plain else c,
                          "plain_bf16" if plain else f, bs, i.reshape(t, -1), n, s_q)
                for c, f, bs, i, n in keys]
        o = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((t, h), float("nan"), device="cuda")
        plans.append(sparse_attention_triton(q, srcs, a["attn_sink"], 512 ** -0.5, o, lse))
        outs.append((o, lse))
    (o, lse), (want_o, want_lse) = outs
    cluster = h > 64 and t > 4      # more than plan.CLUSTER_MIN_UNITS units
    assert [p.route for p in plans] == ["sm90_cluster" if cluster else "sm90", "sm90"]
    assert plans[0].staged and plans[0].phases == plans[1].phases
    assert want_o.float().abs().amax() > 0 and not want_o.isnan().any()
    assert torch.equal(o.view(torch.int16), want_o.view(torch.int16))
    assert torch.equal(lse, want_lse)


def test_validation_names_the_formats():
    a = decode_case("cpu", b=1, s_q=1, h=2, fmt="v41", bs=32, topk=16, extra_fmt="v41_fp4",
                    extra_bs=64, extra_topk=16)
    with pytest.raises(ValueError, match="extra_kv_format must be one of"):
        _run(dict(a, kv_format="v32", extra_kv_format="v41_fp4"), "reference")
    with pytest.raises(ValueError, match=r"extra_k_cache must use format v41 \(extra_kv_format"):
        _run(dict(a, extra_kv_format="v41"), "reference")
    with pytest.raises(ValueError, match="extra_k_cache must use the same format as k_cache"):
        _run({k: v for k, v in a.items() if k != "extra_kv_format"}, "reference")
    with pytest.raises(ValueError, match="kv_format must be"):
        _run(dict(a, kv_format="v5"), "reference")
    # a footer cache passed as its inline twin: the same 528 / 288 bytes per token, so the
    # shape cannot tell them apart; the format argument is the caller's statement of layout
    with pytest.raises(ValueError, match=r"extra_k_cache must use format v41_inline"):
        _run(dict(a, extra_kv_format="v41_inline"), "reference")
