"""Requests through their whole life — two prefill chunks, then 30 decode steps while the
batch's membership changes — with caches written only by the backend itself. Every step equals
the oracle, and the FlashMLA-layout and plain-bf16 backends agree with each other."""
from __future__ import annotations

import pytest

from sparse_mla.tests.backends.cases import KINDS, Harness, check_rows, config
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_lifecycle_flashmla_and_trtllm_agree(device, kind):
    cfg = config(kind)
    pair = [Harness(name, cfg, device, seed=11) for name in ("flashmla", "trtllm_bf16")]
    steps = 0
    for decodes, prefills, done in schedule():
        outs = []
        for h in pair:
            out, st = h.step(decodes, prefills)
            h.check(out, st, f"step {steps}")
            outs.append(out)
        # Same inputs (same seed, same schedule); the caches differ (fp8 tiles vs bf16 rows),
        # so the two agree as two answers near the oracle do, not bit for bit: each within
        # REL_L2 of the oracle, each other within twice that plus the fp8 tiles' own error.
        check_rows(outs[0], outs[1].double().cpu(), f"flashmla vs trtllm, step {steps}")
        for h in pair:
            for r in done:
                h.sim.finish(r)
        steps += 1
    assert steps == 32
