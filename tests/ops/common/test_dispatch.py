"""The dispatcher: automatic choice, per-call and environment overrides, honest refusals."""
import inspect
import re

import pytest
import torch

from sparse_mla.ops.cache_insert import quantize_insert_v4
from sparse_mla.ops.common import dispatch, formats
from sparse_mla.ops.common.dispatch import (Dispatcher, VendorRoute, explain, implementations,
                                            last_choice, no_vendor_route)
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.tests.helpers import INTERPRETING


@pytest.fixture(autouse=True)
def _hardware_e4m3_route(monkeypatch):
    """The automatic choices below are those of a GPU with e4m3 conversions; the forced
    software route (a run of the whole tree with SPARSE_MLA_SOFT_FP8=1) passes over vendors,
    which its own test covers."""
    monkeypatch.delenv("SPARSE_MLA_SOFT_FP8", raising=False)


def _toy(name):
    d = Dispatcher(name)
    d.register("vendor", lambda x: "vendor", lambda x: None if x > 10 else "x too small")
    d.register("triton", lambda x: "triton", lambda x: None if x > 5 else "x too small for triton")
    d.register("reference", lambda x: "reference")
    return d


def test_automatic_order_and_reasons(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_IMPL", raising=False)
    d = _toy("toy_auto")
    assert d(20) == "vendor"
    assert d(7) == "triton"
    assert last_choice("toy_auto").impl == "triton"
    assert last_choice("toy_auto").rejected == {"vendor": "x too small"}
    assert d(1) == "reference"
    choice = explain("toy_auto", 1)
    assert choice.impl == "reference" and set(choice.rejected) == {"vendor", "triton"}
    assert "rejected vendor: x too small" in str(choice)


def test_automatic_check_passes_over_only_the_automatic_choice(monkeypatch):
    """An ``automatic`` check (e.g. a vendor kernel measured slower than ours) makes the
    automatic choice skip an implementation that can run, with its reason; forcing it (per
    call or by the environment) still runs it; an implementation that cannot run keeps its
    own reason."""
    monkeypatch.delenv("SPARSE_MLA_IMPL", raising=False)
    d = Dispatcher("toy_prefer")
    d.register("vendor", lambda x: "vendor", lambda x: None if x > 10 else "x too small",
               lambda x: "slower here" if x < 100 else None)
    d.register("triton", lambda x: "triton")
    assert d(20) == "triton"
    assert last_choice("toy_prefer").rejected == {"vendor": "slower here"}
    assert d(200) == "vendor"
    assert d(5) == "triton" and last_choice("toy_prefer").rejected == {"vendor": "x too small"}
    assert d(20, impl="vendor") == "vendor"
    monkeypatch.setenv("SPARSE_MLA_IMPL", "vendor")
    assert d(20) == "vendor" and last_choice("toy_prefer").forced_by == "SPARSE_MLA_IMPL"
    with pytest.raises(ImplementationUnavailable, match="x too small"):
        d(5)


def test_forced_software_e4m3_passes_over_vendors_automatically(monkeypatch):
    """SPARSE_MLA_SOFT_FP8=1 stands in for a GPU below sm_89, where no vendor kernel runs: the
    automatic choice runs ours (forcing the vendor still runs it). Found on an H200, where the
    switch sent the V3.2 backend's decodes to FlashMLA, not to the software route."""
    monkeypatch.delenv("SPARSE_MLA_IMPL", raising=False)
    d = _toy("toy_soft")
    monkeypatch.setenv("SPARSE_MLA_SOFT_FP8", "1")
    assert d(20) == "triton"
    assert "SPARSE_MLA_SOFT_FP8=1" in last_choice("toy_soft").rejected["vendor"]
    assert d(20, impl="vendor") == "vendor"
    monkeypatch.setenv("SPARSE_MLA_SOFT_FP8", "0")
    assert d(20) == "vendor"


def test_forced_per_call_and_by_env(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_IMPL", raising=False)
    d = _toy("toy_forced")
    assert d(20, impl="reference") == "reference"
    with pytest.raises(ImplementationUnavailable, match="'vendor' was forced by impl= but cannot "
                                                        "run: x too small"):
        d(3, impl="vendor")
    monkeypatch.setenv("SPARSE_MLA_IMPL", "triton")
    assert d(20) == "triton"
    with pytest.raises(ImplementationUnavailable, match="forced by SPARSE_MLA_IMPL"):
        d(1)
    assert d(1, impl="reference") == "reference"            # per call beats the environment
    monkeypatch.setenv("SPARSE_MLA_IMPL", "gather_dequant=reference,toy_forced=reference")
    assert d(20) == "reference"
    monkeypatch.setenv("SPARSE_MLA_IMPL", "gather_dequant=reference")
    assert d(20) == "vendor"
    monkeypatch.setenv("SPARSE_MLA_IMPL", "fastest")
    with pytest.raises(ValueError, match="SPARSE_MLA_IMPL asks for implementation 'fastest'"):
        d(20)
    with pytest.raises(ValueError, match="impl= asks for implementation 'cuda'"):
        d(20, impl="cuda")


def test_implementations_registers_vendor_triton_reference_with_their_checks(monkeypatch):
    """dispatch.implementations, every family's one way to register its ops: the vendor route
    with its own checks (or the reason there is none), Triton wherever every tensor argument
    (positional or keyword) allows it, the reference everywhere."""
    monkeypatch.delenv("SPARSE_MLA_IMPL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run = {name: (lambda x, y=None, name=name: name) for name in ("vendor", "triton", "ref")}
    none = implementations("toy_family_none", vendor=no_vendor_route("no vendor kernel here"),
                           triton=run["triton"], reference=run["ref"])
    cpu = torch.zeros(1)
    assert none(cpu) == "ref"
    rejected = last_choice("toy_family_none").rejected
    assert rejected["vendor"] == "no vendor kernel here"
    assert "TRITON_INTERPRET=1" in rejected["triton"]
    with pytest.raises(ImplementationUnavailable, match="no vendor kernel here"):
        none(cpu, impl="vendor")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert none(cpu) == "triton"
    meta = torch.zeros(1, device="meta")
    assert "['cpu', 'meta']" in explain("toy_family_none", cpu, y=meta).rejected["triton"]
    assert "['cpu', 'meta']" in explain("toy_family_none", 3, meta, cpu).rejected["triton"]
    # the CPU stands in for an architecture the route was verified on (no canary: its own test)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    routed = implementations(
        "toy_family_vendor", triton=run["triton"], reference=run["ref"],
        vendor=VendorRoute(run["vendor"], lambda x, y=None: None if x.numel() > 1 else "small",
                           lambda x, y=None: "slower" if x.numel() < 4 else None,
                           verified_ccs=((9, 0),)))
    assert routed(torch.zeros(4)) == "vendor"
    assert routed(torch.zeros(2)) == "triton"
    assert last_choice("toy_family_vendor").rejected == {"vendor": "slower"}
    assert routed(torch.zeros(2), impl="vendor") == "vendor"
    assert routed(cpu) == "triton" and last_choice("toy_family_vendor").rejected == {
        "vendor": "small"}


def test_cache_insert_reports_what_ran(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_IMPL", raising=False)
    cache = formats.alloc_paged_cache("v4", 1, 4)
    k = torch.randn(1, 512, dtype=torch.bfloat16)
    quantize_insert_v4(k, cache, torch.tensor([0]))
    choice = last_choice("sparse_mla::quantize_insert_v4")
    assert choice.rejected["vendor"].startswith("no vendor wheel ships this op")
    if INTERPRETING:
        assert choice.impl == "triton"
    else:
        assert choice.impl == "reference"
        assert "TRITON_INTERPRET=1" in choice.rejected["triton"]
        with pytest.raises(ImplementationUnavailable, match="tensors are on CPU"):
            quantize_insert_v4(k, cache, torch.tensor([0]), impl="triton")
    with pytest.raises(ImplementationUnavailable, match="no vendor wheel ships this op"):
        quantize_insert_v4(k, cache, torch.tensor([0]), impl="vendor")


def test_cuda_device_of_names_the_first_cuda_tensor():
    """The GPU the dispatcher switches to for a call (Triton launches on the current one;
    every op test also runs on cuda:1 where there are two GPUs: tests/helpers.py)."""
    from sparse_mla.ops.common.dispatch import cuda_device_of
    cpu = torch.zeros(2)
    assert cuda_device_of((cpu, 3, None), {"x": cpu}) is None
    assert cuda_device_of((), {}) is None
    if torch.cuda.is_available():
        last = torch.cuda.device_count() - 1
        assert cuda_device_of((cpu, 1.0), {"t": torch.zeros(1, device=f"cuda:{last}")}) == last


_ENV_TOY = _toy("toy_env_typo")


@pytest.mark.parametrize("value,msg", [
    ("tritn", "SPARSE_MLA_IMPL asks for implementation 'tritn'; expected one of "
              "('auto', 'vendor', 'triton', 'reference')"),
    ("quantize_insert_v5=triton", "unknown op 'quantize_insert_v5'; valid ops: "
                                  "c128a_indices_and_lens, combine_topk_swa_indices"),
    ("gather_dequant=trition", "implementation 'trition' for gather_dequant"),
    ("gather_dequant=triton,reference", "item 'reference' is not op=impl"),
])
def test_a_bad_sparse_mla_impl_raises_at_first_use_naming_the_valid_ones(monkeypatch, value,
                                                                         msg):
    """A typo in SPARSE_MLA_IMPL used to be ignored silently (the op stayed automatic); any
    op call now refuses it, before running anything, and names what is valid."""
    d = _ENV_TOY
    monkeypatch.setenv("SPARSE_MLA_IMPL", value)
    with pytest.raises(ValueError, match=re.escape(msg)):
        d(20)
    monkeypatch.setenv("SPARSE_MLA_IMPL", "sparse_mla::toy_env_typo=reference,"
                                          "gather_dequant=auto")
    assert d(20) == "reference"


def test_explain_of_an_unknown_op_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown op 'flashmla_decode'; valid ops: .*"
                                         "flashmla_sparse_decode, flashmla_sparse_prefill"):
        explain("flashmla_decode")
    with pytest.raises(ValueError, match="unknown op"):
        last_choice("sparse_mla::nope")


def test_every_op_is_listed_by_family_and_documented_for_help():
    """dispatch.OPS_BY_FAMILY (what SPARSE_MLA_IMPL and explain accept before a family is
    imported) is exactly the set of registered ops; help() on each op object shows its own
    signature and docstring, not torch's generic CustomOpDef text."""
    import importlib
    import pydoc
    from sparse_mla.ops.common import dispatch
    registered = set(dispatch.load_all())
    listed = set(dispatch.FAMILY_OF)
    assert listed <= registered
    assert {op for op in registered if not op.startswith("toy_")} == listed
    for fam, ops in dispatch.OPS_BY_FAMILY.items():
        module = importlib.import_module(f"sparse_mla.ops.{fam}")
        for name in ops:
            op = getattr(module, name)
            text = pydoc.render_doc(op, renderer=pydoc.plaintext)
            first_line = op._init_fn.__doc__.strip().splitlines()[0]
            assert f"sparse_mla::{name}(" in text and first_line in text, name
            assert "CustomOpDef is a wrapper" not in text, name
            assert list(inspect.signature(op).parameters)[-1] == "impl", name
