"""Requests through their whole life — two prefill chunks, then 30 decode steps while the
batch's membership changes — with caches written only by the backend itself. Every step equals
the oracle, and the FlashMLA-layout and plain-bf16 backends agree with each other."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.tests.backends.cases import KINDS, REL_L2, Harness, config
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def schedule():
    """(decodes, prefills, finished-after-step) per step."""
    yield [], [(0, 128), (1, 100), (2, 60)], ()
    yield [(2, 1)], [(0, 172), (1, 80)], ()
    live = {0: 2, 1: 1, 2: 3}                      # MTP tokens per decode step
    for i in range(30):
        prefills, done = [], ()
        if i == 10:
            done = (2,)
        if i == 12:
            prefills = [(3, 150)]                  # a newcomer: a mixed batch
        yield [(r, n) for r, n in live.items()], prefills, done
        for r in done:
            live.pop(r)
        if i == 12:
            live[3] = 1


def agree(outs, exps, label):
    """Same inputs (same seed, same schedule), but the caches hold different numbers (fp8
    tiles vs bf16 rows: a few % apart per key), so the two backends must differ exactly as
    their oracles differ, up to each one's own error: per (token, head) row,
    ``|(a - b) - (oa - ob)| <= 2 * REL_L2 * max(|oa|, |ob|)``."""
    a, b = (o.reshape(-1, o.shape[-1]) for o in outs)
    oa, ob = (e.reshape(-1, e.shape[-1]) for e in exps)
    err = ((a - b) - (oa - ob)).norm(dim=-1)
    bound = 2 * REL_L2 * torch.maximum(oa.norm(dim=-1), ob.norm(dim=-1))
    bad = (err > bound).nonzero()
    assert bad.numel() == 0, (f"flashmla vs trtllm, {label}: row {int(bad[0])} differs by "
                              f"{float(err[bad[0]]):.4g} beyond its oracles' difference")
    assert (oa - ob).abs().max() > 0, "the two oracles agree exactly: the check is empty"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_lifecycle_flashmla_and_trtllm_agree(device, kind):
    cfg = config(kind)
    pair = [Harness(name, cfg, device, seed=11) for name in ("flashmla", "trtllm_bf16")]
    steps = 0
    for decodes, prefills, done in schedule():
        outs, exps = [], []
        for h in pair:
            out, st = h.step(decodes, prefills)
            h.check(out, st, f"step {steps}")
            outs.append(out.double().cpu())
            exps.append(st.expected)
        agree(outs, exps, f"step {steps}")
        for h in pair:
            for r in done:
                h.sim.finish(r)
        steps += 1
    assert steps == 32
