"""The Triton route of every op a GLM-5.3 step calls, on CPU through the interpreter (the
glm5_backends_interpret_test target)."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.backends.glm5 import Glm5Config, Glm5FlashMLABackend
from sparse_mla.tests.backends.glm5 import test_indexer_step as layer
from sparse_mla.tests.backends.glm5.test_step import BS, NB, POISON, TOPK, Sim, _check
from sparse_mla.tests.helpers import INTERPRETING


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1 only (the "
                    "glm5_backends_interpret_test target)")
@pytest.mark.parametrize("mode", ["separate", "mixed"])
def test_triton_route_matches_oracle(mode):
    cfg = Glm5Config(num_heads=2, max_num_tokens=96, max_num_reqs=4,
                     max_model_len=NB // 4 * BS, topk=TOPK, block_size=BS)
    be = Glm5FlashMLABackend(cfg, device="cpu", impl="triton", attention_impl="triton",
                             fp8_mode=mode)
    cache = torch.full((NB, BS, 656), POISON, dtype=torch.uint8)
    sim, written = Sim("cpu", seed=2, heads=2), set()
    _check(be, cache, sim, sim.step([], [(0, 20), (1, 9)]), written)
    _check(be, cache, sim, sim.step([(0, 2)], [(1, 5)], 1), written)
    assert {c.impl for c in be.explain().values()} == {"triton"}


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1 only (the "
                    "glm5_backends_interpret_test target)")
@pytest.mark.parametrize("ties", [False, True])
def test_indexer_step_triton_route_matches_oracle(ties):
    """The whole layer step on the Triton route (kpool insert, pool top-k, MLA write,
    attention): selections equal the float64 oracle's exactly, ties included."""
    step, *caches = layer.make_step("cpu", impl="triton", attention_impl="triton", pbs=5,
                                    heads=2)
    sim, written = layer.LayerSim("cpu", seed=11, pbs=5, ties=ties, heads=2), set()
    ran = set()
    for decodes, prefills, pad, host in (([], [(0, 27), (1, 6)], 1, False),
                                         ([(0, 2), (1, 2)], [(2, 21)], 0, True),
                                         ([(0, 1), (1, 2), (2, 2)], [], 1, False)):
        layer.run_check(step, caches, sim, sim.step(decodes, prefills, pad, host), written)
        ran |= {n for n, c in step.explain().items() if c.impl == "triton"}
    assert ran >= set(layer.Glm5IndexerStep.OPS)
