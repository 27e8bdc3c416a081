"""The Triton route of every op a GLM-5.3 step calls, on CPU through the interpreter (the
glm5_backends_interpret_test target)."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.backends.glm5 import Glm5Config, Glm5FlashMLABackend
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
