"""DeepSeek-V4.1's configs and steps refuse what V4.1 does not have, by name, before any
cache byte is written: ratios other than 0 / 1 / 2, a per-head q RMSNorm, records a cache
cannot hold (288 B SWA), caches laid out for another record, compressor rows that are not
one per token, a reader layer handed rows for the cache it only reads, a compressed layer
without the indexer's top-k or with ids past its entries."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla.backends.v4 import LayerKind
from sparse_mla.backends.v4 import FlashMLABackend
from sparse_mla.backends.v41 import V41FlashMLABackend, V41Kind, V41LayerConfig
from sparse_mla.tests.backends import cases as v4_cases
from sparse_mla.tests.backends.v41.cases import RECORDS, Harness, config, record_ids
from sparse_mla.tests.helpers import storage_bytes


def test_kind_from_ratio():
    assert [V41Kind.from_ratio(r) for r in (0, 1, 2)] == [V41Kind.SWA_ONLY, V41Kind.C1A,
                                                           V41Kind.C2A]
    with pytest.raises(ValueError, match="compress_ratio must be 0 .* got 4"):
        V41Kind.from_ratio(4)


@pytest.mark.parametrize("changes, match", [
    (dict(kind=LayerKind.C4A), "kind must be a V41Kind"),
    (dict(apply_q_norm=True), "no per-head q RMSNorm"),
    (dict(swa_record=288), r"swa_record must be one of \(584, 528\)"),
    (dict(compressed_record=656), r"compressed_record must be one of \(584, 528, 288\)"),
    (dict(kind=V41Kind.SWA_ONLY, owns_compressed=False), "an SWA-only layer has no"),
    (dict(topk=0), "topk must be a positive int for a C2A layer"),
])
def test_config_refusals(changes, match):
    kw = dict(num_heads=8, kind=V41Kind.C2A, max_num_tokens=64, max_num_reqs=4,
              max_model_len=256)
    with pytest.raises((ValueError, TypeError), match=match):
        V41LayerConfig(**{**kw, **changes})


def test_v4_configs_and_backends_do_not_mix():
    with pytest.raises(TypeError, match="config must be a V41LayerConfig"):
        V41FlashMLABackend(v4_cases.config(LayerKind.C4A))
    with pytest.raises(TypeError, match="kind must be a LayerKind"):
        v4_cases.config(V41Kind.C1A)
    # A V4.1 config is a LayerConfig, but the V4 backend's planner key tells them apart.
    v41 = V41FlashMLABackend(config(V41Kind.C1A))
    with pytest.raises(ValueError, match="cannot be shared"):
        FlashMLABackend(v4_cases.config(LayerKind.C4A), planner=v41.planner)


@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("cache", ("swa", "compressed"))
def test_a_cache_in_another_record_is_refused(cache, records):
    """Caches allocated for another record choice (another bytes-per-token last dim) are
    refused by name before any byte is written: never a write of one record into a cache
    laid out for another."""
    h, st = _setup(records=records)
    other = next(r for r in RECORDS if r[cache == "compressed"] != records[cache == "compressed"])
    spec = V41FlashMLABackend(config(V41Kind.C2A, max_num_tokens=256, records=other)
                              ).cache_specs()[cache]
    wrong = spec.allocate(h.caches[cache].shape[0], fill=0xFF)
    _expect_refusal(h, st, rf"caches\['{cache}'\] must have shape \[num_blocks, "
                           rf"{h.caches[cache].shape[1]}, {h.caches[cache].shape[2]}\]",
                    caches={**h.caches, cache: wrong})
    assert torch.equal(storage_bytes(wrong), torch.full_like(storage_bytes(wrong), 0xFF))


@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
def test_compressed_rows_one_per_token(records):
    """V4.1's compressed write rotates each row at its token's position: a compressor output
    of another length is refused."""
    h, st = _setup(records=records)
    _expect_refusal(h, st, r"compressed_kv must have one row per token",
                    compressed_kv=st.compressed_kv[:-1],
                    compressed_slot_mapping=st.batch.compressed_slot_mapping[:-1])


def _setup(kind=V41Kind.C2A, reader=False, records=(584, 584)):
    source = Harness(config(kind, max_num_tokens=256, records=records), "cpu", seed=2)
    h = source
    if reader:
        h = Harness(config(kind, max_num_tokens=256, owns_compressed=False, records=records),
                    "cpu", seed=3, source=source)
    for x in {id(source): source, id(h): h}.values():
        x.step([], [(0, 40), (1, 30)])
    st = h.sim.step([(0, 1)], [(1, 20)])
    return h, st


def _expect_refusal(h, st, match, compressed_kv="step", exc=ValueError, caches=None,
                    **changes):
    batch = dataclasses.replace(st.batch, **changes)
    ckv = st.compressed_kv if compressed_kv == "step" else compressed_kv
    before = {n: storage_bytes(c).cpu() for n, c in h.caches.items()}
    out = torch.zeros(st.q.shape, dtype=torch.bfloat16)
    with pytest.raises(exc, match=match):
        h.backend.forward(st.q, st.kv, caches or h.caches, batch, h.cos_sin, h.sink, out, ckv)
    for n, c in h.caches.items():
        assert torch.equal(storage_bytes(c).cpu(), before[n]), f"{n} cache written before the error"


@pytest.mark.parametrize("kind", (V41Kind.C1A, V41Kind.C2A), ids=lambda k: k.name)
def test_compressed_layers_need_the_topk(kind):
    h, st = _setup(kind)
    _expect_refusal(h, st, f"topk_indices .* required for a {kind.name} layer",
                    topk_indices=None)


def test_topk_id_past_the_entries():
    """C2A: a token at position p has (p + 1) // 2 entries."""
    h, st = _setup(V41Kind.C2A)
    tk = st.batch.topk_indices.clone()
    p = int(st.batch.positions[0])
    tk[0, 0] = (p + 1) // 2
    _expect_refusal(h, st, r"topk_indices\[0, 0\]", topk_indices=tk)


def test_reader_refuses_rows_for_the_cache_it_reads():
    source = Harness(config(V41Kind.C1A, max_num_tokens=256), "cpu", seed=2)
    h = Harness(config(V41Kind.C1A, max_num_tokens=256, owns_compressed=False), "cpu",
                seed=3, source=source)
    st = h.sim.step([], [(0, 30)])        # not through run(): keeps the compressor's rows
    _expect_refusal(h, st, "never writes it")
    _expect_refusal(h, st, "never writes it", compressed_kv=None)


def test_reader_needs_the_source_cache():
    h, st = _setup(V41Kind.C1A, reader=True)
    st.batch.compressed_slot_mapping = None
    caches = {"swa": h.caches["swa"]}
    out = torch.zeros(st.q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="missing 'compressed'"):
        h.backend.forward(st.q, st.kv, caches, st.batch, h.cos_sin, h.sink, out, None)
    assert set(h.backend.allocate_caches({"swa": 4})) == {"swa"}
