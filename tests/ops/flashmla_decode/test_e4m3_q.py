"""e4m3 queries in the FlashMLA-semantics decode (docs/semantics.md §5.1): ``q`` e4m3 with an
fp32 ``q_scale`` per tensor or per token and head stands for ``q.float() * q_scale``. Every
route agrees with the reference on those values within the bf16-q path's tolerance (§9), on
the cases' poisoned caches, ragged lengths and sinks; bad scales are refused naming the
argument before anything is written."""
import pytest
import torch

from sparse_mla.ops.common.dispatch import explain, last_choice
from sparse_mla.ops.flashmla_decode import flash_mla_with_kvcache, plan_decode, run_decode
from sparse_mla.tests.helpers import triton_params
from sparse_mla.tests.ops.flashmla_decode.cases import decode_case
from sparse_mla.tests.ops.flashmla_decode.test_triton import check_decode

E4M3 = torch.float8_e4m3fn


def _quantized(a, per):
    """``a`` with q as e4m3 and its scale: one per tensor, or one per token and head."""
    q = a["q"].float()
    amax = q.abs().amax() if per == "tensor" else q.abs().amax(-1)
    scale = (amax / 448).clamp(min=2 ** -20).float()
    q8 = (q / (scale if per == "tensor" else scale.unsqueeze(-1))).to(E4M3)
    return dict(a, q=q8, q_scale=scale.reshape(1) if per == "tensor" else scale)


def _run(a, impl):
    a = dict(a)
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    return flash_mla_with_kvcache(q, cache, idx, impl=impl, **a)


def _on_cpu(a):
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in a.items()}


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("fmt,extra_fmt", [("v4", None), ("v32", None), ("v41", "v41_fp4")])
@pytest.mark.parametrize("per", ["tensor", "token-head"])
def test_e4m3_q_matches_the_reference(device, fmt, extra_fmt, per):
    """Triton (the sm_90 kernel or the portable one, as planned) against the reference, which
    reads ``q.float() * q_scale`` in fp32."""
    gpu = device != "cpu"
    a = decode_case(device, b=9 if gpu else 2, s_q=2, h=64 if gpu else 16, fmt=fmt,
                    topk=256 if gpu else 64, extra_topk=128 if gpu else 32,
                    extra_fmt=extra_fmt, seed=7)
    a = _quantized(a, per)
    got = _run(a, "triton")
    choice = last_choice("flashmla_sparse_decode")
    assert choice.impl == "triton"
    if per == "tensor":          # the kernels read the e4m3 bytes
        assert choice.plan.q_dtype == E4M3
    want = _run(_on_cpu(a), "reference")
    check_decode(want, tuple(t.cpu() for t in got))


def test_reference_reads_q_as_its_values():
    """The reference on an e4m3 q with a scale equals the reference on those values in bf16
    where they are bf16-exact (a power-of-two scale)."""
    a = decode_case("cpu", b=2, s_q=1, h=8, topk=64, seed=3)
    q8 = (a["q"].float() * 64).to(E4M3)
    scale = torch.tensor([1 / 64], dtype=torch.float32)
    got = _run(dict(a, q=q8, q_scale=scale), "reference")
    want = _run(dict(a, q=(q8.float() / 64).to(torch.bfloat16)), "reference")
    for x, y in zip(got, want):
        assert torch.equal(x, y)


@pytest.mark.parametrize("bad,match", [
    (dict(q_scale=torch.ones(1)), "q_scale dequantizes an e4m3 q"),
])
def test_a_scale_needs_an_e4m3_q(bad, match):
    a = decode_case("cpu", b=2, s_q=1, h=8, topk=64, seed=3)
    with pytest.raises(ValueError, match=match):
        _run(dict(a, **bad), "reference")


@pytest.mark.parametrize("scale,err,match", [
    (torch.ones(2), ValueError, r"q_scale must hold one value .* shape \[2, 1, 8\]"),
    (torch.ones(1, dtype=torch.float64), TypeError, "q_scale must have dtype float32"),
    (torch.ones(2, 1, 8, dtype=torch.bfloat16), TypeError, "q_scale must have dtype float32"),
])
def test_bad_scales_are_refused_before_writing(scale, err, match):
    a = decode_case("cpu", b=2, s_q=1, h=8, topk=64, seed=3)
    out = torch.full((2, 1, 8, 512), 5.0, dtype=torch.bfloat16)
    with pytest.raises(err, match=match):
        _run(dict(a, q=a["q"].to(E4M3), q_scale=scale, out=out), "reference")
    assert (out == 5).all()


def test_vendor_route_says_it_takes_bf16_q_only():
    a = decode_case("cpu", b=2, s_q=1, h=8, topk=64, seed=3)
    q = a["q"].to(E4M3)
    choice = explain("flashmla_sparse_decode", q, a["k_cache"], a["indices"], None, None,
                     a["topk_length"], a["extra_k_cache"], a["extra_indices_in_kvcache"],
                     a["extra_topk_length"], a["attn_sink"], 0.04, "v4", 64, 2, "v4")
    assert "bf16 q" in choice.rejected["vendor"]


@pytest.mark.parametrize("device", ["cpu"] + [p for p in triton_params() if p.values[0] != "cpu"])
def test_e4m3_q_plans_and_runs(device):
    """``plan_decode`` / ``run_decode`` take the scale as the op does; the plan of a
    per-tensor scale reads e4m3 q (what the Triton route launches)."""
    a = _quantized(decode_case(device, b=2, s_q=1, h=8, topk=64, extra_topk=32, seed=9), "tensor")
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    fixed = {k: a.pop(k) for k in ("kv_format", "block_size", "extra_block_size",
                                   "extra_kv_format") if k in a}
    plan = plan_decode(q, cache, idx, **fixed, **a)
    if plan.choice.impl == "triton":
        assert plan.choice.plan.q_dtype == E4M3
    got = run_decode(plan, q, cache, idx, **a)
    want = flash_mla_with_kvcache(q, cache, idx, **fixed, **a)
    for x, y in zip(got, want):
        assert torch.equal(x.nan_to_num(), y.nan_to_num())
