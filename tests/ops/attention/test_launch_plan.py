"""A ``LaunchPlan`` is whole before anything runs: it names the file that holds its route's
kernel (so a reader goes from ``dispatch.explain`` straight to the code), it is frozen, the
launcher carries it out as it is, and a plan reused for another call checks that the call is
of its kind."""
import dataclasses
import os

import pytest
import torch

import sparse_mla
from sparse_mla.ops.attention import KeySource, plan_attention, sparse_attention_triton
from sparse_mla.ops.attention import plan
from sparse_mla.ops.attention.policy import DEFAULT
from sparse_mla.tests.helpers import triton_params
from sparse_mla.tests.ops.flashmla_decode.cases import decode_case
from sparse_mla.ops.flashmla_decode.reference import decode_sources

ROOT = os.path.dirname(os.path.abspath(sparse_mla.__file__))


def _plan(route):
    return plan.LaunchPlan(route, "a reason", DEFAULT.general, (plan.Phase(0, 3, 2),),
                           tokens=3, heads=8, head_blocks=1, fmt="v4", extra_fmt=None,
                           widths=(64,), q_dtype=torch.bfloat16, device=torch.device("cpu"))


@pytest.mark.parametrize("route", plan.ROUTES)
def test_every_route_names_its_kernel_file(route):
    p = _plan(route)
    assert p.kernel_file in str(p) and "a reason" in str(p) and "tokens 0-3: 2 splits" in str(p)
    path = os.path.join(ROOT, p.kernel_file)
    assert os.path.isfile(path), path
    with open(path) as f:
        source = f.read()
    # the file holds the split kernel the route launches
    kernel = "sm90_kernel" if route.startswith("sm90") else "_split_kernel"
    assert f"def {kernel}(" in source


def test_every_route_has_a_kernel_file():
    assert set(plan.KERNEL_FILES) == set(plan.ROUTES)


def test_a_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _plan("portable").route = "sm90"


def _core_call(device, seed=3, **kw):
    a = decode_case(device, b=2, s_q=2, h=16, bs=64, topk=64, extra=True, extra_topk=32,
                    extra_bs=64, seed=seed, **kw)
    b, s_q, h, d = a["q"].shape
    srcs = decode_sources(a["k_cache"], a["indices"], a["topk_length"], a["extra_k_cache"],
                          a["extra_indices_in_kvcache"], a["extra_topk_length"], "v4", 64, 64)
    return a["q"].reshape(b * s_q, h, d), srcs


@pytest.mark.parametrize("device", triton_params())
def test_the_launcher_runs_the_plan_made_before_it(device):
    """The plan ``plan_attention`` makes without launching is the one the launch carries out,
    and passing it back runs the same kernels to the same bits."""
    q, srcs = _core_call(device)
    before = plan_attention(q, srcs)
    out1 = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16, device=device)
    out2 = torch.empty_like(out1)
    ran = sparse_attention_triton(q, srcs, None, 0.05, out1)
    assert ran.plan == before
    again = sparse_attention_triton(q, srcs, None, 0.05, out2, plan=before)
    assert again.plan is before and torch.equal(out1, out2)


@pytest.mark.parametrize("device", triton_params())
def test_a_plan_refuses_a_call_of_another_kind(device):
    q, srcs = _core_call(device)
    p = plan_attention(q, srcs)
    out = torch.empty(q.shape[0] - 1, q.shape[1], 512, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="made for tokens 4, the call has 3"):
        sparse_attention_triton(q[:-1], srcs, None, 0.05, out, plan=p)
    wider = [dataclasses.replace(srcs[0], indices=torch.cat([srcs[0].indices] * 2, 1)), srcs[1]]
    with pytest.raises(ValueError, match="index widths"):
        sparse_attention_triton(q, wider, None, 0.05, out, plan=p)


def test_policy_reaches_the_plan():
    """A policy passed to the planner changes the plan (a fixed split count), the default
    one does not."""
    q = torch.zeros(4, 16, 512, dtype=torch.bfloat16)
    idx = torch.zeros(4, 256, dtype=torch.int32)
    src = KeySource(torch.zeros(4, 64, 584, dtype=torch.uint8), "v4", 64, idx)
    fixed = plan.plan_launch(q, [src], policy=dataclasses.replace(DEFAULT, splits=3))
    assert fixed.phases == (plan.Phase(0, 4, 3),)
    model = plan.plan_launch(q, [src])
    assert model.policy is DEFAULT
