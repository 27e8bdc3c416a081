"""A uniform DeepSeek-V4.1 decode step (s_q 1, 2 and 8; every layer kind and record choice, and
a layer reading another layer's compressed cache) captured once in a CUDA graph and replayed
with the batch metadata updated in place: every replay equals the oracle and the same step
run eagerly."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.backends.v41 import V41Kind
from sparse_mla.tests.backends.v4.test_cuda_graph import _copy_in
from sparse_mla.tests.backends.v41.cases import KINDS, RECORDS, Harness, config, record_ids
from sparse_mla.tests.helpers import requires_cuda

REQS = [(0, 150), (1, 90), (2, 40), (3, 200)]


def _capture(h, static, out):
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h.backend.forward(static.q, static.kv, h.caches, static.batch, h.cos_sin, h.sink, out,
                          static.compressed_kv)
    return graph


@requires_cuda
@pytest.mark.parametrize("s_q", (1, 2))
@pytest.mark.parametrize("heads", (8, 64))
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_decode_step_graph_replays(kind, records, heads, s_q):
    cfg = config(kind, heads=heads, records=records)
    graphed, eager = (Harness(cfg, "cuda", seed=21) for _ in range(2))
    dec = [(r, s_q) for r, _ in REQS]
    for h in (graphed, eager):
        h.step([], REQS)
        h.step(dec, [])          # warm-up: compiles every kernel
    static = graphed.sim.step(dec, [])
    out = torch.zeros(static.q.shape, dtype=torch.bfloat16, device="cuda")
    graph = _capture(graphed, static, out)
    for i in range(6):
        st = static if i == 0 else graphed.sim.step(dec, [])
        if i:
            _copy_in(static, st)
        graph.replay()
        graphed.written["swa"].update(st.swa_slots)
        graphed.written["compressed"].update(st.comp_slots)
        ref_out, _ = eager.step(dec, [])
        torch.cuda.synchronize()
        graphed.check(out, st, f"replay {i}")
        assert torch.equal(out, ref_out), f"replay {i} differs from the eager step"


@requires_cuda
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_decode_step_graph_replays_mtp_8(kind, records):
    """The same at MTP drafts of 8 (64 heads)."""
    test_decode_step_graph_replays(kind, records, 64, 8)


@requires_cuda
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("kind", (V41Kind.C1A, V41Kind.C2A), ids=lambda k: k.name)
def test_reader_layer_graph_replays(kind, records):
    """The source layer runs eagerly each step (it writes the shared entries); the reader's
    decode step is a graph replayed over the source's cache."""
    source = Harness(config(kind, records=records), "cuda", seed=41)
    reader = Harness(config(kind, owns_compressed=False, records=records), "cuda", seed=42,
                     source=source)
    dec = [(r, 1) for r, _ in REQS]
    for kw in (dict(decodes=[], prefills=REQS), dict(decodes=dec, prefills=[])):
        for h in (source, reader):
            h.step(**kw)
    source.step(dec, [])
    static = reader.sim.step(dec, [])
    static.compressed_kv, static.comp_slots = None, []
    static.batch.compressed_slot_mapping = None
    out = torch.zeros(static.q.shape, dtype=torch.bfloat16, device="cuda")
    graph = _capture(reader, static, out)
    for i in range(4):
        if i:
            source.step(dec, [])
            st = reader.sim.step(dec, [])
            st.batch.compressed_slot_mapping = None
            st.compressed_kv = None
            _copy_in(static, st)
        else:
            st = static
        graph.replay()
        reader.written["swa"].update(st.swa_slots)
        torch.cuda.synchronize()
        reader.check(out, st, f"replay {i}")
