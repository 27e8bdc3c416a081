"""The V3.2 backends' Triton route on CPU through Triton's interpreter (the
v32_backends_interpret_test target): every op a step calls runs its Triton kernel, checked
against the step oracle. Tiny shapes; the GPU runs the same composition in test_step's cuda
parameters."""
from __future__ import annotations

import pytest

from sparse_mla.tests.backends.v32.cases import LAYOUTS, Harness, config
from sparse_mla.tests.helpers import INTERPRETING

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1 only "
                                "(the v32_backends_interpret_test target)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_route_matches_oracle(layout):
    h = Harness(layout, config(heads=2, max_num_tokens=256), "cpu", seed=1, impl="triton")
    out, st = h.step([], [(0, 40), (1, 100)])
    h.check(out, st, "prefills")
    out, st = h.step([(0, 2), (1, 1)], [(2, 30)], pad_tokens=1)
    h.check(out, st, "mixed")
    assert {c.impl for c in h.backend.explain().values()} == {"triton"}
