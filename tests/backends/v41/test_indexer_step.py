"""DeepSeek-V4.1 layers with the two-level indexer inside (backends/v41/indexer_step.py): a
small model (a single-level source at ratio 1; the candidate source, two candidate users and a
reuse layer at ratio 2, the users and the reuse layer reading the candidate source's caches)
over mixed decode / prefill steps with MTP (next_n 2, varying drafts), graph-padding tokens and
requests, and a short-context step. Every layer's top-k (and the candidate source's
candidates) equal an independent float64 oracle of docs/semantics.md §11.6 computed from the
history of index keys, and every output equals the float64 attention oracle over that top-k;
the caches stay poisoned outside the written slots; bad input raises before any write."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from sparse_mla.backends.v4.indexer_step import IndexerInputs
from sparse_mla.backends.v41 import V41Kind
from sparse_mla.backends.v41.indexer_config import V41IndexerConfig, indexer_roles
from sparse_mla.backends.v41.indexer_step import V41IndexerState, V41IndexerStep
from sparse_mla.tests.backends import oracle
from sparse_mla.tests.backends.cases import check_rows
from sparse_mla.tests.backends.v4.test_indexer_step import DIM, IDX_HEADS, IndexerHarness, stored
from sparse_mla.tests.backends.v41.cases import Harness, config
from sparse_mla.tests.helpers import CUDA, requires_cuda, storage_bytes

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

TOPK, NB, CB = 16, 5, 4          # 5 blocks of 4 = 20 candidate positions > TOPK
HF = dict(compress_ratios=[1, 2, 2, 2, 2], num_hidden_layers=5, kv_source_layer_ids=[0, 1],
          index_source_layer_ids=[0, 1, 2, 3], candidate_source_layer_id=1,
          candidate_topk_blocks=NB, candidate_block_size=CB, index_topk=TOPK)

# (1) short context for the ratio-2 layers (max_seq_len // 2 <= TOPK), not for the ratio-1
# source; (2) an MTP decode, a prefill chunk with context, a new prefill, graph padding;
# (3) MTP decodes of 1-2 tokens (next_n 2) with graph padding; (4) uniform MTP decodes plus
# two empty graph-padding requests.
SCRIPT = (
    dict(decodes=[], prefills=[(0, 22), (1, 12)]),
    dict(decodes=[(0, 2)], prefills=[(1, 40), (2, 70)], pad_tokens=3),
    dict(decodes=[(0, 1), (1, 2), (2, 2)], prefills=[], pad_tokens=2),
    dict(decodes=[(0, 2), (1, 2)], prefills=[], pad_tokens=2, pad_reqs=2),
)


# -- the float64 indexer oracle (§11.6) ----------------------------------------------------

def logits(q, w, keys):
    """sum_h w_h relu(q_h . k_s), float64, over the rows of ``keys``."""
    return (w.double()[:, None] * (q.double() @ keys.T).clamp_min(0)).sum(0)


def ranked(scores, ids, k):
    """The first ``k`` of ``ids`` by larger score, then lower id; -1 padded to ``k``."""
    order = sorted(ids, key=lambda j: (-float(scores[j]), j))[:k]
    return order + [-1] * (k - len(order))


def candidate_blocks(s, n):
    """Level 1: each block's max logit, the newest block pinned to +inf, the best NB."""
    nblk = (n + CB - 1) // CB
    score = torch.stack([s[c * CB:min((c + 1) * CB, n)].max() for c in range(nblk)]) \
        if nblk else s.new_zeros(0)
    if nblk:
        score[nblk - 1] = float("inf")
    return ranked(score, range(nblk), NB)


class Model:
    """Five V4.1 layers (``HF``), their harnesses, the shared state, the index K caches of the
    two kv-source layers and the float64 history of each one's keys."""

    def __init__(self, device, seed=0, impl="reference"):
        self.roles = indexer_roles(HF)
        self.device = torch.device(device)
        self.state = V41IndexerState(640, TOPK, NB, device=device)
        self.h, self.steps = {}, {}
        for layer, idx in self.roles.items():
            kind = V41Kind.from_ratio(HF["compress_ratios"][layer])
            src = idx.k_source_layer_id if idx.index_role != "reuse" else 1
            owns = src == layer
            self.h[layer] = Harness(config(kind, topk=TOPK, owns_compressed=owns), device,
                                    seed=seed + layer,
                                    source=None if owns else self.h[src])
            self.steps[layer] = V41IndexerStep(self.h[layer].backend, idx, self.state, impl)
        self.owners = [ly for ly, i in self.roles.items() if i.index_role != "reuse"
                       and i.owns_index_k]
        self.cache = {ly: self.steps[ly].allocate_cache(self.h[ly].sim.num_blocks["compressed"],
                                                        fill=0xFF) for ly in self.owners}
        self.keys = {ly: {} for ly in self.owners}          # layer -> rid -> {entry: row}
        self.written = {ly: set() for ly in self.owners}
        self.g = torch.Generator().manual_seed(seed + 100)

    def ratio(self, layer):
        return HF["compress_ratios"][layer]

    def run(self, decodes, prefills, **kw):
        """One forward over every layer; returns {layer: (top-k, output)} as computed."""
        toks = [rid for rid, n in list(decodes) + list(prefills) for _ in range(n)]
        got, ref_topk = {}, {}
        for layer, idx in self.roles.items():
            h, step = self.h[layer], self.steps[layer]
            st, ix = self.draw(layer, toks, decodes, prefills, **kw)
            T, pos = st.q.shape[0], st.batch.positions.cpu()
            if ix is not None:
                q, w = ix.q.cpu(), ix.weights.cpu()
                ref_topk[layer] = self.oracle_topk(layer, q, w, toks, pos, st.batch, T)
            else:
                ref_topk[layer] = ref_topk[idx.topk_source_layer_id]
            batch = dataclasses.replace(st.batch, topk_indices=None)
            out = torch.full(st.q.shape, float("nan"), dtype=torch.bfloat16, device=self.device)
            step.forward(st.q, st.kv, h.caches, batch, ix, h.cos_sin, h.sink, out,
                         st.compressed_kv)
            h.written["swa"].update(st.swa_slots)
            h.written["compressed"].update(st.comp_slots)
            exp_ids, exp_cands = ref_topk[layer]
            got_ids = self.state.topk[:T].cpu()
            assert torch.equal(got_ids, exp_ids), (
                f"layer {layer} ({idx.index_role}): top-k rows "
                f"{(got_ids != exp_ids).any(1).nonzero().flatten().tolist()}")
            if exp_cands is not None:
                assert torch.equal(self.state.candidates[:T].cpu(), exp_cands), (
                    f"layer {layer}: candidates")
            check_rows(out, self.attention(h, st, toks, exp_ids), f"layer {layer}")
            h.check_untouched()
            got[layer] = (got_ids, out)
        for ly in self.owners:
            self.check_index_cache(ly)
        return got

    def draw(self, layer, toks, decodes, prefills, **kw):
        """A layer's simulated step and indexer inputs (None for a reuse layer); a layer
        reading the candidate source's compressed cache gets no compressor rows."""
        h = self.h[layer]
        st = h.sim.step(decodes, prefills, **kw)
        if h.source is not None:
            st.compressed_kv, st.comp_slots = None, []
            st.batch.compressed_slot_mapping = None
        ix = self.inputs(layer, st, toks) if self.roles[layer].index_role != "reuse" else None
        return st, ix

    def inputs(self, layer, st, toks):
        T = st.q.shape[0]
        q = torch.randn(T, IDX_HEADS, DIM, generator=self.g).to(torch.bfloat16)
        w = torch.randn(T, IDX_HEADS, generator=self.g)          # negative weights too
        k = None
        if self.roles[layer].owns_index_k:
            k = torch.randn(T, DIM, generator=self.g) * 3
            rows, pos, ratio = stored(k, True), st.batch.positions.cpu(), self.ratio(layer)
            for t, rid in enumerate(toks):
                p = int(pos[t])
                if (p + 1) % ratio == 0:
                    self.keys[layer].setdefault(rid, {})[p // ratio] = rows[t]
            self.written[layer].update(st.comp_slots)
            k = k.to(self.device)
        dev = self.device
        return IndexerInputs(q.to(dev), w.to(dev), k,
                             self.cache[self.roles[layer].k_source_layer_id])

    def oracle_topk(self, layer, q, w, toks, pos, batch, T):
        """(top-k [T, TOPK], candidates [T, NB] or None) as §11.6 has them."""
        idx, ratio = self.roles[layer], self.ratio(layer)
        ids = torch.full((T, TOPK), -1, dtype=torch.int32)
        cands = torch.full((T, NB), -1, dtype=torch.int32) \
            if idx.index_role == "candidate_source" else None
        short = int(batch.seq_lens_cpu.max()) // ratio <= TOPK
        history = self.keys[idx.k_source_layer_id]
        for t, rid in enumerate(toks):
            n = (int(pos[t]) + 1) // ratio
            if short:
                ids[t, :n] = torch.arange(n)
                continue
            s = logits(q[t], w[t], torch.stack([history[rid][j] for j in range(n)])) if n \
                else torch.zeros(0, dtype=torch.float64)
            allowed = range(n)
            if idx.index_role == "candidate_user":
                blocks = set(self.cands[t].tolist()) - {-1}
                allowed = [j for j in range(n) if j // CB in blocks]
            ids[t] = torch.tensor(ranked(s, allowed, TOPK))
            if cands is not None:
                cands[t] = torch.tensor(candidate_blocks(s, n))
        if cands is not None and not short:
            self.cands = cands
        return ids, cands if not short else None

    def attention(self, h, st, toks, topk):
        """float64 attention of each token over its window and ``topk``'s entries, from the
        history the layer's simulator keeps (tests/backends/oracle.py)."""
        sim, exp = h.sim, torch.zeros(st.q.shape, dtype=torch.float64)
        pos = st.batch.positions.cpu()
        for t, rid in enumerate(toks):
            p, r = int(pos[t]), sim.requests[rid]
            qq = sim.storage.query(oracle.rope(st.q[t].float().cpu(), sim.cos_sin[p]))
            keys = [r.rows[i] for i in range(max(p - h.cfg.window + 1, 0), p + 1)]
            keys += [r.entries[int(c)] for c in topk[t] if c >= 0]
            exp[t] = oracle.attend(qq, torch.stack(keys), sim.sink, h.cfg.softmax_scale)
        return exp

    def check_index_cache(self, layer):
        """Every byte of an index K cache outside the slots written so far is still 0xFF."""
        view = types.SimpleNamespace(step=self.steps[layer], cache=self.cache[layer],
                                     written=self.written[layer], fp8=True)
        IndexerHarness.check_untouched(view)


@pytest.mark.parametrize("device", DEVICES)
def test_model_steps_match_oracle(device):
    m = Model(device, seed=3)
    assert [i.index_role for i in m.roles.values()] == [
        "source", "candidate_source", "candidate_user", "candidate_user", "reuse"]
    for i, kw in enumerate(SCRIPT):
        got = m.run(**kw)
        T = len(got[0][0])
        nt = T - kw.get("pad_tokens", 0)
        for layer, (ids, _) in got.items():
            assert (ids[nt:] == -1).all(), f"step {i} layer {layer}: padding rows"
        if i == 0:
            # short context (ratio 2): the candidate source scored nothing, wrote nothing
            assert (m.state.candidates == -1).all()
        if i == 1:
            # a real level 2: some rows have more causal positions than the candidates hold
            assert (m.state.candidates[:nt] >= 0).all(1).any()
            assert int(m.h[2].sim.requests[2].computed) // 2 > NB * CB
    ran = {op: c.impl for op, c in m.steps[2].explain().items()
           if op.startswith("indexer_v41")}
    assert ran == {"indexer_v41_topk_in_candidates_decode": "reference"}
    # one persistent buffer for every layer (a captured graph reads the same memory)
    assert all(s.topk is m.state.topk for s in m.steps.values())


# -- validation: raises before anything is written ------------------------------------------

def _prepared(layer, skip=()):
    """A model after one forward, then this forward's layers below ``layer`` (but those in
    ``skip``) run eagerly; returns (model, step, st, batch, ix, out) for ``layer``."""
    m = Model("cpu", seed=5)
    m.run(**SCRIPT[0])
    kw = dict(decodes=[(0, 2)], prefills=[(1, 40)])
    toks = [rid for rid, n in kw["decodes"] + kw["prefills"] for _ in range(n)]
    for ly in range(layer + 1):
        h, step = m.h[ly], m.steps[ly]
        st, ix = m.draw(ly, toks, **kw)
        batch = dataclasses.replace(st.batch, topk_indices=None)
        out = torch.empty(st.q.shape, dtype=torch.bfloat16)
        if ly == layer:
            return m, step, st, batch, ix, out
        if ly not in skip:
            step.forward(st.q, st.kv, h.caches, batch, ix, h.cos_sin, h.sink, out,
                         st.compressed_kv)


@pytest.mark.parametrize("layer, skip, bad, match", [
    (2, (1,), None, "reads the candidates of layer 1"),
    (4, (3,), None, r"reads the topk of layer 3 .* holds layer 2"),
    (4, (), lambda m, ix, b: (IndexerInputs(None, None, None, None), b), "indexer must be None"),
    (2, (), lambda m, ix, b: (dataclasses.replace(ix, k=torch.zeros(4, DIM)), b),
     "indexer.k must be None: layer 2 scores layer 1's index K"),
    (1, (), lambda m, ix, b: (dataclasses.replace(ix, k=None), b), "indexer.k must be given"),
    (0, (), lambda m, ix, b: (None, b), "indexer is required"),
    (2, (), lambda m, ix, b: (dataclasses.replace(ix, weights=ix.weights[:, :2]), b),
     "indexer.weights"),
    (3, (), lambda m, ix, b: (ix, dataclasses.replace(
        b, topk_indices=torch.zeros(1, TOPK, dtype=torch.int32))), "topk_indices must be None"),
])
def test_bad_input_raises_before_any_write(layer, skip, bad, match):
    m, step, st, batch, ix, out = _prepared(layer, skip)
    if bad is not None:
        ix, batch = bad(m, ix, batch)
    h = m.h[layer]
    before = [storage_bytes(c).clone() for c in list(h.caches.values()) + list(
        m.cache.values()) + [m.state.topk, m.state.candidates]]
    with pytest.raises((ValueError, TypeError), match=match):
        step.forward(st.q, st.kv, h.caches, batch, ix, h.cos_sin, h.sink, out,
                     st.compressed_kv)
    after = [storage_bytes(c) for c in list(h.caches.values()) + list(m.cache.values()) + [
        m.state.topk, m.state.candidates]]
    assert all(torch.equal(b, a) for b, a in zip(before, after))


def test_step_checks_its_config_against_the_backend_and_state():
    h = Harness(config(V41Kind.C2A, topk=TOPK), "cpu")
    idx = indexer_roles(HF)[1]
    with pytest.raises(ValueError, match="candidate_topk_blocks = 5 columns"):
        V41IndexerStep(h.backend, idx, V41IndexerState(640, TOPK, NB + 1))
    with pytest.raises(ValueError, match=r"backend's topk \(16\) must be index.index_topk"):
        V41IndexerStep(h.backend, dataclasses.replace(idx, index_topk=TOPK * 2),
                       V41IndexerState(640, TOPK * 2, NB))
    with pytest.raises(ValueError, match="owns_compressed"):
        V41IndexerStep(h.backend, indexer_roles(HF)[2], V41IndexerState(640, TOPK, NB))
    with pytest.raises(ValueError, match="topk must hold max_num_tokens"):
        V41IndexerStep(h.backend, idx, V41IndexerState(64, TOPK, NB))


# -- config ---------------------------------------------------------------------------------

def test_roles_of_a_v41_flash_topology():
    """V4.1-Flash's shape (SPEC_V41.md): index K on 2, 8, 14, 20; 20 the candidate source;
    24-36 candidate users over 20's K; every other compressed layer reuses the latest top-k;
    SWA-only layers (and MTP layers past compress_ratios) have no entry."""
    ratios = [0, 0] + [2] * 40 + [0]
    hf = dict(compress_ratios=ratios, num_hidden_layers=42, kv_source_layer_ids=[2, 8, 14, 20],
              index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], candidate_source_layer_id=20,
              candidate_topk_blocks=2048, candidate_block_size=8, index_topk=512)
    roles = indexer_roles(hf)
    assert sorted(roles) == list(range(2, 42))
    for layer, idx in roles.items():
        kv = max(s for s in hf["kv_source_layer_ids"] if s <= layer)
        ix = max(s for s in hf["index_source_layer_ids"] if s <= layer)
        if layer != ix:
            assert (idx.index_role, idx.topk_source_layer_id) == ("reuse", ix), layer
        elif layer < 20:
            assert (idx.index_role, idx.k_source_layer_id) == ("source", layer)
        else:
            assert idx.index_role == ("candidate_source" if layer == 20 else "candidate_user")
            assert (idx.k_source_layer_id, idx.owns_index_k) == (kv, layer == 20)
            assert (idx.candidate_topk_blocks, idx.candidate_block_size) == (2048, 8)
    # without candidate blocks vLLM allocates no candidate buffer: every indexer is single-level
    flat = indexer_roles(dict(hf, candidate_topk_blocks=0))
    assert {i.index_role for i in flat.values()} == {"source", "reuse"}
    # an object with the keys as attributes (a transformers PretrainedConfig) reads the same
    assert indexer_roles(types.SimpleNamespace(**hf)) == roles


@pytest.mark.parametrize("change, match", [
    (dict(compress_ratios=[1, 4, 2, 2, 2]), "compress_ratios must hold 0, 1 or 2"),
    (dict(index_topk=None), "no index_topk"),
    (dict(kv_source_layer_ids=[1]), "layer 0 has no kv source"),
    (dict(compress_ratios=[1, 2, 1, 2, 2]), "layer 2 .* scores the index K of layer 1"),
    (dict(compress_ratios=[1, 2, 2, 2, 1]), "layer 4 .* reads the top-k of layer 3"),
    (dict(candidate_source_layer_id=4), "must be in index_source_layer_ids"),
    (dict(candidate_block_size=0), "candidate_block_size >= 1"),
])
def test_bad_config_raises(change, match):
    with pytest.raises(ValueError, match=match):
        indexer_roles(dict(HF, **change))


@pytest.mark.parametrize("kw, match", [
    (dict(index_role="level3"), "index_role must be one of"),
    (dict(index_role="reuse", k_source_layer_id=3, topk_source_layer_id=3),
     "k_source_layer_id must be None"),
    (dict(index_role="reuse"), "topk_source_layer_id must be set"),
    (dict(index_role="source", k_source_layer_id=5, topk_source_layer_id=3),
     "topk_source_layer_id must be None"),
    (dict(index_role="source", k_source_layer_id=7), "a layer at or below 5"),
    (dict(index_role="reuse", topk_source_layer_id=5), "a layer below 5"),
    (dict(index_role="candidate_user", k_source_layer_id=1, candidate_topk_blocks=4,
          candidate_block_size=8, candidate_source_layer_id=5), "a layer below 5"),
    (dict(index_role="candidate_source", k_source_layer_id=5, candidate_topk_blocks=0,
          candidate_block_size=8, candidate_source_layer_id=5), "candidate_topk_blocks"),
    (dict(index_role="source", k_source_layer_id=5, candidate_source_layer_id=1),
     "for the candidate roles"),
])
def test_bad_indexer_config_raises(kw, match):
    kw = dict(dict(k_source_layer_id=None), **kw)
    with pytest.raises(ValueError, match=match):
        V41IndexerConfig(layer_id=5, **kw)


# -- CUDA graphs ----------------------------------------------------------------------------

GRAPH_FIELDS = ("query_start_loc", "seq_lens", "positions", "swa_block_table",
                "swa_slot_mapping", "compressed_block_table", "compressed_slot_mapping")


def _draw(m, dec, toks):
    """Every layer's inputs of the next decode step, in ``Model.run``'s order of draws."""
    return {layer: m.draw(layer, toks, dec, []) for layer in m.roles}


@requires_cuda
@pytest.mark.parametrize("next_n", (2, 8))
def test_decode_forward_graph_replays(next_n):
    """Every layer's decode step (MTP next_n 2 and 8) captured in one CUDA graph and replayed with
    the inputs updated in place: each replay gives every layer's output, the last top-k and
    the candidates of the same forward run eagerly on the same inputs (a twin model, same
    seeds), which is held to the oracle. Under capture there is no short-context rule; the
    contexts are long enough that the eager forward scores too."""
    reqs = [(0, 90), (1, 60), (2, 120)]
    dec = [(r, next_n) for r, _ in reqs]
    toks = [rid for rid, n in dec for _ in range(n)]
    graphed, eager = Model("cuda", seed=8, impl="auto"), Model("cuda", seed=8, impl="auto")
    for m in (graphed, eager):
        m.run([], reqs)
        m.run(dec, [])                       # warm-up: compiles every kernel
    static = _draw(graphed, dec, toks)
    outs = {ly: torch.zeros(st.q.shape, dtype=torch.bfloat16, device="cuda")
            for ly, (st, _) in static.items()}
    batches = {ly: dataclasses.replace(st.batch, topk_indices=None)
               for ly, (st, _) in static.items()}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer, (st, ix) in static.items():
            h = graphed.h[layer]
            graphed.steps[layer].forward(st.q, st.kv, h.caches, batches[layer], ix, h.cos_sin,
                                         h.sink, outs[layer], st.compressed_kv)
    for i in range(3):
        if i:
            for layer, (st, ix) in _draw(graphed, dec, toks).items():
                old, old_ix = static[layer]
                pairs = [(old.q, st.q), (old.kv, st.kv), (old.compressed_kv, st.compressed_kv)]
                if ix is not None:
                    pairs += [(old_ix.q, ix.q), (old_ix.weights, ix.weights), (old_ix.k, ix.k)]
                pairs += [(getattr(batches[layer], f), getattr(st.batch, f))
                          for f in GRAPH_FIELDS]
                for dst, src in pairs:
                    if dst is not None:
                        dst.copy_(src)
        graph.replay()
        ref = eager.run(dec, [])
        torch.cuda.synchronize()
        for layer, (_, ref_out) in ref.items():
            assert torch.equal(outs[layer], ref_out), f"replay {i}: layer {layer} output"
        assert torch.equal(graphed.state.topk, eager.state.topk), f"replay {i}: top-k"
        assert torch.equal(graphed.state.candidates, eager.state.candidates), (
            f"replay {i}: candidates")
