"""A uniform decode step (s_q 1 and 2) captured once in a CUDA graph and replayed over several
steps with the batch metadata updated in place: every replay equals the oracle and the same
step run eagerly."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla.backends.v4.indexer_step import IndexerInputs
from sparse_mla.tests.backends.cases import KINDS, Harness, config
from sparse_mla.tests.backends.v4.test_indexer_step import IndexerHarness
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


GRAPH_FIELDS = ("query_start_loc", "seq_lens", "positions", "swa_block_table",
                "swa_slot_mapping", "compressed_block_table", "compressed_slot_mapping")


@requires_cuda
@pytest.mark.parametrize("s_q", (1, 2))
def test_indexer_decode_step_graph_replays(s_q):
    """A uniform decode step with the indexer (``IndexerStep``), captured once in a CUDA graph
    and replayed with the inputs updated in place: every replay selects the top-k the eager
    step selects (and the oracle's, within fp32 ties) and gives the eager step's output."""
    graphed, eager = (IndexerHarness("flashmla", "cuda", seed=21, fp8=True, impl="auto")
                      for _ in range(2))
    reqs = [(0, 150), (1, 90), (2, 40), (3, 200)]
    dec = [(r, s_q) for r, _ in reqs]
    for ih in (graphed, eager):
        ih.run([], reqs)
        ih.run(dec, [])                      # warm-up: compiles every kernel
    h = graphed.h
    static = h.sim.step(dec, [])
    q, w, k, toks = graphed.inputs(static, dec, [])
    ix = IndexerInputs(q.cuda(), w.cuda(), k.cuda(), graphed.cache)
    batch = dataclasses.replace(static.batch, topk_indices=None)
    out = torch.zeros(static.q.shape, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step.forward(static.q, static.kv, h.caches, batch, ix, h.cos_sin, h.sink, out,
                             static.compressed_kv)
    for i in range(4):
        st = static
        if i:
            st = h.sim.step(dec, [])
            q, w, k, toks = graphed.inputs(st, dec, [])
            for dst, src in ((static.q, st.q), (static.kv, st.kv), (ix.q, q), (ix.weights, w),
                             (ix.k, k), (static.compressed_kv, st.compressed_kv)):
                dst.copy_(src)
            for f in GRAPH_FIELDS:
                getattr(batch, f).copy_(getattr(st.batch, f))
        graph.replay()
        graphed.written.update(st.comp_slots)
        h.written["swa"].update(st.swa_slots)
        h.written["compressed"].update(st.comp_slots)
        _, ref_topk, ref_out = eager.run(dec, [])
        torch.cuda.synchronize()
        T = st.q.shape[0]
        exp, scores = graphed.oracle_topk(q, w, toks, st.batch.positions.cpu(), T)
        graphed.check_topk(graphed.step.topk[:T].cpu(), exp, scores)
        assert torch.equal(graphed.step.topk[:T].cpu(), ref_topk), f"replay {i}: top-k"
        assert torch.equal(out, ref_out), f"replay {i} differs from the eager step"
    graphed.check_untouched()
    h.check_untouched()


@requires_cuda
@pytest.mark.parametrize("backend", ("flashmla", "trtllm_bf16"))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_decode_step_graph_replays_mtp_8(backend, kind):
    test_decode_step_graph_replays(backend, 8, kind)


@requires_cuda
def test_indexer_decode_step_graph_replays_mtp_8():
    test_indexer_decode_step_graph_replays(8)
