"""A uniform V3.2 decode step (s_q 1 and 2) captured once in a CUDA graph and replayed over
several steps with the batch metadata updated in place: every replay equals the oracle and
the same step run eagerly."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.tests.backends.v32.cases import LAYOUTS, Harness, config
from sparse_mla.tests.helpers import requires_cuda

FIELDS = ("query_start_loc", "seq_lens", "positions", "swa_block_table", "swa_slot_mapping",
          "topk_indices")


def _copy_in(static, st):
    for name in ("q", "kv"):
        getattr(static, name).copy_(getattr(st, name))
    for f in FIELDS:
        getattr(static.batch, f).copy_(getattr(st.batch, f))


@requires_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("s_q", (1, 2))
def test_decode_step_graph_replays(layout, s_q):
    graphed, eager = (Harness(layout, config(), "cuda", seed=21) for _ in range(2))
    reqs = [(0, 150), (1, 90), (2, 40), (3, 200)]
    for h in (graphed, eager):
        h.step([], reqs)
        h.step([(r, s_q) for r, _ in reqs], [])          # warm-up: compiles every kernel
    static = graphed.sim.step([(r, s_q) for r, _ in reqs], [])
    out = torch.zeros(static.q.shape[0], 8, 512, dtype=torch.bfloat16, device="cuda")
    be = graphed.backend
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.forward(static.q, static.kv, graphed.caches, static.batch, out=out)
    for i in range(4):
        st = static
        if i:
            st = graphed.sim.step([(r, s_q) for r, _ in reqs], [])
            _copy_in(static, st)
        graph.replay()
        graphed.written.update(st.slots)
        ref_out, _ = eager.step([(r, s_q) for r, _ in reqs], [])
        torch.cuda.synchronize()
        graphed.check(out, st, f"replay {i}")
        assert torch.equal(out, ref_out), f"replay {i} differs from the eager step"
