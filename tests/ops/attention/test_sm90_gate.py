"""Which Triton versions get the sm_90 kernel, and the reason a launch does not."""
import sys

import pytest
import torch

from sparse_mla.ops.attention import plan


@pytest.mark.parametrize("version,ok", [
    ("3.6.0", True), ("3.6.1+git1234", True), ("3.7.0", True), ("3.7.1", True),
    ("3.8.0", True), ("3.9.0", True), ("3.9.1.post1", True),
    ("3.5.1", False), ("3.10.0", False), ("4.0", False), ("2.3.1", False), ("", False),
    ("nightly", False),
])
def test_sm90_kernel_on_the_tested_triton_range(version, ok):
    assert plan.sm90_triton_supported(version) is ok


def test_outside_the_range_the_reason_names_the_version(monkeypatch):
    for name in ("SPARSE_MLA_SM90", "SPARSE_MLA_GLUON", "TRITON_INTERPRET",
                 "SPARSE_MLA_SOFT_FP8"):
        monkeypatch.delenv(name, raising=False)
    reason = plan.sm90_disabled_reason("3.10.0")
    assert "3.10.0" in reason and "3.6-3.9" in reason
    facts = plan.DeviceFacts(capability=(9, 0), triton="3.10.0")
    ok, why = plan.sm90_route(torch.zeros(1, 1, 512), "v4", [], facts=facts)
    assert not ok and why == reason


@pytest.mark.parametrize("var,env,interp,soft,want", [
    ("SPARSE_MLA_SM90", "0", "", "0", "SPARSE_MLA_SM90=0"),
    ("SPARSE_MLA_GLUON", "0", "", "0", "SPARSE_MLA_GLUON=0"),     # the old name
    ("SPARSE_MLA_SM90", "1", "1", "0", "interpreter"),
    ("SPARSE_MLA_SM90", "1", "", "1", "SPARSE_MLA_SOFT_FP8=1")])
def test_switches_give_their_reason(var, env, interp, soft, want, monkeypatch):
    """The forced software e4m3 route (``SPARSE_MLA_SOFT_FP8=1``) is the portable kernel's
    on every GPU: the sm_90 kernel converts e4m3 in hardware only."""
    monkeypatch.setenv(var, env)
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    monkeypatch.setenv("SPARSE_MLA_SOFT_FP8", soft)
    assert want in plan.sm90_disabled_reason()
    assert not plan.sm90_enabled()


def test_cpu_tensors_are_not_routed_to_the_sm90_kernel(monkeypatch):
    for name in ("SPARSE_MLA_SM90", "SPARSE_MLA_GLUON", "TRITON_INTERPRET",
                 "SPARSE_MLA_SOFT_FP8"):
        monkeypatch.delenv(name, raising=False)
    facts = plan.DeviceFacts(capability=(9, 0), triton="3.6.0")
    ok, why = plan.sm90_route(torch.zeros(1, 1, 512), "v4", [], facts=facts)
    assert not ok and "cpu" in why
@pytest.mark.parametrize("new,old,want", [(None, "0", "SPARSE_MLA_GLUON=0"),
                                          (None, "1", None), ("1", "0", None),
                                          ("0", "1", "SPARSE_MLA_SM90=0")])
def test_the_old_switch_name_is_read_where_the_new_one_is_unset(new, old, want, monkeypatch):
    """``SPARSE_MLA_GLUON`` (the switch's old name) still turns the kernel off, unless
    ``SPARSE_MLA_SM90`` is set: then that one decides."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPARSE_MLA_SOFT_FP8", raising=False)
    monkeypatch.setattr(plan, "sm90_triton_supported", lambda *a: True)
    if new is None:
        monkeypatch.delenv("SPARSE_MLA_SM90", raising=False)
    else:
        monkeypatch.setenv("SPARSE_MLA_SM90", new)
    monkeypatch.setenv("SPARSE_MLA_GLUON", old)
    assert plan.sm90_disabled_reason() == want


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="elsewhere the device check already says no")
def test_unsupported_triton_never_imports_the_sm90_module(monkeypatch):
    """Importing the sm_90 kernel's module installs a compile hook for the whole process
    (harmless on the tested releases: tests/ops/attention/test_gluon_hooks.py), but a release
    outside the range may not even compile it, so the version check comes first."""
    monkeypatch.delitem(sys.modules, "sparse_mla.ops.attention.sm90.kernel",
                        raising=False)
    monkeypatch.delenv("SPARSE_MLA_SOFT_FP8", raising=False)
    q = torch.zeros(1, 1, 512, dtype=torch.bfloat16, device="cuda")
    facts = plan.DeviceFacts(capability=(9, 0), triton="3.10.0")
    ok, why = plan.sm90_route(q, "plain_bf16", [], facts=facts)
    assert not ok and "outside" in why
    assert "sparse_mla.ops.attention.sm90.kernel" not in sys.modules
