"""A uniform decode step (s_q 1 and 2) captured once in a CUDA graph and replayed over several
steps with the batch metadata updated in place: every replay equals the oracle and the same
step run eagerly."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.tests.backends.cases import KINDS, Harness, config
from sparse_mla.tests.helpers import requires_cuda

FIELDS = ("query_start_loc", "seq_lens", "positions", "swa_block_table", "swa_slot_mapping",
          "compressed_block_table", "compressed_slot_mapping", "topk_indices")


def _copy_in(static, st):
    static.q.copy_(st.q)
    static.kv.copy_(st.kv)
    if static.compressed_kv is not None:
        static.compressed_kv.copy_(st.compressed_kv)
    for f in FIELDS:
        dst = getattr(static.batch, f)
        if dst is not None:
            dst.copy_(getattr(st.batch, f))


@requires_cuda
@pytest.mark.parametrize("backend", ("flashmla", "trtllm_bf16"))
@pytest.mark.parametrize("s_q", (1, 2))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_decode_step_graph_replays(backend, s_q, kind):
    cfg = config(kind)
    graphed, eager = (Harness(backend, cfg, "cuda", seed=21) for _ in range(2))
    reqs = [(0, 150), (1, 90), (2, 40), (3, 200)]
    for h in (graphed, eager):
        h.step([], reqs)
        h.step([(r, s_q) for r, _ in reqs], [])          # warm-up: compiles every kernel
    static = graphed.sim.step([(r, s_q) for r, _ in reqs], [])
    expected = [static.expected]
    out = torch.zeros(static.q.shape, dtype=torch.bfloat16, device="cuda")
    be = graphed.backend
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.forward(static.q, static.kv, graphed.caches, static.batch, graphed.cos_sin,
                   graphed.sink, out, static.compressed_kv)
    for i in range(6):
        if i:
            st = graphed.sim.step([(r, s_q) for r, _ in reqs], [])
            _copy_in(static, st)
            expected.append(st.expected)
        else:
            st = static
        graph.replay()
        graphed.written["swa"].update(st.swa_slots)
        graphed.written["compressed"].update(st.comp_slots)
        ref_out, ref_st = eager.step([(r, s_q) for r, _ in reqs], [])
        torch.cuda.synchronize()
        graphed.check(out, st, f"replay {i}")
        assert torch.equal(out, ref_out), f"replay {i} differs from the eager step"
