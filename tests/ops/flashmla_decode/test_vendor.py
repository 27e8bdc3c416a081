"""FlashMLA (sgl-flash-mla, legacy SM90 kernels) vs the reference and vs our Triton kernel.

Runs only where FlashMLA runs: an SM90 GPU with the wheel installed. Elsewhere each test is
skipped with the dispatcher's own reason.
"""
import contextlib

import pytest
import torch

from sparse_mla.ops.common.dispatch import explain
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.ops.flashmla_decode import flash_mla_sparse_fwd, flash_mla_with_kvcache
from sparse_mla.tests.helpers import CUDA, naming, triton_params
from sparse_mla.tests.ops.flashmla_decode.cases import (cache_view, decode_case,
                                                        out_of_cache_ids, prefill_case)
from sparse_mla.tests.ops.flashmla_decode.test_triton import (_run_decode, captured_replay,
                                                               check_decode,
                                                               planted_out_of_cache_ids,
                                                               check_prefill, check_same,
                                                               empty_decode_case, given_buffers,
                                                               strided_decode_args,
                                                               strided_prefill_args,
                                                               v32_prefill_args,
                                                               v32_prefill_params)


def _explain_decode(a, impl=None):
    return explain("flashmla_sparse_decode", a["q"], a["k_cache"], a["indices"], None, None,
                   None, None, None, None, None, 1.0, "v4", 64, None, impl=impl)


def _vendor_reason():
    """Why FlashMLA cannot run here (None where it can), asked as a forced call is: the
    automatic choice may pass it over where it runs."""
    if not CUDA:
        return "needs a CUDA GPU"
    try:
        _explain_decode(decode_case("cuda", b=1, s_q=1, h=64, topk=64, extra=False), "vendor")
    except ImplementationUnavailable as exc:
        return str(exc)
    return None


REASON = _vendor_reason()
requires_vendor = pytest.mark.skipif(REASON is not None, reason=f"FlashMLA cannot run: {REASON}")


def vendor_cosine(fmt):
    """The cosine bound for FlashMLA's answer on ``fmt``: docs/semantics.md §9's, except V3.2, where
    its sm_90 kernel rounds each tile's fp32 scale to bf16 (docs/semantics.md §2.1). Our writer's
    scales are vLLM's raw fp32 ones, not FlashMLA's powers of two, so FlashMLA lands 7.0-7.4e-6 from
    the exact answer there (H200, lab/perf-log.md, "Issue 4 audit"), within the elementwise
    bounds."""
    return None if fmt == "v32" else 5e-6


@requires_vendor
@pytest.mark.parametrize("b,s_q,h,bs,ebs,topk,etopk,noncontig,pad", [
    (2, 1, 64, 256, 64, 128, 512, False, 0), (74, 2, 128, 256, 64, 128, 1024, False, 0),
    (5, 2, 8, 256, 64, 64, 64, False, 0), (3, 1, 100, 256, 64, 128, 0, False, 0),
    (1, 3, 1, 53, 61, 64, 128, True, 0), (321, 1, 16, 2, 53, 64, 64, False, 0),
    (4, 2, 32, 61, 2, 128, 64, True, 576)])
def test_vendor_decode_matches_reference_and_triton(b, s_q, h, bs, ebs, topk, etopk, noncontig,
                                                    pad):
    """FlashMLA through the vendor path on the issue's corner classes: odd page sizes,
    padded page strides, non-contiguous q, s_q 3, head counts it pads (1, 8, 16, 32, 100)."""
    a = decode_case("cuda", b=b, s_q=s_q, h=h, topk=topk, bs=bs, extra=bool(etopk),
                    extra_bs=ebs, extra_topk=etopk or 64, seed=h, noncontig_q=noncontig,
                    pad_bytes=pad)
    ref = _run_decode(a, "reference")
    ven = _run_decode(a, "vendor")
    check_decode(ref, ven)
    check_decode(ven, _run_decode(a, "triton"))


@pytest.mark.parametrize("device", triton_params())
def test_usable_ids_pad_and_mask_out_of_cache_ids(device):
    """The vendor path's index lists: ids in [0, capacity) kept, every other id and the
    padding columns -1; a non-contiguous list is read through its strides."""
    from sparse_mla.ops.flashmla_decode.vendor import _usable_ids
    cap = 300
    g = torch.Generator().manual_seed(0)
    wide = torch.randint(-5, cap + 5, (3, 2, 2 * 70), generator=g, dtype=torch.int32)
    idx = wide.to(device)[:, :, ::2]        # 70 columns, stride 2
    idx[0, 0, :6] = torch.tensor(out_of_cache_ids(cap), dtype=torch.int32)
    assert idx.stride(2) == 2
    # called directly, not through the op: a raw launch runs on the current GPU
    with torch.cuda.device(idx.device) if idx.is_cuda else contextlib.nullcontext():
        got = _usable_ids(idx, cap, 64).cpu()
        empty = _usable_ids(idx[:, :, :0], cap, 64).cpu()
    want = torch.where((idx.cpu() >= 0) & (idx.cpu() < cap), idx.cpu(), -1)
    assert got.shape == (3, 2, 128) and got.is_contiguous()
    assert torch.equal(got[..., :70], want) and bool((got[..., 70:] == -1).all())
    assert bool((want[0, 0, :6] == -1).all()) and bool((want >= 0).any())
    # an empty list becomes one block of -1 (FlashMLA rejects width 0)
    assert empty.shape == (3, 2, 64) and bool((empty == -1).all())


@requires_vendor
@pytest.mark.parametrize("fmt", ["v4", "v32"])
def test_vendor_skips_every_id_outside_the_cache(fmt):
    """Within the lengths FlashMLA skips only -1 (docs/semantics.md §5.1): without the vendor path's
    remapping these ids faulted or read past the cache. With it, the answer is the
    reference's, which skips them all."""
    v4 = fmt == "v4"
    a = decode_case("cuda", b=3, s_q=2, h=64, fmt=fmt, bs=64, topk=128, extra=v4,
                    extra_bs=64, extra_topk=64, use_lengths=v4, sink="random" if v4 else None,
                    seed=21)
    a, _ = planted_out_of_cache_ids(a, bs=64, extra_bs=64)
    check_decode(_run_decode(a, "reference"), _run_decode(a, "vendor"), vendor_cosine(fmt))


@requires_vendor
@pytest.mark.parametrize("view", ["4-D", "2-D", "float8_e4m3fn", "int8"])
def test_vendor_decode_takes_every_cache_view(view):
    """Every cache view the op accepts reaches FlashMLA as its [blocks, bs, 1, 584] view of
    the same bytes: the answer of the uint8 3-D caches."""
    a = decode_case("cuda", b=2, s_q=2, h=64, bs=61, topk=64, extra=True, extra_bs=2,
                    extra_topk=64, seed=31)
    v = dict(a, k_cache=cache_view(a["k_cache"], view, 61),
             extra_k_cache=cache_view(a["extra_k_cache"], view, 2))
    if view == "2-D":
        v.update(block_size=61, extra_block_size=2)
    got = _run_decode(v, "vendor")
    assert all(torch.equal(x, y) for x, y in zip(_run_decode(a, "vendor"), got))
    check_decode(_run_decode(a, "reference"), got)


@pytest.mark.parametrize("cap,runs", [((9, 0), True), ((10, 0), False), ((10, 3), False),
                                      ((12, 0), False), ((8, 0), False)])
def test_flash_mla_runs_this_op_on_sm90_only(cap, runs):
    """docs/semantics.md §10: the legacy kernels (V4 / V3.2 formats) are verified on SM90; the
    wheel's current SM100 kernels read only V4.1 formats, so SM100 says that rather than nothing."""
    from sparse_mla.ops.flashmla_decode.vendor import capability_reason
    reason = capability_reason(*cap)
    assert (reason is None) == runs
    if cap[0] == 10:
        assert "V4.1" in reason and f"SM{cap[0]}{cap[1]}" in reason


@requires_vendor
@pytest.mark.parametrize("b,h", [(2, 64), (4, 24)])
def test_vendor_decode_replays_under_cuda_graph(b, h):
    """The vendor route inside a CUDA graph: its head padding, id remap, length clamp and
    FlashMLA's scheduler (fresh metadata each call) are captured and rerun on replay, so
    the replay answers for the new inputs and lengths."""
    new, got = captured_replay(b, h, "vendor")
    check_decode(_run_decode(new, "reference"), got)


@requires_vendor
def test_automatic_decode_passes_flash_mla_over_where_the_sm90_kernel_runs(monkeypatch):
    """Decode: FlashMLA, planned on every call, was slower than our kernel on every measured
    shape (lab/perf-log.md, "Vendor decode route"), so the automatic choice takes Triton there and
    says why; without the sm_90 kernel (``SPARSE_MLA_SM90=0``) FlashMLA is chosen again. Prefill
    stays FlashMLA's (faster than ours)."""
    from sparse_mla.ops.attention.plan import sm90_enabled
    monkeypatch.delenv("SPARSE_MLA_IMPL", raising=False)
    if not sm90_enabled():
        pytest.skip("the sm_90 kernel cannot run with this Triton")
    a = decode_case("cuda", b=1, s_q=1, h=64, topk=64, extra=False)
    choice = _explain_decode(a)
    assert choice.impl == "triton" and choice.forced_by is None
    assert choice.rejected["vendor"].startswith("passed over automatically")
    assert _explain_decode(a, "vendor").impl == "vendor"
    monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    assert _explain_decode(a).impl == "vendor"
    p = prefill_case("cuda", s_q=4, h=64, s_kv=200, topk=128, seed=0)
    assert explain("flashmla_sparse_prefill", p["q"], p["kv"], p["indices"], None, None, None,
                   None, None, 1.0).impl == "vendor"


@requires_vendor
def test_vendor_v32_decode():
    a = decode_case("cuda", b=4, s_q=2, h=128, fmt="v32", topk=256, extra=False,
                    use_lengths=False, sink=None, seed=3)
    check_decode(_run_decode(a, "reference"), _run_decode(a, "vendor"), vendor_cosine("v32"))


@requires_vendor
@pytest.mark.parametrize("h", [64, 128, 24])
def test_vendor_prefill_matches_reference(h):
    a = prefill_case("cuda", s_q=40, h=h, s_kv=500, topk=256, seed=h)
    ref = flash_mla_sparse_fwd(impl="reference", **a)
    ven = flash_mla_sparse_fwd(impl="vendor", **a)
    check_prefill(ref, ven)
    check_prefill(ven, flash_mla_sparse_fwd(impl="triton", **a))


@requires_vendor
@pytest.mark.parametrize("fmt", ["v4", "v32"])
@pytest.mark.parametrize("h", [4, 64])
def test_vendor_decode_takes_strided_lengths_and_sink(fmt, h):
    """FlashMLA refuses strided lengths and sinks (RuntimeError, lab/perf-log.md, "Edges of the
    ops"); the op accepts them, so the vendor path copies them. At 64 heads the sink reaches
    FlashMLA unpadded."""
    a, cases = strided_decode_args("cuda", fmt, h)
    ref = _run_decode(a, "reference")
    for name, b in cases:
        with naming(name):
            check_decode(ref, _run_decode(b, "vendor"), vendor_cosine(fmt))


@requires_vendor
@pytest.mark.parametrize("h", [4, 128])
def test_vendor_prefill_takes_strided_lists_lengths_and_sink(h):
    """The same for prefill, whose index list FlashMLA also refuses strided."""
    a, cases = strided_prefill_args("cuda", h)
    ref = flash_mla_sparse_fwd(impl="reference", **a)
    for name, b in cases:
        with naming(name):
            check_prefill(ref, flash_mla_sparse_fwd(impl="vendor", **b))


@requires_vendor
@pytest.mark.parametrize("empty", ["topk", "extra_topk"])
def test_vendor_decode_of_empty_lists(empty):
    """An empty index list reaches FlashMLA as one block of -1 (it rejects width 0)."""
    a = empty_decode_case("cuda", empty)
    check_same(_run_decode(a, "reference"), _run_decode(a, "vendor"))


@requires_vendor
@pytest.mark.parametrize("length", ["past", "far", "negative"])
def test_vendor_clamps_lengths_to_the_index_width(length):
    """Lengths past their list's width count as the width, negative ones as 0, on every
    route. FlashMLA itself read past the list (5000 over 64 columns faulted on an H200) and
    differed for negative lengths. Every id here is a usable row, so nothing masks a misread."""
    a = decode_case("cuda", b=4, s_q=2, h=64, topk=64, bs=64, extra=True, extra_bs=64,
                    extra_topk=128, use_lengths=False, seed=31)
    for key, width in (("topk_length", 64), ("extra_topk_length", 128)):
        a[key] = torch.full((4,), {"past": width + 1, "far": 80 * width, "negative": -3}[length],
                            dtype=torch.int32, device="cuda")
        a[key][0] = width // 2
    ref = _run_decode(a, "reference")
    check_decode(ref, _run_decode(a, "vendor"))
    check_decode(ref, _run_decode(a, "triton"))
    p = prefill_case("cuda", s_q=8, h=64, s_kv=300, topk=128, seed=31)
    unused = (p["indices"] >= 0) & (p["indices"] < 300) & (p["indices"] % 7 == 0)
    p["indices"] = torch.where(unused, p["indices"] + 1, p["indices"])   # no NaN row left
    p["topk_length"].fill_({"past": 129, "far": 10240, "negative": -3}[length])
    p["topk_length"][0] = 64
    ref = flash_mla_sparse_fwd(impl="reference", **p)
    check_prefill(ref, flash_mla_sparse_fwd(impl="vendor", **p))
    check_prefill(ref, flash_mla_sparse_fwd(impl="triton", **p))


@requires_vendor
def test_vendor_passes_empty_problems_over():
    """Shapes FlashMLA rejects: an empty decode batch, prefill with s_q 0 or topk 0."""
    for empty in ("b", "s_q"):
        a = empty_decode_case("cuda", empty)
        with pytest.raises(ImplementationUnavailable, match="empty batch"):
            _explain_decode(a, "vendor")
    p = prefill_case("cuda", s_q=4, h=64, s_kv=200, topk=128, seed=0)
    for q, idx in ((p["q"][:0], p["indices"][:0]), (p["q"], p["indices"][:, :, :0])):
        with pytest.raises(ImplementationUnavailable, match="s_q > 0 and topk > 0"):
            explain("flashmla_sparse_prefill", q, p["kv"], idx, None, None, None, None, None,
                    1.0, impl="vendor")


@pytest.mark.parametrize("h,padded", [(1, 64), (16, 64), (64, 64), (65, 128), (128, 128)])
def test_flash_mla_head_padding(h, padded):
    """FlashMLA runs 64 or 128 heads; fewer are padded with zero heads up to the next one
    (pure Python: runs without the wheel)."""
    from sparse_mla.ops.flashmla_decode.vendor import flash_mla_heads
    assert flash_mla_heads(h) == padded


@pytest.mark.parametrize("h,head_dim", [(3, 2), (64, 2), (100, 1)])
def test_pad_for_flash_mla_adds_zero_heads_and_minus_inf_sinks(h, head_dim):
    """The padding the vendor path and the benchmark share: real heads unchanged, extra heads
    zero with -inf sinks, nothing copied when FlashMLA takes h as it is."""
    from sparse_mla.ops.flashmla_decode.vendor import flash_mla_heads, pad_for_flash_mla
    q = torch.randn([2, h, 576] if head_dim == 1 else [2, 1, h, 576]).to(torch.bfloat16)
    sink = torch.randn(h)
    qp, sp = pad_for_flash_mla(q, sink, head_dim=head_dim)
    hp = flash_mla_heads(h)
    assert qp.shape[head_dim] == hp and sp.shape == (hp,) and sp.dtype == torch.float32
    assert torch.equal(qp.narrow(head_dim, 0, h), q) and torch.equal(sp[:h], sink)
    assert not qp.narrow(head_dim, h, hp - h).any()
    assert bool((sp[h:] == float("-inf")).all())
    if hp == h:
        assert qp is q and sp is sink
    qp, sp = pad_for_flash_mla(q, None, head_dim=head_dim)
    assert sp is None and qp.shape[head_dim] == hp


@requires_vendor
@pytest.mark.parametrize("layout", ["flashmla", "own"])
def test_vendor_writes_into_given_buffers(layout):
    a = decode_case("cuda", b=3, s_q=2, h=64, topk=64, bs=64, extra=True, extra_bs=64,
                    extra_topk=128, seed=9)
    out, lse = given_buffers("cuda", 3, 2, 64, layout)
    ref = _run_decode(a, "reference")
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    o, l = flash_mla_with_kvcache(q, cache, idx, out=out, lse=lse, impl="vendor", **a)
    assert o is out and l is lse
    check_decode(ref, (out, lse))


@requires_vendor
@pytest.mark.parametrize("name,variant", v32_prefill_params())
def test_vendor_v32_prefill_576_matches_reference(name, variant):
    """FlashMLA's legacy V3.2 prefill (d_qk 576) on its own test classes; heads padded to
    64/128 by the vendor path where the case has fewer."""
    a = v32_prefill_args("cuda", name, variant, seed=1)
    ref = flash_mla_sparse_fwd(impl="reference", **a)
    check_prefill(ref, flash_mla_sparse_fwd(impl="vendor", **a))
