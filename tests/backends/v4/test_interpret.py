"""The backends' Triton route on CPU through Triton's interpreter (the *_interpret_test
target): every op a step calls runs its Triton kernel, checked against the step oracle. Tiny
shapes (the interpreter is slow); the GPU runs the same composition in test_step's cuda
parameters."""
from __future__ import annotations

import pytest

from sparse_mla.backends.v4 import LayerKind
from sparse_mla.backends.v4.indexer_step import IndexerStep
from sparse_mla.tests.backends.cases import Harness, config
from sparse_mla.tests.backends.v4.test_indexer_step import IndexerHarness
from sparse_mla.tests.helpers import INTERPRETING

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1 only "
                                "(the v4_backends_interpret_test target)")


@pytest.mark.parametrize("backend", ("flashmla", "trtllm_bf16"))
@pytest.mark.parametrize("kind", (LayerKind.C4A, LayerKind.C128A), ids=lambda k: k.name)
def test_triton_route_matches_oracle(backend, kind):
    h = Harness(backend, config(kind, heads=2, max_num_tokens=256), "cpu", seed=1,
                impl="triton")
    out, st = h.step([], [(0, 40), (1, 140)])
    h.check(out, st, "prefills")
    out, st = h.step([(0, 2), (1, 1)], [(2, 30)], pad_tokens=1)
    h.check(out, st, "mixed")
    assert {c.impl for c in h.backend.explain().values()} == {"triton"}


def test_triton_indexer_route():
    """The indexer inside a step on its Triton route (insert, decode and prefill top-k)."""
    ih = IndexerHarness("trtllm_bf16", "cpu", seed=3, fp8=True, impl="triton", heads=2,
                        max_num_tokens=256)
    ih.run([], [(0, 40), (1, 70)])
    ih.run([(0, 2), (1, 1)], [(2, 30)], pad_tokens=1)
    ran = {op: c.impl for op, c in ih.step.explain().items()}
    assert {ran[op] for op in IndexerStep.OPS} == {"triton"}
