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
from sparse_mla.tests.ops.flashmla_decode.test_triton import (_run_decode, check_decode,
                                                               check_prefill)


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


@requires_vendor
def test_vendor_v32_decode():
    a = decode_case("cuda", b=4, s_q=2, h=128, fmt="v32", topk=256, extra=False,
                    use_lengths=False, sink=None, seed=3)
    check_decode(_run_decode(a, "reference"), _run_decode(a, "vendor"))


@requires_vendor
@pytest.mark.parametrize("h", [64, 128, 24])
def test_vendor_prefill_matches_reference(h):
    a = prefill_case("cuda", s_q=40, h=h, s_kv=500, topk=256, seed=h)
    ref = flash_mla_sparse_fwd(impl="reference", **a)
    ven = flash_mla_sparse_fwd(impl="vendor", **a)
    check_prefill(ref, ven)
    check_prefill(ven, flash_mla_sparse_fwd(impl="triton", **a))


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
def test_vendor_writes_into_given_buffers():
    a = decode_case("cuda", b=3, s_q=2, h=64, topk=64, bs=64, extra=True, extra_bs=64,
                    extra_topk=128, seed=9)
    out = torch.full((3, 2, 64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse_store = torch.full((3, 2, 64), float("nan"), device="cuda")
    ref = _run_decode(a, "reference")
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    o, l = flash_mla_with_kvcache(q, cache, idx, out=out, lse=lse_store.transpose(1, 2),
                                  impl="vendor", **a)
    assert o.data_ptr() == out.data_ptr() and l.data_ptr() == lse_store.data_ptr()
    check_decode(ref, (out, lse_store.transpose(1, 2)))
