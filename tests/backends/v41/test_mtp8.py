"""The V4.1 layers (candidate source, candidate users, reuse) at MTP drafts of up to 8 tokens
against the float64 oracle (``Model.run`` checks every layer's top-k, candidates and
attention): drafts of 8, 5 and 1 in one batch, one reaching back before position ratio,
graph padding, then uniform drafts of 8 with empty padding requests."""
from __future__ import annotations

import pytest

from sparse_mla.tests.backends.v41.test_indexer_step import Model
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

SCRIPT = (
    dict(decodes=[], prefills=[(0, 200), (1, 150), (2, 6)]),
    dict(decodes=[(0, 8), (1, 5), (2, 1)], prefills=[], pad_tokens=3),
    dict(decodes=[(0, 8), (1, 8), (2, 8)], prefills=[], pad_tokens=8, pad_reqs=2),
)


@pytest.mark.parametrize("device", DEVICES)
def test_v41_model_steps_mtp_8(device):
    m = Model(device, seed=7)
    for kw in SCRIPT:
        got = m.run(**kw)
        nt = len(got[0][0]) - kw.get("pad_tokens", 0)
        for layer, (ids, _) in got.items():
            assert (ids[nt:] == -1).all(), f"layer {layer}: padding rows"
