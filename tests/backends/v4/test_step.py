"""One attention step of a whole batch, backend against the dense step oracle
(docs/semantics.md §4-§7): mixed decode / prefill batches, MTP decodes, chunked prefills with
context, prefills from position 0, positions < 127 and (p+1) < ratio, graph padding, block
sizes, head counts — on poisoned caches that must stay untouched outside each step's slots."""
from __future__ import annotations

import zlib

import pytest
import torch

from sparse_mla.backends.v4 import LayerKind
from sparse_mla.tests.backends import cases
from sparse_mla.tests.backends.cases import BACKENDS, KINDS, Harness, config
from sparse_mla.tests.backends.sim import Simulator
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

# Three steps: (1) two prefills from position 0; (2) an MTP decode, a second prefill chunk
# with context and a new prefill, plus graph padding after the prefills; (3) MTP decodes of
# 1-3 tokens with graph padding after them.
SCRIPT = (
    dict(decodes=[], prefills=[(0, 200), (1, 150)]),
    dict(decodes=[(0, 2)], prefills=[(1, 60), (2, 140)], pad_tokens=3),
    dict(decodes=[(0, 1), (1, 3), (2, 1)], prefills=[], pad_tokens=2),
)


def run_script(h: Harness, script=SCRIPT):
    return cases.run_script(h, script)


def stable_seed(*parts) -> int:
    """A seed from the test's parameters that is the same in every process (``hash()`` of a
    string is salted per process, so a failure seeded from it could not be replayed)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) % 1000


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_mixed_steps_match_oracle(device, backend, kind):
    run_script(Harness(backend, config(kind), device, seed=stable_seed(backend, kind.name)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ("flashmla", "trtllm_bf16"))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_swa_block_256(device, backend, kind):
    # vLLM's 256-token pages; C128A keeps its 2-entry compressed blocks (256 // 128).
    run_script(Harness(backend, config(kind, swa_block_size=256), device, seed=7))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ("flashmla", "trtllm_bf16"))
@pytest.mark.parametrize("heads", (1, 16, 64, 128))
def test_head_counts(device, backend, heads):
    # Shorter script for the wide head counts (the CPU reference's cost grows with heads).
    script = (dict(decodes=[], prefills=[(0, 140)]),
              dict(decodes=[(0, 2)], prefills=[(1, 40)], pad_tokens=1))
    run_script(Harness(backend, config(LayerKind.C128A, heads=heads), device, seed=heads),
               script)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_chunks_split_by_workspace(device):
    """A workspace that holds one request at a time (the largest needs 120 + 30 rows, two
    need 2 * 150): three prefills run as three chunks, same answer as the oracle."""
    cfg = config(LayerKind.C4A, prefill_workspace_rows=200)
    h = Harness("flashmla", cfg, device, seed=3)
    st = h.sim.step([], [(0, 120), (1, 100), (2, 90)])
    chunks = h.backend.planner.prefill_chunks(st.batch)
    assert [(c.r0, c.r1) for c in chunks] == [(0, 1), (1, 2), (2, 3)]
    h.check(h.run(st), st)
    wide = Harness("flashmla", config(LayerKind.C4A), device, seed=3)
    st = wide.sim.step([], [(0, 120), (1, 100), (2, 90)])
    assert len(wide.backend.planner.prefill_chunks(st.batch)) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_padded_decode_requests(device):
    """A decode batch padded with empty requests and padding tokens (a CUDA-graph batch):
    real rows match, padding rows are zero."""
    h = Harness("flashmla", config(LayerKind.C4A), device, seed=5)
    h.step([], [(0, 90), (1, 30)])
    out, st = h.step([(0, 2), (1, 2)], [], pad_tokens=4, pad_reqs=2)
    h.check(out, st, "padded decode")
    assert torch.count_nonzero(out[4:]) == 0


def test_explain_names_the_ops_of_the_last_step():
    """explain() names the ops of the last step only: a prefill step's, then a decode
    step's (its q and kv through the fused insert)."""
    h = Harness("flashmla", config(LayerKind.C4A), "cpu")
    h.step([], [(0, 20)])
    ran = {op: c.impl for op, c in h.backend.explain().items()}
    assert ran["flashmla_sparse_prefill"] == "reference"
    assert "flashmla_sparse_decode" not in ran and "global_topk_indices_and_lens" not in ran
    h.step([(0, 1)], [])
    ran = {op: c.impl for op, c in h.backend.explain().items()}
    assert set(ran) == {"fused_qnorm_rope_insert_v4", "quantize_insert_v4", "swa_indices_and_lens",
                        "global_topk_indices_and_lens", "flashmla_sparse_decode"}
    assert set(ran.values()) == {"reference"}


@pytest.mark.parametrize("kind", (LayerKind.SWA_ONLY, LayerKind.C4A), ids=lambda k: k.name)
def test_check_catches_an_off_by_one_window(kind):
    """The row bound is tight enough: the oracle of a 127-token window (one key short for
    every token past position 126) is rejected, the 128-token one accepted."""
    import dataclasses
    h = Harness("flashmla", config(kind), "cpu", seed=9)
    short = Simulator(dataclasses.replace(h.cfg, window=127), "cpu", h.sim.storage, seed=9)
    for kw in SCRIPT[:2]:
        st = h.sim.step(**kw)
        out = h.run(st)
        h.check(out, st)
        alt = short.step(**kw)
        assert torch.equal(alt.q.cpu(), st.q.cpu())           # same inputs, other window
        with pytest.raises(AssertionError, match="relative L2 error"):
            h.check(out, alt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_layers_share_one_step_plan(device, kind):
    """Two layers of one kind (a FlashMLA-layout one and a plain one) share a planner: the
    step is planned once, each layer runs with ``planned=True``, both match the oracle."""
    cfg = config(kind)
    first = Harness("flashmla", cfg, device, seed=4)
    second = Harness("trtllm_bf16", cfg, device, seed=4, planner=first.backend.planner)
    for kw in SCRIPT:
        a, b = first.sim.step(**kw), second.sim.step(**kw)
        first.backend.plan(a.batch, a.q.shape[0])
        first.check(first.run(a, planned=True), a, "first layer")
        second.check(second.run(b, batch=a.batch, planned=True), b, "second layer")
    with pytest.raises(ValueError, match="cannot be shared"):
        Harness("flashmla", config(kind, swa_block_size=256), device,
                planner=first.backend.planner)


@pytest.mark.parametrize("device", DEVICES)
def test_layers_run_one_decode_plan_per_step(device, monkeypatch):
    """Layers sharing a planner run the decode op by one plan a step (``decode_with_plans``):
    the step's first layer plans it, the second reuses it, every step plans anew, and each
    layer's explain() still names the decode op it ran."""
    from sparse_mla.ops.flashmla_decode import planned
    made = []
    real = planned.plan_decode
    monkeypatch.setattr(planned, "plan_decode", lambda *a, **k: made.append(a[0].shape)
                        or real(*a, **k))
    cfg = config(LayerKind.C4A)
    first = Harness("flashmla", cfg, device, seed=5)
    second = Harness("flashmla", cfg, device, seed=5, planner=first.backend.planner)
    decode_steps = 0
    for kw in SCRIPT:
        a, b = first.sim.step(**kw), second.sim.step(**kw)
        first.backend.plan(a.batch, a.q.shape[0])
        first.check(first.run(a, planned=True), a, "first layer")
        second.check(second.run(b, batch=a.batch, planned=True), b, "second layer")
        if a.batch.num_decode_tokens:
            decode_steps += 1
            assert len(made) == decode_steps, "the second layer planned the decode again"
            assert made[-1][0] == a.batch.num_decode_tokens
            for h in (first, second):
                assert "flashmla_sparse_decode" in h.backend.explain()
    assert decode_steps >= 2
