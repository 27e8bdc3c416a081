"""GLM-5.2's indexer cadence through the V3.2 backends: a multi-layer step runs the Lightning
indexer ops on "full" layers only (their selections checked against a float64 top-k), and each
"shared" layer attends over exactly the previous full layer's top-k (no second selection),
against a float64 step oracle that reuses it the same way."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla.backends.v32.cadence import FULL, SHARED, layer_roles, topk_source
from sparse_mla.backends.v32.indexer_step import IndexerInputs, V32IndexerStep
from sparse_mla.ops.indexer import reference as indexer_ref
from sparse_mla.tests.backends.cases import check_rows
from sparse_mla.tests.backends.v32.cases import Harness, config
from sparse_mla.tests.backends.v32.sim import attend
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
TOPK = 24       # of up to 96 tokens a request holds: the full layers' indexer really selects

# GLM-5.2's layer count and offset are transformers' GlmMoeDsaConfig defaults (78, 2): no
# published GLM-5.2 config.json is available here; freq 4 is an assumed cadence (the default,
# 1, makes every layer full).
GLM52 = dict(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=2)

SCRIPT = (
    dict(decodes=[], prefills=[(0, 90), (1, 40)]),
    dict(decodes=[(0, 2), (1, 1)], prefills=[(2, 70)]),
    dict(decodes=[(0, 1), (1, 3), (2, 1)], prefills=[(3, 30)]),
)


def test_roles_follow_the_hf_rule():
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig
    for kw in (GLM52, dict(num_hidden_layers=78), dict(num_hidden_layers=12, index_topk_freq=3,
               index_skip_topk_offset=1), dict(num_hidden_layers=5, index_topk_pattern="FFSFS")):
        hf = GlmMoeDsaConfig(**kw)
        assert layer_roles(kw) == hf.indexer_types, kw
        assert layer_roles(hf) == hf.indexer_types, kw


def test_roles_of_glm52_pattern():
    roles = layer_roles(GLM52)
    assert roles[:10] == [FULL, FULL, SHARED, SHARED, SHARED, FULL, SHARED, SHARED, SHARED, FULL]
    assert topk_source(roles)[:10] == [0, 1, 1, 1, 1, 5, 5, 5, 5, 9]
    assert layer_roles(dict(num_hidden_layers=78)) == [FULL] * 78


@pytest.mark.parametrize("cfg,match", [
    (dict(num_hidden_layers=4, index_topk_freq=0), "index_topk_freq"),
    (dict(num_hidden_layers=4, index_topk_freq=-2), "index_topk_freq"),
    (dict(num_hidden_layers=3, index_topk_pattern="FXS"), "unknown letter 'X'"),
    (dict(num_hidden_layers=3, index_topk_pattern="SFF"), "no earlier 'full'"),
    (dict(num_hidden_layers=3, index_topk_pattern="FF"), "num_hidden_layers is 3"),
    (dict(num_hidden_layers=2, indexer_types=["full", "dense"]), "unknown role 'dense'"),
    (dict(num_hidden_layers=4, index_topk_freq=3, index_skip_topk_offset=0), "no earlier"),
    (dict(), "num_hidden_layers"),
])
def test_bad_configs(cfg, match):
    with pytest.raises(ValueError, match=match):
        layer_roles(cfg)


INDEX_HEADS = 4


class FullLayer:
    """A full layer's own Lightning indexer: the real ops through :class:`V32IndexerStep`
    (NaN-poisoned fp8 key cache), the keys it inserted kept per request for the oracle."""

    def __init__(self, h, topk_buffer, seed):
        self.step = V32IndexerStep(h.backend, topk=topk_buffer)
        self.k_cache = self.step.allocate_cache(h.sim.num_blocks, fill=0xFF)
        self.g = torch.Generator().manual_seed(seed)
        self.keys = {}                          # (request id, position) -> bf16 key row

    def inputs(self, st, order, device):
        T = st.q.shape[0]
        q = torch.randn(T, INDEX_HEADS, 128, generator=self.g).to(torch.bfloat16)
        w = torch.rand(T, INDEX_HEADS, generator=self.g)
        k = torch.randn(T, 128, generator=self.g).to(torch.bfloat16)
        for t, (rid, p) in enumerate(token_positions(st, order)):
            self.keys[rid, p] = k[t]
        return indexer_inputs(q, w, k, self.k_cache, device)

    def expected(self, st, order, ix):
        """float64 top-k of every token over positions 0..p of its request: keys as the
        cache quantizes them (the reference quantizer), larger score first, ties by lower
        position; as sorted position lists."""
        sel = []
        for t, (rid, p) in enumerate(token_positions(st, order)):
            b, scale = indexer_ref.quantize_fp8(torch.stack([self.keys[rid, j]
                                                             for j in range(p + 1)]))
            keys = b.view(torch.float8_e4m3fn).double() * scale.double().unsqueeze(1)
            qt, wt = ix.q[t].cpu().double(), ix.weights[t].cpu().double()
            score = (wt.unsqueeze(1) * (qt @ keys.T).clamp_min(0)).sum(0)
            order_ = torch.sort(score, descending=True, stable=True).indices
            sel.append(sorted(order_[:self.step.config.topk].tolist()))
        return sel


def indexer_inputs(q, w, k, k_cache, device):
    return IndexerInputs(q.to(device), w.to(device), k.to(device), k_cache)


def token_positions(st, order):
    """(request id, position) of every real token of the step, in batch order."""
    qsl = st.batch.query_start_loc_cpu.tolist()
    pos = st.batch.positions.cpu().tolist()
    return [(rid, pos[t]) for r, (rid, _) in enumerate(order) for t in range(qsl[r], qsl[r + 1])]


def run_layers(layout, roles, device, rerun_shared=False):
    """One engine step after another over len(roles) layers: full layers (and every layer
    with ``rerun_shared``, the mutation) select with the real indexer ops into one top-k
    buffer the model shares, as vLLM's ``topk_indices_buffer``; shared layers attend over
    what is in it. Returns the layers that ran an indexer, per step."""
    src = topk_source(roles)
    hs = [Harness(layout, config(topk=TOPK), device, seed=100 + i) for i in range(len(roles))]
    buffer = torch.full((hs[0].cfg.max_num_tokens, TOPK), -1, dtype=torch.int32,
                        device=device)
    selects = [i for i, r in enumerate(roles) if r == FULL or rerun_shared]
    full = {i: FullLayer(hs[i], buffer, seed=200 + i) for i in selects}
    calls = []
    for n, step in enumerate(SCRIPT):
        order = step["decodes"] + step["prefills"]
        sts = [h.sim.step(step["decodes"], step["prefills"]) for h in hs]
        selected = {}
        for i, (h, st) in enumerate(zip(hs, sts)):
            T = st.q.shape[0]
            out = torch.full((T, h.cfg.num_heads, 512), float("nan"), dtype=torch.bfloat16,
                             device=device)
            batch = dataclasses.replace(st.batch, topk_indices=None)
            if i in full:
                ix = full[i].inputs(st, order, device)
                full[i].step.forward(st.q, st.kv, h.caches, batch, ix, out=out)
                h.written.update(st.slots)
                selected[i] = full[i].expected(st, order, ix)
                got = [sorted(j for j in row if j >= 0) for row in buffer[:T].cpu().tolist()]
                assert got == selected[i], f"{layout} step {n} layer {i}: indexer top-k"
                calls.append(i)
            else:
                h.run(st, out=out, batch=dataclasses.replace(batch, topk_indices=buffer[:T]))
            expect = selected[i] if roles[i] == FULL else selected[src[i]]
            check_rows(out, oracle(h, st, step, expect),
                       f"{layout} step {n} layer {i} ({roles[i]})")
            h.check_untouched()
    return calls


def oracle(h, st, step, topk):
    """float64 attention of each token over ``topk`` (per token, request-local positions)
    of this layer's rows as the simulator kept them."""
    order = step["decodes"] + step["prefills"]
    qsl = st.batch.query_start_loc_cpu.tolist()
    exp = torch.zeros(st.q.shape[0], h.cfg.num_heads, 512, dtype=torch.float64)
    for r, (rid, _) in enumerate(order):
        rows = h.sim.requests[rid].rows
        for t in range(qsl[r], qsl[r + 1]):
            exp[t] = attend(st.q[t].cpu().double(), torch.stack([rows[j] for j in topk[t]]),
                            h.cfg.softmax_scale)
    return exp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["flashmla_fp8_separate", "trtllm_bf16"])
def test_shared_layers_reuse_previous_full_topk(device, layout):
    roles = layer_roles(GLM52)[:7]            # F F S S S F S: both kinds, runs of shared
    calls = run_layers(layout, roles, device)
    full = [i for i, r in enumerate(roles) if r == FULL]
    assert calls == full * len(SCRIPT)


def test_rerunning_the_indexer_on_a_shared_layer_is_caught():
    """The mutation: a shared layer selecting again attends over different rows."""
    with pytest.raises(AssertionError, match=r"layer 2 \(shared\)"):
        run_layers("flashmla_bf16", layer_roles(GLM52)[:3], "cpu", rerun_shared=True)
