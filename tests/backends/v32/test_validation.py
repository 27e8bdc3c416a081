"""Bad V3.2 inputs raise ValueError / TypeError naming the field, before any cache byte is
written (value checks: CPU tensors)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla.backends.v32 import V32Config, V32FlashMLABackend, V32TrtllmBackend
from sparse_mla.tests.backends.v32.cases import LAYOUTS, Harness, config


def _topk(st, t, j, v):
    tk = st.batch.topk_indices.clone()
    tk[t, j] = v
    return dict(batch=dataclasses.replace(st.batch, topk_indices=tk))


BAD = [
    ("q width 512", lambda st: dict(q=st.q[..., :512].contiguous()), ValueError,
     r"q must have shape \[num_tokens, 8, 576\]"),
    ("q dtype", lambda st: dict(q=st.q.float()), TypeError, "q must have dtype bfloat16"),
    ("kv width 544", lambda st: dict(kv=st.kv[:, :544].contiguous()), ValueError,
     r"kv must have shape \[\d+, 576\]"),
    ("kv dtype", lambda st: dict(kv=st.kv.float()), TypeError, "kv must have dtype bfloat16"),
    ("a RoPE table", lambda st: dict(cos_sin_cache=torch.zeros(4096, 64)), ValueError,
     "cos_sin_cache must be None for DeepSeek-V3.2"),
    ("compressor rows", lambda st: dict(compressed_kv=torch.zeros(4, 512)), ValueError,
     "compressed_kv must be None"),
    ("no top-k", lambda st: dict(batch=dataclasses.replace(st.batch, topk_indices=None)),
     ValueError, "batch.topk_indices .* is required"),
    ("top-k width", lambda st: dict(batch=dataclasses.replace(
        st.batch, topk_indices=st.batch.topk_indices[:, :32].contiguous())), ValueError,
     r"batch.topk_indices must have shape \[>= \d+, 64\]"),
    ("future top-k", lambda st: _topk(st, 5, 0, 6), ValueError,
     r"batch.topk_indices\[5, 0\] = 6: a token at position 5 may select positions 0..5"),
    ("top-k below -1", lambda st: _topk(st, 3, 1, -2), ValueError,
     r"batch.topk_indices\[3, 1\] = -2"),
    ("slot past the cache", lambda st: dict(batch=dataclasses.replace(
        st.batch, swa_slot_mapping=st.batch.swa_slot_mapping + 10 ** 5)), ValueError,
     r"batch.slot_mapping must be -1 or a slot in \[0, \d+\)"),
    ("short block table", lambda st: dict(batch=dataclasses.replace(
        st.batch, swa_block_table=st.batch.swa_block_table[:, :1].contiguous())), ValueError,
     r"batch.block_table row 0 has 1 blocks; position 69 needs block 1"),
    ("seq_len < query_len", lambda st: dict(batch=dataclasses.replace(
        st.batch, seq_lens=st.batch.seq_lens - 10)), ValueError, r"query_len \d+ > seq_lens"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("what,change,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_step_raises_before_any_write(layout, what, change, exc, msg):
    h = Harness(layout, config(), "cpu", seed=2)
    st = h.sim.step([], [(0, 70), (1, 30)])
    a = dict(q=st.q, kv=st.kv, batch=st.batch, cos_sin_cache=None, compressed_kv=None)
    a.update(change(st))
    out = torch.full((st.q.shape[0], 8, 512), 7.0, dtype=torch.bfloat16)
    with pytest.raises(exc, match=msg):
        h.backend.forward(a["q"], a["kv"], h.caches, a["batch"], a["cos_sin_cache"],
                          out=out, compressed_kv=a["compressed_kv"])
    h.check_untouched()                      # nothing written at all
    assert out.eq(7).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sink_and_out_buffer_checked(layout):
    h = Harness(layout, config(), "cpu")
    st = h.sim.step([], [(0, 20)])
    with pytest.raises(ValueError, match=r"out must have shape \[20, 8, 512\]"):
        h.backend.forward(st.q, st.kv, h.caches, st.batch,
                          out=torch.empty(20, 8, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no attention sink"):
        h.backend.forward(st.q, st.kv, h.caches, st.batch, attn_sink=torch.zeros(8),
                          out=torch.empty(20, 8, 512, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out is required"):
        h.backend.forward(st.q, st.kv, h.caches, st.batch)
    h.check_untouched()


def test_workspace_too_small_for_a_prefill_request():
    h = Harness("flashmla_fp8_separate", config(prefill_workspace_rows=64), "cpu")
    st = h.sim.step([], [(0, 70)])
    out = torch.empty(70, 8, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"prefill request 0 \(seq_len 70, query_len 70\) "
                                         r"needs 70 workspace rows, more than "
                                         r"prefill_workspace_rows=64"):
        h.backend.forward(st.q, st.kv, h.caches, st.batch, out=out)
    h.check_untouched()


def test_constructor_and_cache_checks():
    cfg = config()
    with pytest.raises(ValueError, match="cache_dtype must be one of"):
        V32FlashMLABackend(cfg, cache_dtype="fp8")
    with pytest.raises(ValueError, match="fp8_mode must be one of"):
        V32FlashMLABackend(cfg, fp8_mode="fast")
    with pytest.raises(TypeError, match="config must be a V32Config"):
        V32TrtllmBackend(object())
    with pytest.raises(ValueError, match="num_heads must be 1..128"):
        V32Config(num_heads=129, max_num_tokens=8, max_num_reqs=1, max_model_len=8)
    be = V32FlashMLABackend(cfg)
    assert be.cache_specs()["kv"].shape_per_block == (64, 656)
    assert V32TrtllmBackend(cfg).cache_specs()["kv"].shape_per_block == (64, 576)
    caches = be.allocate_caches({"kv": 2})
    assert caches["kv"].shape == (2, 64, 656) and caches["kv"].dtype == torch.uint8
    wrong = V32TrtllmBackend(cfg).allocate_caches({"kv": 2})
    h = Harness("flashmla_fp8_separate", cfg, "cpu")
    st = h.sim.step([], [(0, 8)])
    with pytest.raises(ValueError, match=r"caches\['kv'\] must have shape \[num_blocks, 64, "
                                         r"656\]"):
        be.forward(st.q, st.kv, wrong, st.batch, out=torch.empty(8, 8, 512, dtype=torch.bfloat16))
    bf16 = V32FlashMLABackend(cfg, cache_dtype="bfloat16")
    strided = torch.empty(2, 128, 576, dtype=torch.bfloat16)[:, ::2]
    with pytest.raises(ValueError, match=r"caches\['kv'\] \(bf16\) must be contiguous"):
        bf16.forward(st.q, st.kv, {"kv": strided}, st.batch,
                     out=torch.empty(8, 8, 512, dtype=torch.bfloat16))
