"""Decode steps with MTP drafts of up to 8 tokens: V4 attention steps and the V4 indexer
step against their oracles (the V4.1 layers: tests/backends/v41/test_mtp8.py): drafts of 8, 5
and 1 in one batch, each padded to the step's uniform next_n inside the indexer step, a draft
reaching back before position ratio, graph padding (the CUDA-graph replays at s_q 8:
test_cuda_graph.py)."""
from __future__ import annotations

import pytest

from sparse_mla.tests.backends import cases
from sparse_mla.tests.backends.cases import KINDS, Harness, config
from sparse_mla.tests.backends.v4.test_indexer_step import IndexerHarness
from sparse_mla.tests.backends.v4.test_step import stable_seed
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

# (1) prefills of 200, 150 and 6 tokens; (2) drafts of 8, 5 and 1 (request 2's first draft
# token at position 6, its window and compressed count short) with graph padding; (3) uniform
# drafts of 8 plus two empty graph-padding requests.
SCRIPT = (
    dict(decodes=[], prefills=[(0, 200), (1, 150), (2, 6)]),
    dict(decodes=[(0, 8), (1, 5), (2, 1)], prefills=[], pad_tokens=3),
    dict(decodes=[(0, 8), (1, 8), (2, 8)], prefills=[], pad_tokens=8, pad_reqs=2),
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ("flashmla", "trtllm_bf16"))
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_mtp_8_steps_match_oracle(device, backend, kind):
    cases.run_script(Harness(backend, config(kind), device,
                             seed=stable_seed("mtp8", backend, kind.name)), SCRIPT)


@pytest.mark.parametrize("device", DEVICES)
def test_indexer_step_mtp_8(device):
    """The V4 indexer step's top-k at drafts of 8 equals the float64 oracle's (the harness
    checks each step) and its output the given-top-k step's; padding rows select nothing."""
    ih = IndexerHarness("flashmla", device, seed=31, fp8=True)
    for kw in SCRIPT:
        st, got, _ = ih.run(**kw)
        assert (got[st.batch.num_tokens:] == -1).all()
        assert (got[:st.batch.num_tokens] >= 0).any()
