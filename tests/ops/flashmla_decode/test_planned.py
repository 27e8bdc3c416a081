"""The FlashMLA-semantics ops planned once and run many times (ops/flashmla_decode/planned.py):
a plan says before anything runs which implementation, kernel route and kernel file a call
takes; running it gives the op's answer bit for bit on fresh inputs of the same kind; a call
of another kind is refused, naming what differs, before anything is written."""
import pytest
import torch

from sparse_mla.ops import flashmla_decode as fd
from sparse_mla.ops.common import dispatch
from sparse_mla.tests.helpers import CUDA, INTERPRETING
from sparse_mla.tests.ops.flashmla_decode.cases import decode_case, prefill_case

# the reference on CPU; Triton where it runs (the interpreter's target, a GPU)
DEVICES = (["cpu"] if not INTERPRETING else []) + (["cpu-triton"] if INTERPRETING else []) + (
    ["cuda"] if CUDA else [])


def _device(name):
    return "cpu" if name.startswith("cpu") else name


# what a run takes; the rest (formats, block sizes, scale) is the plan's
RUN_ARGS = ("topk_length", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache",
            "extra_topk_length")


def _decode_args(a):
    a = dict(a)
    return (a.pop("q"), a.pop("k_cache"), a.pop("indices")), a


def _run_args(kw):
    return {k: v for k, v in kw.items() if k in RUN_ARGS}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["v4", "v32"])
def test_decode_plan_runs_as_the_op(device, fmt):
    dev = _device(device)
    shape = dict(b=2, s_q=2, h=8, fmt=fmt, topk=64, extra_topk=32)    # the interpreter's pace
    first = decode_case(dev, seed=1, **shape)
    (q, cache, idx), kw = _decode_args(first)
    plan = fd.plan_decode(q, cache, idx, **kw)
    said = str(plan)
    assert said.startswith("flashmla_sparse_decode: will run ")
    if plan.choice.impl == "triton":         # the route and the kernel's file, before the run
        assert plan.choice.plan.kernel_file in said and plan.choice.plan.reason in said
    for seed in (2, 3):                      # fresh values of the same kind
        a = decode_case(dev, seed=seed, **shape)
        (q, cache, idx), kw = _decode_args(a)
        got = fd.run_decode(plan, q, cache, idx, **_run_args(kw))
        ran = dispatch.last_choice("flashmla_sparse_decode")
        assert ran.impl == plan.choice.impl and not ran.ahead
        if plan.choice.impl == "triton":
            assert ran.plan.plan is plan.choice.plan        # the plan made before, as it is
        want = fd.flash_mla_with_kvcache(q, cache, idx, **kw)
        for x, y in zip(got, want):
            assert torch.equal(x.nan_to_num(), y.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
def test_decode_plan_refuses_another_kind(device):
    dev = _device(device)
    a = decode_case(dev, b=3, s_q=2, h=16, topk=96, extra_topk=40, seed=1)
    (q, cache, idx), kw = _decode_args(a)
    plan = fd.plan_decode(q, cache, idx, **kw)
    out = torch.full((3, 2, 16, 512), 7.0, dtype=torch.bfloat16, device=dev)
    kw = _run_args(kw)
    with pytest.raises(ValueError, match=r"made for indices shape \[3, 2, 96\].*\[3, 2, 64\]"):
        fd.run_decode(plan, q, cache, idx[..., :64], out=out, **kw)
    assert (out == 7).all()                  # refused before anything was written
    with pytest.raises(ValueError, match="attn_sink"):
        fd.run_decode(plan, q, cache, idx, **dict(kw, attn_sink=None))
    with pytest.raises(ValueError, match="made for q shape"):
        fd.run_decode(plan, q[:2], cache, idx[:2], **{k: v[:2] if k.endswith("length") else v
                                                       for k, v in kw.items()})


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_plan_runs_as_the_op(device):
    dev = _device(device)
    p = prefill_case(dev, s_q=5, h=8, s_kv=70, topk=64, seed=4)
    plan = fd.plan_prefill(p["q"], p["kv"], p["indices"], p["sm_scale"],
                           attn_sink=p["attn_sink"], topk_length=p["topk_length"])
    assert str(plan).startswith("flashmla_sparse_prefill: will run ")
    got = fd.run_prefill(plan, p["q"], p["kv"], p["indices"], attn_sink=p["attn_sink"],
                         topk_length=p["topk_length"])
    want = fd.flash_mla_sparse_fwd(p["q"], p["kv"], p["indices"], p["sm_scale"],
                                   attn_sink=p["attn_sink"], topk_length=p["topk_length"])[0]
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="topk_length"):
        fd.run_prefill(plan, p["q"], p["kv"], p["indices"], attn_sink=p["attn_sink"])


def test_a_plan_validates_its_call_as_the_op_does():
    a = decode_case("cpu", b=2, s_q=1, h=8, topk=64, seed=1)
    (q, cache, idx), kw = _decode_args(a)
    with pytest.raises(TypeError, match="indices must have dtype int32"):
        fd.plan_decode(q, cache, idx.long(), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_explain_names_the_kernel_before_the_run(device):
    """``dispatch.explain`` on the op's dispatcher arguments carries the launch plan of the
    Triton route: the same one ``plan_decode`` makes."""
    dev = _device(device)
    a = decode_case(dev, b=2, s_q=1, h=8, topk=64, seed=5)
    (q, cache, idx), kw = _decode_args(a)
    plan = fd.plan_decode(q, cache, idx, impl="triton" if device != "cpu" else "auto", **kw)
    if plan.choice.impl != "triton":
        pytest.skip("the Triton route does not run here")
    assert plan.choice.plan.route in ("portable", "tiny", "sm90", "sm90_cluster")
    assert "kernel in ops/attention/" in str(plan)
