"""The V4.1 step's Triton route on CPU through Triton's interpreter (tiny shapes), against
the step oracle; the GPU runs the same composition in test_step's cuda parameters."""
from __future__ import annotations

import pytest

from sparse_mla.backends.v41 import V41Kind
from sparse_mla.tests.backends.v41.cases import RECORDS, Harness, config, record_ids
from sparse_mla.tests.helpers import INTERPRETING

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1 only "
                                "(the backends_v41_interpret_test target)")


@pytest.mark.parametrize("kind, records", [(V41Kind.C1A, RECORDS[0]), (V41Kind.C2A, RECORDS[0]),
                                           (V41Kind.C1A, RECORDS[1]), (V41Kind.C2A, RECORDS[2])],
                         ids=lambda v: getattr(v, "name", None) or record_ids(v))
def test_triton_route_matches_oracle(kind, records):
    source = Harness(config(kind, heads=2, max_num_tokens=256, records=records), "cpu", seed=1,
                     impl="triton")
    reader = Harness(config(kind, heads=2, max_num_tokens=256, owns_compressed=False,
                            records=records), "cpu", seed=2, impl="triton", source=source)
    for label, kw in (("prefills", dict(decodes=[], prefills=[(0, 40), (1, 100)])),
                      ("mixed", dict(decodes=[(0, 2), (1, 1)], prefills=[(2, 30)],
                                     pad_tokens=1))):
        for h in (source, reader):
            out, st = h.step(**kw)
            h.check(out, st, label)
            assert {c.impl for c in h.backend.explain().values()} == {"triton"}
