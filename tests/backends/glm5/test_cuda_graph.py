"""GLM-5.3 decode steps captured in a CUDA graph and replayed (GPU-only: run on the GPU machine
by tools/gpu_check.sh, in no CPU target)."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.tests.backends.glm5 import test_indexer_step as layer
from sparse_mla.tests.backends.glm5.test_step import H, Sim, _backend, _check, oracle
from sparse_mla.tests.helpers import requires_cuda


@requires_cuda
@pytest.mark.parametrize("s_q", (1, 2))
def test_decode_step_graph_replays(s_q):
    """Captured once, replayed with the batch metadata copied in place: each replay equals
    the oracle (as _check reads it) and the eager step on a twin backend."""
    (be, cache), (be2, cache2) = _backend("cuda"), _backend("cuda")
    sims = [Sim("cuda", seed=9), Sim("cuda", seed=9)]
    written = [set(), set()]
    reqs = [(0, 30), (1, 20), (2, 12), (3, 41)]
    for i, (b_, c_) in enumerate(((be, cache), (be2, cache2))):
        _check(b_, c_, sims[i], sims[i].step([], reqs), written[i])
        _check(b_, c_, sims[i], sims[i].step([(r, s_q) for r, _ in reqs], []), written[i])
    static = sims[0].step([(r, s_q) for r, _ in reqs], [])
    q, kv, b = static[:3]
    out = torch.zeros(q.shape[0], H, 512, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.forward(q, kv, {"kv": cache}, b, out=out)
    for i in range(3):
        st = static
        if i:
            st = sims[0].step([(r, s_q) for r, _ in reqs], [])
            q.copy_(st[0])
            kv.copy_(st[1])
            for f in ("query_start_loc", "seq_lens", "positions", "swa_block_table",
                      "swa_slot_mapping", "topk_indices"):
                getattr(b, f).copy_(getattr(st[2], f))
        graph.replay()
        written[0].update(int(s) for s in b.slot_mapping.cpu() if s >= 0)
        eager = _check(be2, cache2, sims[1], sims[1].step([(r, s_q) for r, _ in reqs], []),
                       written[1])
        torch.cuda.synchronize()
        ref = oracle(q, cache, b, st[3], st[4], sims[0], be.config.softmax_scale)
        torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=2e-2)
        assert torch.equal(out, eager), f"replay {i} differs from the eager step"


@requires_cuda
@pytest.mark.parametrize("s_q", (1, 2))
def test_indexer_step_decode_graph_replays(s_q):
    """The whole layer step (kpool insert, pool top-k into the persistent buffer, MLA write,
    attention) captured once and replayed with new decode inputs copied in place: each
    replay's selection equals the oracle's scoring path exactly (no short-context shortcut in
    a graph), its output the oracle's and, bit for bit, the eager step's on a twin."""
    steps = [layer.make_step("cuda", "auto") for _ in range(2)]
    sims = [layer.LayerSim("cuda", seed=4, ties=True) for _ in range(2)]
    written = [set(), set()]
    reqs = [(0, 30), (1, 20), (2, 12), (3, 41)]
    dec = [(r, s_q) for r, _ in reqs]
    for (step, *caches), sim, w in zip(steps, sims, written):
        layer.run_check(step, caches, sim, sim.step([], reqs), w)
        layer.run_check(step, caches, sim, sim.step(dec, [], 2), w)
    (step, cache, k_cache, tail), sim = steps[0], sims[0]
    static = sim.step(dec, [], 2)
    q, kv, b = static[:3]
    ix = sim.inputs(static, k_cache, tail)
    out = torch.zeros(q.shape[0], H, 512, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.forward(q, kv, {"kv": cache}, b, ix, out=out)
    for i in range(3):
        st = static if not i else sim.step(dec, [], 2)
        if i:
            for dst, src in zip((q, kv, ix.q, ix.weights, ix.k, ix.gate, ix.tail_slot_mapping),
                                st[:2] + st[3:8]):
                dst.copy_(src)
            for f in ("query_start_loc", "seq_lens", "positions", "swa_block_table",
                      "swa_slot_mapping", "compressed_block_table", "compressed_slot_mapping"):
                getattr(b, f).copy_(getattr(st[2], f))
        graph.replay()
        torch.cuda.synchronize()
        written[0].update(int(s) for s in b.slot_mapping.cpu() if s >= 0)
        sim.check_pooled_cache(k_cache)
        want = sim.expected_topk(st, capturing=True)
        assert torch.equal(step.topk[:q.shape[0]].cpu(), want), f"replay {i}: selection"
        ref = sim.attention(st, cache, want, step.config.softmax_scale)
        n = len(st[-1])
        torch.testing.assert_close(out[:n].cpu().double(), ref[:n], atol=2e-2, rtol=2e-2)
        s2, *c2 = steps[1]
        eager = layer.run_check(s2, c2, sims[1], sims[1].step(dec, [], 2), written[1])
        assert torch.equal(out, eager), f"replay {i} differs from the eager step"
        assert torch.equal(step.topk[:q.shape[0]], s2.topk[:q.shape[0]])
