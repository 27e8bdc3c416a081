"""The V4.1 backend keeps the one backend contract (the base class's signatures)."""
from __future__ import annotations

import inspect

import pytest

from sparse_mla.backends.common.base import Backend
from sparse_mla.backends.v41 import V41FlashMLABackend
from sparse_mla.tests.backends.v4.test_contract import CONTRACT


@pytest.mark.parametrize("method", CONTRACT + ("cache_specs", "read_specs"))
def test_same_signature_as_the_base(method):
    assert inspect.signature(getattr(V41FlashMLABackend, method)) == inspect.signature(
        getattr(Backend, method)), f"V41FlashMLABackend.{method} left the contract"
