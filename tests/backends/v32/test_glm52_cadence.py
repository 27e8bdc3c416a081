"""GLM-5.2's indexer cadence through the V3.2 backends: a multi-layer step runs the indexer on
"full" layers only, and each "shared" layer attends over exactly the previous full layer's
top-k (no second selection), against a float64 step oracle that reuses it the same way."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla.backends.v32.cadence import FULL, SHARED, layer_roles, topk_source
from sparse_mla.tests.backends.cases import check_rows
from sparse_mla.tests.backends.v32.cases import Harness, config
from sparse_mla.tests.backends.v32.sim import attend
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

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


def run_layers(layout, roles, device, rerun_shared=False):
    """One engine step after another over len(roles) layers; returns the indexer calls."""
    src = topk_source(roles)
    hs = [Harness(layout, config(), device, seed=100 + i) for i in range(len(roles))]
    calls = []

    def indexer(i, st):
        # the layer's own selection (the simulator models the indexer's output); counted
        calls.append(i)
        return st.batch.topk_indices

    for n, step in enumerate(SCRIPT):
        sts = [h.sim.step(step["decodes"], step["prefills"]) for h in hs]
        selected = {}
        for i, (h, st) in enumerate(zip(hs, sts)):
            if roles[i] == FULL or rerun_shared:
                selected[i] = indexer(i, st)
            topk = selected[i] if roles[i] == FULL or rerun_shared else selected[src[i]]
            out = h.run(st, batch=dataclasses.replace(st.batch, topk_indices=topk))
            check_rows(out, oracle(h, st, step, sts[src[i]].batch.topk_indices),
                       f"{layout} step {n} layer {i} ({roles[i]})")
            h.check_untouched()
    return calls


def oracle(h, st, step, topk):
    """float64 attention of each token over ``topk`` (request-local positions) of this
    layer's rows as the simulator kept them."""
    order = step["decodes"] + step["prefills"]
    qsl = st.batch.query_start_loc_cpu.tolist()
    topk = topk.cpu()
    exp = torch.zeros(st.q.shape[0], h.cfg.num_heads, 512, dtype=torch.float64)
    for r, (rid, _) in enumerate(order):
        rows = h.sim.requests[rid].rows
        for t in range(qsl[r], qsl[r + 1]):
            sel = [int(j) for j in topk[t] if j >= 0]
            exp[t] = attend(st.q[t].cpu().double(), torch.stack([rows[j] for j in sel]),
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
