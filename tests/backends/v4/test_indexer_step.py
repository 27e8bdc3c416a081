"""A C4A step with the Lightning indexer inside (backends/v4/indexer_step.py): insert ->
top-k -> combine -> attention in one call gives the top-k an independent float64 indexer
oracle computes from the history of indexer keys (docs/semantics.md §11), and exactly the
output of the backend's own path given that top-k; mixed decode / prefill batches, MTP of
uniform and varying lengths, graph-padding rows and requests; the indexer cache (poisoned)
is never written outside this step's slots; bad input raises before any write."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla.backends.v4 import LayerKind
from sparse_mla.backends.v4.indexer_step import IndexerInputs, IndexerStep
from sparse_mla.ops.common import quant
from sparse_mla.tests.backends.cases import Harness, config
from sparse_mla.tests.helpers import CUDA, storage_bytes

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
IDX_HEADS, DIM, RATIO = 4, 128, 4

# (1) two prefills from position 0; (2) an MTP decode, a prefill chunk with context, a new
# prefill, graph padding; (3) MTP decodes of 1-3 tokens (padded to a uniform next_n inside
# the step) with graph padding; (4) uniform MTP decodes plus two empty graph-padding requests.
SCRIPT = (
    dict(decodes=[], prefills=[(0, 200), (1, 150)]),
    dict(decodes=[(0, 2)], prefills=[(1, 60), (2, 140)], pad_tokens=3),
    dict(decodes=[(0, 1), (1, 3), (2, 1)], prefills=[], pad_tokens=2),
    dict(decodes=[(0, 2), (1, 2)], prefills=[], pad_tokens=4, pad_reqs=2),
)


def stored(k: torch.Tensor, fp8: bool) -> torch.Tensor:
    """[n, 128] rows -> float64 as the indexer cache holds them (§11.1): bf16, or a
    power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) times the e4m3 of row / scale."""
    x = k.to(torch.bfloat16).double()
    if not fp8:
        return x
    amax = x.abs().amax(-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    e4m3 = quant.e4m3((x / scale[:, None]).float()).view(torch.float8_e4m3fn).double()
    return e4m3 * scale[:, None]


def expected_ids(q, w, keys, n_cand, topk):
    """float64 sum_h w_h relu(q_h . k_j) over entries j < n_cand; larger first, ties by lower
    id, -1 padded; also the scores (for the tolerance of the Triton route)."""
    row = torch.full((topk,), -1, dtype=torch.int32)
    if n_cand <= 0:
        return row, torch.zeros(0, dtype=torch.float64)
    s = (w.double()[:, None] * (q.double() @ keys[:n_cand].T).clamp_min(0)).sum(0)
    order = sorted(range(n_cand), key=lambda j: (-float(s[j]), j))[:topk]
    row[:len(order)] = torch.tensor(order, dtype=torch.int32)
    return row, s


class IndexerHarness:
    """A backend's harness plus the indexer: its own poisoned cache and a float64 history of
    every indexer key written, per request and entry."""

    def __init__(self, backend, device, seed, fp8, impl="reference", heads=8, **cfg):
        self.h = Harness(backend, config(LayerKind.C4A, heads=heads, **cfg), device, seed=seed)
        self.step = IndexerStep(self.h.backend, impl=impl)
        self.fp8, self.device = fp8, torch.device(device)
        self.cache = self.step.allocate_cache(self.h.sim.num_blocks["compressed"], fp8=fp8,
                                              fill=0xFF)
        self.g = torch.Generator().manual_seed(seed + 1000)
        self.keys = {}                      # rid -> {entry: float64 row}
        self.written = set()

    def inputs(self, st, decodes, prefills):
        T = st.q.shape[0]
        q = (torch.randn(T, IDX_HEADS, DIM, generator=self.g)).to(torch.bfloat16)
        w = torch.randn(T, IDX_HEADS, generator=self.g)        # negative weights too
        k = torch.randn(T, DIM, generator=self.g) * 3
        toks = [rid for rid, n in list(decodes) + list(prefills) for _ in range(n)]
        rows = stored(k, self.fp8)
        pos = st.batch.positions.cpu()
        for t, rid in enumerate(toks):
            p = int(pos[t])
            if (p + 1) % RATIO == 0:
                self.keys.setdefault(rid, {})[p // RATIO] = rows[t]
        return q, w, k, toks

    def oracle_topk(self, q, w, toks, pos, T):
        K = self.h.cfg.topk
        exp = torch.full((T, K), -1, dtype=torch.int32)
        scores = []
        for t, rid in enumerate(toks):
            n = (int(pos[t]) + 1) // RATIO
            keys = torch.stack([self.keys[rid][j] for j in range(n)]) if n else None
            exp[t], s = expected_ids(q[t], w[t], keys, n, K)
            scores.append(s)
        return exp, scores

    def run(self, decodes, prefills, **kw):
        h = self.h
        st = h.sim.step(decodes, prefills, **kw)
        q, w, k, toks = self.inputs(st, decodes, prefills)
        T, dev = st.q.shape[0], self.device
        exp, scores = self.oracle_topk(q, w, toks, st.batch.positions.cpu(), T)
        batch = dataclasses.replace(st.batch, topk_indices=None)
        ix = IndexerInputs(q.to(dev), w.to(dev), k.to(dev), self.cache)
        out = torch.full(st.q.shape, float("nan"), dtype=torch.bfloat16, device=dev)
        self.step.forward(st.q, st.kv, h.caches, batch, ix, h.cos_sin, h.sink, out,
                          st.compressed_kv)
        self.written.update(st.comp_slots)
        got = self.step.topk[:T].cpu()
        self.check_topk(got, exp, scores)
        # the backend's own path, given the oracle's top-k: the very same output
        ref = torch.full_like(out, float("nan"))
        h.backend.forward(st.q, st.kv, h.caches, dataclasses.replace(
            st.batch, topk_indices=exp.to(dev)), h.cos_sin, h.sink, ref, st.compressed_kv)
        h.written["swa"].update(st.swa_slots)
        h.written["compressed"].update(st.comp_slots)
        assert torch.equal(out, ref), "indexer step output differs from the given-top-k path"
        assert torch.count_nonzero(out[st.batch.num_tokens:]) == 0, "graph padding rows"
        h.check_untouched()
        self.check_untouched()
        return st, got, out

    def check_topk(self, got, exp, scores):
        if self.step.impl == "reference":
            assert torch.equal(got, exp), f"rows {(got != exp).any(1).nonzero().flatten()}"
            return
        # Triton: fp32 scores may reorder ids whose float64 scores tie within rounding; the
        # selected sets agree outside that band (tests/ops/indexer's rule).
        for t in range(got.shape[0]):
            g, e = got[t], exp[t]
            assert torch.equal(g < 0, e < 0), f"token {t}: candidate count"
            diff = set(g[g >= 0].tolist()) ^ set(e[e >= 0].tolist())
            if diff:
                s = scores[t]
                kth = s[e[e >= 0].long()].min()
                tol = 1e-5 * float(s.abs().max())
                assert all(abs(float(s[j] - kth)) <= tol for j in diff), f"token {t}: {diff}"

    def check_untouched(self):
        """Every byte of the indexer cache outside the slots written so far is still 0xFF."""
        bs, c = self.step.block_size, self.cache
        raw = storage_bytes(c).cpu()
        mask = torch.zeros(raw.numel(), dtype=torch.bool)
        s0 = c.stride(0) * c.element_size()
        base = c.storage_offset() * c.element_size()
        for s in self.written:
            b, o = divmod(s, bs)
            if self.fp8:
                a = base + b * s0 + o * DIM
                mask[a:a + DIM] = True
                a = base + b * s0 + bs * DIM + o * 4
                mask[a:a + 4] = True
            else:
                a = base + b * s0 + o * DIM * 2
                mask[a:a + DIM * 2] = True
        stray = (raw[~mask] != 0xFF).nonzero()
        assert stray.numel() == 0, f"indexer cache byte {int(stray[0])} written outside slots"
        assert bool((raw[mask] != 0xFF).any()) or not self.written, "nothing was inserted"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ("flashmla", "trtllm_fp8"))
@pytest.mark.parametrize("fp8", (True, False), ids=("fp8_cache", "bf16_cache"))
def test_step_with_indexer_matches_given_topk(device, backend, fp8):
    ih = IndexerHarness(backend, device, seed=11 if fp8 else 12, fp8=fp8)
    for kw in SCRIPT:
        st, got, _ = ih.run(**kw)
        assert (got[st.batch.num_tokens:] == -1).all()
    ran = {op: c.impl for op, c in ih.step.explain().items()}
    # the last step is decode-only: no prefill op ran
    assert {op: ran.get(op) for op in IndexerStep.OPS} == {
        "indexer_k_insert": "reference", "indexer_topk_decode": "reference",
        "indexer_topk_prefill": None}


@pytest.mark.parametrize("device", DEVICES)
def test_more_candidates_than_topk(device):
    """Contexts past topk * ratio tokens: the top-k is a real selection, not every entry."""
    ih = IndexerHarness("flashmla", device, seed=5, fp8=True, topk=16)
    ih.run([], [(0, 160), (1, 90)])
    st, got, _ = ih.run([(0, 2), (1, 1)], [(2, 100)], pad_tokens=1)
    assert (got[:st.batch.num_tokens] >= 0).sum(1).max() == 16


# -- validation: raises before anything is written ------------------------------------------

def _setup():
    ih = IndexerHarness("flashmla", "cpu", seed=2, fp8=True)
    st = ih.h.sim.step([], [(0, 20)])
    q, w, k, _ = ih.inputs(st, [], [(0, 20)])
    batch = dataclasses.replace(st.batch, topk_indices=None)
    out = torch.empty(st.q.shape, dtype=torch.bfloat16)
    return ih, st, batch, IndexerInputs(q, w, k, ih.cache), out


@pytest.mark.parametrize("bad, match", [
    (lambda ix, b: (dataclasses.replace(ix, q=ix.q[:-1]), b), "indexer.q must have shape"),
    (lambda ix, b: (dataclasses.replace(ix, weights=ix.weights[:, :2]), b), "indexer.weights"),
    (lambda ix, b: (dataclasses.replace(ix, k=ix.k[:3]), b), "indexer.slot_mapping"),
    (lambda ix, b: (dataclasses.replace(ix, slot_mapping=ix.k[:, 0].long() * 0 + 10 ** 6), b),
     "indexer.slot_mapping"),
    (lambda ix, b: (ix, dataclasses.replace(b, topk_indices=torch.zeros(1, 1, dtype=torch.int32))),
     "topk_indices must be None"),
    (lambda ix, b: (dataclasses.replace(ix, k_cache=ix.k_cache[:, :8]), b), "indexer.k_cache"),
    (lambda ix, b: (dataclasses.replace(ix, block_table=torch.full_like(
        b.compressed_block_table, -1)), b), r"indexer.block_table\[0, 0\] = -1"),
])
def test_bad_input_raises_before_any_write(bad, match):
    ih, st, batch, ix, out = _setup()
    ix, batch = bad(ix, batch)
    before = [storage_bytes(c).clone() for c in ih.h.caches.values()]
    with pytest.raises((ValueError, TypeError), match=match):
        ih.step.forward(st.q, st.kv, ih.h.caches, batch, ix, ih.h.cos_sin, ih.h.sink, out,
                        st.compressed_kv)
    assert (storage_bytes(ih.cache) == 0xFF).all()
    for b, c in zip(before, ih.h.caches.values()):
        assert torch.equal(b, storage_bytes(c))


def test_needs_a_c4a_backend():
    h = Harness("flashmla", config(LayerKind.C128A), "cpu")
    with pytest.raises(ValueError, match="needs a C4A backend"):
        IndexerStep(h.backend)
