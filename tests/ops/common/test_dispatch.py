"""The dispatcher: automatic choice, per-call and environment overrides, honest refusals."""
import pytest
import torch

from sparse_mla.ops.cache_insert import quantize_insert_v4
from sparse_mla.ops.common import formats
from sparse_mla.ops.common.dispatch import Dispatcher, explain, last_choice
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.tests.helpers import INTERPRETING


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
    monkeypatch.setenv("SPARSE_MLA_IMPL", "other_op=reference,toy_forced=reference")
    assert d(20) == "reference"
    monkeypatch.setenv("SPARSE_MLA_IMPL", "other_op=reference")
    assert d(20) == "vendor"
    monkeypatch.setenv("SPARSE_MLA_IMPL", "fastest")
    with pytest.raises(ValueError, match="SPARSE_MLA_IMPL asks for implementation 'fastest'"):
        d(20)
    with pytest.raises(ValueError, match="impl= asks for implementation 'cuda'"):
        d(20, impl="cuda")


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
