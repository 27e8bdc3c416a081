"""One DeepSeek-V4.1 attention step against the dense step oracle: its three layer kinds
(SWA only, C1A, C2A with the indexer's top-k) in every record choice (584 + 584, 528 + 528,
528 + 288 B), 32-token SWA pages, 64-token compressed blocks, odd block sizes and pages
padded inside larger blocks, q without RMSNorm, the layer's own RoPE table, V4.1-Flash's
top-k 512 (prefill index width 640) and head counts, layers reading another layer's
compressed cache, and poisoned rows that show when read."""
from __future__ import annotations

import math

import pytest
import torch

from sparse_mla.backends.v4 import LayerKind
from sparse_mla.backends.v4 import FlashMLABackend
from sparse_mla.backends.v41 import V41FlashMLABackend, V41Kind
from sparse_mla.tests.backends import cases as v4_cases
from sparse_mla.tests.backends import oracle
from sparse_mla.tests.backends.sim import Simulator
from sparse_mla.tests.backends.v4.test_step import SCRIPT, stable_seed
from sparse_mla.tests.backends.v41.cases import (COMP_SEED, KINDS, RECORDS, THETA, Harness,
                                                 config, record_ids)
from sparse_mla.tests.helpers import CUDA, storage_bytes

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
COMPRESSED = (V41Kind.C1A, V41Kind.C2A)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_mixed_steps_match_oracle(device, kind, records):
    h = Harness(config(kind, records=records), device,
                seed=stable_seed("v41", kind.name, *records))
    specs = h.backend.cache_specs()
    assert specs["swa"].block_size == 32
    assert {n: s.bytes_per_token for n, s in specs.items()} == dict(
        zip(("swa", "compressed"), records[:len(specs)]))
    v4_cases.run_script(h, SCRIPT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("kind", (V41Kind.SWA_ONLY, V41Kind.C2A), ids=lambda k: k.name)
def test_odd_blocks_in_padded_pages(device, kind, records):
    """24-token SWA pages and 13-entry compressed blocks, every page followed by 96 bytes of
    another layer's data (blocks ``stride(0)`` apart, more than a page; the pad stays
    poisoned)."""
    cfg = config(kind, records=records, swa_block_size=24,
                 compressed_block_size=13 if kind.compressed else None)
    h = Harness(cfg, device, seed=stable_seed("odd", kind.name, *records), page_pad=96,
                swa_blocks=96, comp_blocks=96)
    assert h.caches["swa"].stride(0) == h.backend.cache_specs()["swa"].page_bytes + 96
    v4_cases.run_script(h, SCRIPT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("records", RECORDS[1:], ids=record_ids)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_token_inline_records_match_oracle(device, kind, records):
    """record_layout="inline": the 528 B / 288 B records token-inline as vLLM 0.33.0 writes
    them, the SWA blocks padded as 0.33 pads them (to a multiple of lcm(528, compressed
    record): 32 * 528 = 16896 B pages -> 19008 B with 288 B compressed rows), odd compressed
    blocks, every pad poisoned."""
    cfg = config(kind, records=records, record_layout="inline",
                 compressed_block_size=13 if kind.compressed else None)
    lcm = math.lcm(528, records[1])
    page = cfg.swa_block_size * 528
    pad = -page % lcm
    h = Harness(cfg, device, seed=stable_seed("inline", kind.name, *records), page_pad=pad,
                swa_blocks=96, comp_blocks=96)
    assert h.fmt["swa"] == "v41_inline"
    want = {"swa": "v41_inline", "compressed": {528: "v41_inline",
                                                 288: "v41_fp4_inline"}[records[1]]}
    specs = h.backend.cache_specs()
    assert {n: s.format for n, s in specs.items()} == {n: want[n] for n in specs}
    v4_cases.run_script(h, SCRIPT)


@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("cache", ("swa", "compressed"))
def test_a_poisoned_row_read_shows(cache, records):
    """The caches start as 0xFF bytes, which every record decodes to NaN (an e4m3 / UE8M0
    NaN, or an NVFP4 row with a NaN scale): a step pointed at a block no request wrote gives
    NaN, which ``check`` rejects, so the oracle tests would see any read of an unwritten
    row."""
    h = Harness(config(V41Kind.C1A, records=records), "cpu", seed=6)
    h.step([], [(0, 70)])
    st = h.sim.step([(0, 1)], [])
    table = st.batch.swa_block_table if cache == "swa" else st.batch.compressed_block_table
    used = set(h.sim.requests[0].swa_blocks if cache == "swa"
               else h.sim.requests[0].comp_blocks)
    table[0, 0] = next(b for b in range(64) if b not in used)
    out = h.run(st)
    assert out.isnan().any(), f"the poisoned {cache} block read as numbers"
    with pytest.raises(AssertionError, match="NaN in the output"):
        h.check(out, st)


def test_block_sizes_are_v41s():
    """32-token SWA pages; compressed blocks of 64 tokens (SM90): 64 entries for C1A, 32 for
    C2A; no compressed cache on SWA-only layers."""
    sizes = {k: {n: s.block_size for n, s in V41FlashMLABackend(config(k)).cache_specs().items()}
             for k in KINDS}
    assert sizes == {V41Kind.SWA_ONLY: {"swa": 32},
                     V41Kind.C1A: {"swa": 32, "compressed": 64},
                     V41Kind.C2A: {"swa": 32, "compressed": 32}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("kind", COMPRESSED, ids=lambda k: k.name)
def test_topk_512_with_prefill_width_640(device, kind, records):
    """V4.1-Flash's top-k: 512 of more than 512 entries (C1A: an entry per token), through
    the 640-wide prefill index lists and the decode's extra list."""
    cfg = config(kind, heads=4, topk=512, max_model_len=2048, max_num_tokens=1200,
                 records=records)
    h = Harness(cfg, device, seed=13, swa_blocks=96, comp_blocks=48)
    assert h.backend.combined.shape[1] == 640
    h.sim.table_width = 48
    out, st = h.step([], [(0, 1100)])
    assert int((st.batch.topk_indices >= 0).sum(-1).max()) == 512
    h.check(out, st, "prefill")
    out, st = h.step([(0, 2)], [])
    h.check(out, st, "decode")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("heads", (1, 64, 128))
def test_head_counts(device, heads, records):
    # V4.1-Flash: 64 heads (local heads 64 / TP); 128 the kernels' widest.
    script = (dict(decodes=[], prefills=[(0, 140)]),
              dict(decodes=[(0, 2)], prefills=[(1, 40)], pad_tokens=1))
    v4_cases.run_script(Harness(config(V41Kind.C2A, heads=heads, records=records), device,
                                seed=heads), script)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("kind", COMPRESSED, ids=lambda k: k.name)
def test_layer_reads_a_source_layers_compressed_cache(device, kind, records):
    """A consumer layer (not in kv_source_layer_ids) attends over the source layer's
    compressed cache with its own SWA cache, q and RoPE table, and never writes the shared
    cache: its bytes are the same before and after each of the reader's steps."""
    source = Harness(config(kind, records=records), device, seed=31)
    reader = Harness(config(kind, owns_compressed=False, records=records), device, seed=32,
                     source=source)
    assert set(reader.backend.cache_specs()) == {"swa"}
    assert set(reader.backend.read_specs()) == {"swa", "compressed"}
    assert reader.caches["compressed"] is source.caches["compressed"]
    for i, kw in enumerate(SCRIPT):
        out, st = source.step(**kw)
        source.check(out, st, f"source step {i}")
        before = storage_bytes(source.caches["compressed"]).cpu()
        out, st = reader.step(**kw)
        reader.check(out, st, f"reader step {i}")
        assert torch.equal(storage_bytes(source.caches["compressed"]).cpu(), before), (
            f"step {i}: the reader wrote the source's compressed cache")
        source.check_untouched()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_check_catches_another_layers_rope(kind):
    """The write rotates with the table the caller gives (per layer): the oracle of the
    same inputs rotated with another layer kind's base is rejected."""
    h = Harness(config(kind), "cpu", seed=9)
    other = 10000.0 if kind.compressed else 160000.0
    wrong = Simulator(h.cfg, "cpu", h.sim.storage, seed=9, theta=other,
                      comp_seed=h.sim.gc.initial_seed() if kind.compressed else None)
    _check_rejects(h, wrong)


def _check_rejects(h, wrong):
    """One step of ``h`` matches its own oracle, and the row bound rejects the oracle of
    ``wrong``, a simulator drawing the same inputs under another assumption."""
    st = h.sim.step(**SCRIPT[0])
    out = h.run(st)
    h.check(out, st)
    alt = wrong.step(**SCRIPT[0])
    assert torch.equal(alt.q.cpu(), st.q.cpu())
    with pytest.raises(AssertionError, match="relative L2 error"):
        h.check(out, alt)


@pytest.mark.parametrize("device", DEVICES)
def test_layers_of_a_kind_share_one_step_plan(device):
    cfg = config(V41Kind.C1A)
    first = Harness(cfg, device, seed=4)
    second = Harness(cfg, device, seed=4, planner=first.backend.planner)
    for kw in SCRIPT:
        a, b = first.sim.step(**kw), second.sim.step(**kw)
        first.backend.plan(a.batch, a.q.shape[0])
        first.check(first.run(a, planned=True), a, "first layer")
        second.check(second.run(b, batch=a.batch, planned=True), b, "second layer")
    with pytest.raises(ValueError, match="cannot be shared"):
        V41FlashMLABackend(config(V41Kind.C2A), planner=first.backend.planner)
    with pytest.raises(ValueError, match="cannot be shared"):
        FlashMLABackend(v4_cases.config(LayerKind.C4A), planner=first.backend.planner)


@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
def test_explain_names_the_ops_of_the_last_step(records):
    h = Harness(config(V41Kind.C2A, records=records), "cpu")
    h.step([], [(0, 20)])
    ran = {op: c.impl for op, c in h.backend.explain().items()}
    assert {"gather_dequant", "combine_topk_swa_indices", "flashmla_sparse_prefill"} <= set(ran)
    h.step([(0, 1)], [])
    ran = {op: c.impl for op, c in h.backend.explain().items()}
    assert set(ran) == {"fused_rope_insert_v41", "compressed_insert_v41",
                        "swa_indices_and_lens", "global_topk_indices_and_lens",
                        "flashmla_sparse_decode"}


@pytest.mark.parametrize("records, wrong", [
    ((528, 288), dict(comp_storage=oracle.Storage("v41"))),     # NVFP4 read as MXFP8
    ((528, 528), dict(comp_storage=oracle.Storage("v4"))),      # MXFP8 read as 584 B
    ((528, 528), dict(rotate_compressed=False)),                # entries left unrotated
], ids=("fp4-as-mxfp8", "mxfp8-as-584", "unrotated"))
def test_check_catches_another_compressed_record(records, wrong):
    """The row bound tells the records apart: the oracle of the same inputs with the
    compressed entries stored in another record, or not rotated, is rejected."""
    h = Harness(config(V41Kind.C1A, records=records), "cpu", seed=9)
    kw = dict(theta=THETA[V41Kind.C1A], comp_seed=COMP_SEED, rotate_compressed=True,
              comp_storage=h.sim.comp_storage)
    _check_rejects(h, Simulator(h.cfg, "cpu", h.sim.storage, seed=9, **{**kw, **wrong}))
