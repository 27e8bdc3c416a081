"""FlashMLA (sgl-flash-mla, legacy SM90 kernels) vs the reference and vs our Triton kernel.

Runs only where FlashMLA runs: an SM90 GPU with the wheel installed. Elsewhere each test is
skipped with the dispatcher's own reason.
"""
import pytest
import torch

from sparse_mla.ops.common.dispatch import explain
from sparse_mla.ops.flashmla_decode import flash_mla_sparse_fwd, flash_mla_with_kvcache
from sparse_mla.tests.helpers import CUDA
from sparse_mla.tests.ops.flashmla_decode.cases import decode_case, prefill_case
from sparse_mla.tests.ops.flashmla_decode.test_triton import _run_decode, check_decode


def _vendor_reason():
    if not CUDA:
        return "needs a CUDA GPU"
    a = decode_case("cuda", b=1, s_q=1, h=64, topk=64, extra=False)
    choice = explain("flashmla_sparse_decode", a["q"], a["k_cache"], a["indices"], None, None,
                     None, None, None, None, None, 1.0, "v4", 64, None)
    return choice.rejected.get("vendor")


REASON = _vendor_reason()
requires_vendor = pytest.mark.skipif(REASON is not None, reason=f"FlashMLA cannot run: {REASON}")


@requires_vendor
@pytest.mark.parametrize("b,s_q,h,topk,etopk", [(2, 1, 64, 128, 512), (74, 2, 128, 128, 1024),
                                                (5, 2, 8, 64, 64), (3, 1, 100, 128, 0)])
def test_vendor_decode_matches_reference_and_triton(b, s_q, h, topk, etopk):
    a = decode_case("cuda", b=b, s_q=s_q, h=h, topk=topk, bs=256, extra=bool(etopk),
                    extra_bs=64, extra_topk=etopk or 64, seed=h)
    ref = _run_decode(a, "reference")
    ven = _run_decode(a, "vendor")
    check_decode(ref, ven)
    check_decode(ven, _run_decode(a, "triton"))


@requires_vendor
def test_vendor_v32_decode():
    a = decode_case("cuda", b=4, s_q=2, h=128, fmt="v32", topk=256, extra=False,
                    use_lengths=False, sink=None, seed=3)
    check_decode(_run_decode(a, "reference"), _run_decode(a, "vendor"))


@requires_vendor
@pytest.mark.parametrize("h", [64, 128, 24])
def test_vendor_prefill_matches_reference(h):
    a = prefill_case("cuda", s_q=40, h=h, s_kv=500, topk=256, seed=h)
    ro, rm, rl = flash_mla_sparse_fwd(impl="reference", **a)
    o, m, l = flash_mla_sparse_fwd(impl="vendor", **a)
    torch.testing.assert_close(o.float(), ro.float(), atol=8e-4, rtol=3 / 128)
    fin = rl.isfinite()
    torch.testing.assert_close(l[fin], rl[fin], atol=1e-6, rtol=2 / 65536)
    torch.testing.assert_close(m[fin], rm[fin], atol=1e-6, rtol=2 / 65536)


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
