"""Bad metadata raises a clear error before any cache byte is written (CPU: the value checks
run; on CUDA they run with SPARSE_MLA_CHECK_VALUES=1)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla.backends.v4 import LayerConfig, LayerKind
from sparse_mla.tests.backends.cases import Harness, config
from sparse_mla.tests.helpers import storage_bytes


def _setup(kind=LayerKind.C4A, backend="flashmla"):
    h = Harness(backend, config(kind, max_num_tokens=256), "cpu", seed=2)
    h.step([], [(0, 40), (1, 30)])
    st = h.sim.step([(0, 1)], [(1, 20)])
    return h, st


def _expect_refusal(h, st, match, **changes):
    batch = dataclasses.replace(st.batch, **{k: v for k, v in changes.items()
                                             if k not in ("q", "kv", "cos_sin")})
    q = changes.get("q", st.q)
    kv = changes.get("kv", st.kv)
    cos_sin = changes.get("cos_sin", h.cos_sin)
    before = {n: storage_bytes(c).cpu() for n, c in h.caches.items()}
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        h.backend.forward(q, kv, h.caches, batch, cos_sin, h.sink, out, st.compressed_kv)
    for n, c in h.caches.items():
        assert torch.equal(storage_bytes(c).cpu(), before[n]), f"{n} cache written before the error"


def test_seq_len_below_query_len():
    h, st = _setup()
    seq = st.batch.seq_lens.clone()
    seq[1] = 5
    _expect_refusal(h, st, "query_len 20 > seq_lens", seq_lens=seq,
                    seq_lens_cpu=seq.clone())


def test_position_beyond_rope_table():
    h, st = _setup()
    _expect_refusal(h, st, "rows of cos_sin_cache", cos_sin=h.cos_sin[:30])


def test_positions_disagree_with_request():
    h, st = _setup()
    pos = st.batch.positions.clone()
    pos[0] += 1
    _expect_refusal(h, st, r"batch.positions\[0\]", positions=pos)


def test_block_table_too_small():
    h, st = _setup()
    _expect_refusal(h, st, "swa_block_table row 0 has 0 blocks",
                    swa_block_table=st.batch.swa_block_table[:, :0].contiguous())


def test_block_table_names_missing_block():
    h, st = _setup()
    t = st.batch.swa_block_table.clone()
    t[1, 0] = -1
    _expect_refusal(h, st, r"swa_block_table\[1, 0\] = -1 is not a block", swa_block_table=t)


def test_compressed_table_too_small():
    h, st = _setup()
    _expect_refusal(h, st, "compressed_block_table row",
                    compressed_block_table=st.batch.compressed_block_table[:, :0].contiguous())


def test_topk_width_not_the_layers():
    h, st = _setup()
    _expect_refusal(h, st, r"topk_indices must have shape \[>= 21, 64\]",
                    topk_indices=st.batch.topk_indices[:, :32].contiguous())


def test_topk_id_beyond_existing_entries():
    h, st = _setup()
    tk = st.batch.topk_indices.clone()
    tk[0, 0] = 1000
    _expect_refusal(h, st, r"topk_indices\[0, 0\] = 1000", topk_indices=tk)


def test_token_count_over_capacity():
    h = Harness("flashmla", config(LayerKind.SWA_ONLY, max_num_tokens=16), "cpu")
    st = h.sim.step([], [(0, 20)])
    _expect_refusal(h, st, "max_num_tokens=16")


def test_prefill_over_workspace():
    h = Harness("trtllm_bf16", config(LayerKind.SWA_ONLY), "cpu")   # trtllm: no workspace
    h2 = Harness("flashmla", config(LayerKind.SWA_ONLY, prefill_workspace_rows=150), "cpu")
    st = h2.sim.step([], [(0, 200)])
    _expect_refusal(h2, st, "workspace rows")
    out, st = h.step([], [(0, 200)])
    h.check(out, st)


def test_head_count_not_the_layers():
    h, st = _setup()
    _expect_refusal(h, st, r"\[num_tokens, 8, 512\]", q=st.q[:, :4].contiguous())


def test_counts_disagree_with_query_start_loc():
    h, st = _setup()
    _expect_refusal(h, st, "prefill tokens start at row", num_decode_tokens=2,
                    num_prefill_tokens=19)


def test_config_errors():
    with pytest.raises(ValueError, match="num_heads must be 1..128"):
        LayerConfig(num_heads=129, kind=LayerKind.C4A, max_num_tokens=8, max_num_reqs=1,
                    max_model_len=64)
    with pytest.raises(ValueError, match="compress_ratio must be"):
        LayerKind.from_ratio(8)
    assert LayerKind.from_ratio(0) is LayerKind.SWA_ONLY


def test_cache_of_the_wrong_layout():
    h, st = _setup(backend="trtllm_bf16")
    caches = dict(h.caches, swa=h.caches["swa"].to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match=r"caches\['swa'\]"):
        h.backend.forward(st.q, st.kv, caches, st.batch, h.cos_sin, h.sink,
                          torch.zeros(st.q.shape, dtype=torch.bfloat16), st.compressed_kv)


def test_write_reads_no_topk_but_attend_needs_it():
    """vLLM fills the indexer's top-k after the cache write: ``write`` takes a batch without
    it, ``attend`` refuses one, and write + attend equals the oracle (as ``forward`` does)."""
    h, st = _setup()
    no_topk = dataclasses.replace(st.batch, topk_indices=None)
    q_rot = h.backend.write(st.q, st.kv, h.caches, no_topk, h.cos_sin, st.compressed_kv)
    h.written["swa"].update(st.swa_slots)
    h.written["compressed"].update(st.comp_slots)
    out = torch.full(st.q.shape, float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="topk_indices .*is required"):
        h.backend.attend(q_rot, h.caches, no_topk, h.sink, out)
    h.backend.attend(q_rot, h.caches, st.batch, h.sink, out)
    h.check(out, st, "write + attend")
