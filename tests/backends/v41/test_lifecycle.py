"""DeepSeek-V4.1 requests through their whole life (two prefill chunks, then 30 decode
steps while the batch's membership changes, MTP decodes included), with a source layer and
a layer reading its compressed cache: every step of both equals the oracle, and the shared
cache holds only what the source wrote."""
from __future__ import annotations

import pytest

from sparse_mla.backends.v41 import V41Kind
from sparse_mla.tests.backends.v4.test_lifecycle import schedule
from sparse_mla.tests.backends.v41.cases import RECORDS, Harness, config, record_ids
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def _live(*layers):
    """The schedule through ``layers`` in order (a source before its readers); returns the
    number of steps, each checked against the oracle."""
    steps = 0
    for decodes, prefills, done in schedule():
        for h in layers:
            out, st = h.step(decodes, prefills)
            h.check(out, st, f"step {steps}")
            for r in done:
                h.sim.finish(r)
        steps += 1
    return steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("kind", (V41Kind.C1A, V41Kind.C2A), ids=lambda k: k.name)
def test_lifecycle_source_and_reader(device, kind, records):
    source = Harness(config(kind, records=records), device, seed=11)
    reader = Harness(config(kind, owns_compressed=False, records=records), device, seed=12,
                     source=source)
    assert _live(source, reader) == 32
    assert not reader.written["compressed"] and source.written["compressed"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("swa_record", (584, 528))
def test_lifecycle_swa_only(device, swa_record):
    assert _live(Harness(config(V41Kind.SWA_ONLY, swa_record=swa_record), device,
                         seed=11)) == 32
