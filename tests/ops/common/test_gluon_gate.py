"""Which Triton versions get the sm_90 Gluon kernel (pure Python, no kernel)."""
import sys

import pytest

from sparse_mla.ops.common import sparse_attention_triton as core


@pytest.mark.parametrize("version,ok", [
    ("3.6.0", True), ("3.6.1+git1234", True),
    ("3.5.1", False), ("3.7.0", False), ("3.9.0", False), ("4.0", False), ("", False),
    ("nightly", False),
])
def test_gluon_kernel_only_on_the_triton_it_was_written_for(version, ok):
    assert core.gluon_triton_supported(version) is ok


def _sm90():
    import torch
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="elsewhere the device check already says no")
def test_unsupported_triton_never_imports_the_gluon_module(monkeypatch):
    """Importing the Gluon module installs a compile hook for the whole process; on another
    Triton that hook breaks every later compile, so the version check must come first."""
    import torch
    monkeypatch.delitem(sys.modules, "sparse_mla.ops.common.sparse_attention_gluon",
                        raising=False)
    monkeypatch.setattr(core, "gluon_triton_supported", lambda *a: False)
    q = torch.zeros(1, 1, 512, dtype=torch.bfloat16, device="cuda")
    assert core._gluon_module(q, "plain_bf16", []) is None
    assert "sparse_mla.ops.common.sparse_attention_gluon" not in sys.modules
