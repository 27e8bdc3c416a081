"""The step benchmark's batches are valid batches: the backend's own value checks accept them
(positions, block tables, slots and top-k ids agree), and a small one runs on CPU against the
op it times."""
import sys
import types

import pytest
import torch

from sparse_mla.backends.v4 import FlashMLABackend, LayerConfig, LayerKind
from sparse_mla.ops.flashmla_decode import vendor
from sparse_mla.tools import bench_backend


@pytest.mark.parametrize("kind", (LayerKind.C4A, LayerKind.C128A), ids=lambda k: k.name)
def test_benchmark_batches_pass_the_backends_checks(kind):
    lens = [(300, 1), (130, 2), (0, 64)]          # two decodes, then a prefill from position 0
    cfg = LayerConfig(num_heads=2, kind=kind, max_num_tokens=67, max_num_reqs=3,
                      max_model_len=512, topk=64)
    batch, blocks, T = bench_backend._batch(cfg, lens, "cpu", torch.Generator().manual_seed(0))
    assert (batch.num_decodes, batch.num_decode_tokens, batch.num_prefill_tokens) == (2, 3, 64)
    be = FlashMLABackend(cfg)
    caches = be.allocate_caches(blocks)
    q = torch.randn(T, 2, 512).to(torch.bfloat16)
    be.validate(q, caches, batch, torch.randn(T, 512).to(torch.bfloat16),
                bench_backend._cos_sin(512, "cpu"),
                torch.randn(T, 512).to(torch.bfloat16) if kind.compressed else None)


def _fake_flash_mla(calls, metas):
    """Records what the vLLM-like layer hands FlashMLA; returns zeros shaped as FlashMLA's."""
    fake = types.ModuleType("flash_mla")

    def get_mla_metadata():
        metas.append(object())
        return metas[-1], None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, **kw):
        calls.append(dict(q=q, k_cache=k_cache, meta=meta, **kw))
        b, s_q, h, _ = q.shape
        return (torch.full((b, s_q, h, head_dim_v), 0.5, dtype=torch.bfloat16),
                torch.zeros(b, h, s_q))
    fake.get_mla_metadata, fake.flash_mla_with_kvcache = get_mla_metadata, flash_mla_with_kvcache
    return fake


@pytest.mark.parametrize("kind", (LayerKind.C4A, LayerKind.C128A), ids=lambda k: k.name)
def test_vllm_like_layer_hands_flashmla_the_planners_lists(monkeypatch, kind):
    """The fair column's layer: one scheduler metadata until a new step, the planner's lists
    as they are (C128A's padded to a multiple of 64 with -1), FlashMLA's paged view addressing
    the slot a row was written to, its output left where FlashMLA put it."""
    calls, metas = [], []
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla(calls, metas))
    lens = [(300, 1), (130, 2), (0, 64)]
    cfg = LayerConfig(num_heads=2, kind=kind, max_num_tokens=67, max_num_reqs=3,
                      max_model_len=512, topk=64)
    batch, blocks, T = bench_backend._batch(cfg, lens, "cpu", torch.Generator().manual_seed(0))
    be = bench_backend.vllm_like(FlashMLABackend)(cfg)
    caches = be.allocate_caches(blocks, fill=0)
    g = torch.Generator().manual_seed(1)
    q, kv = (torch.randn(T, 2, 512, generator=g).to(torch.bfloat16),
             torch.randn(T, 512, generator=g).to(torch.bfloat16))
    comp = torch.randn(T, 512, generator=g).to(torch.bfloat16)
    out = torch.zeros(T, 2, 512, dtype=torch.bfloat16)
    args = (q, kv, caches, batch, bench_backend._cos_sin(512, "cpu"),
            torch.zeros(2), out, comp)
    be.forward(*args)
    be.forward(*args)
    assert len(calls) == 2 and len(metas) == 1 and calls[1]["meta"] is metas[0]
    be.new_step()
    be.forward(*args)
    assert len(metas) == 2 and calls[2]["meta"] is metas[1]
    c, p, Td = calls[-1], be.planner, batch.num_decode_tokens
    assert c["q"].shape == (Td, 1, 64, 512)          # heads padded to FlashMLA's 64
    assert torch.equal(c["q"][:, 0, :2], be.q_rot[:Td])
    assert torch.equal(c["indices"][:, 0], p.swa_indices[:Td])
    assert torch.equal(c["topk_length"], p.swa_lens[:Td])
    extra = c["extra_indices_in_kvcache"][:, 0]
    width = p.compressed_indices.shape[1]
    assert extra.shape[1] % 64 == 0 and extra.shape[1] - width < 64
    assert torch.equal(extra[:, :width], p.compressed_indices[:Td])
    assert bool((extra[:, width:] == -1).all())
    assert torch.equal(c["extra_topk_length"], p.compressed_lens[:Td])
    # FlashMLA's paged views: the caches' own memory, as the op's vendor route views them
    for view, name, bs in ((c["k_cache"], "swa", cfg.swa_block_size),
                           (c["extra_k_cache"], "compressed", cfg.compressed_block_size)):
        route = vendor._paged_4d(caches[name], bs, 584)
        assert (view.shape, view.stride(), view.data_ptr()) == (
            route.shape, route.stride(), route.data_ptr())
    # decode rows: FlashMLA's output, real heads, not copied into out; prefill rows: ours
    assert be.decode_out().shape == (Td, 2, 512) and bool((be.decode_out() == 0.5).all())
    assert bool((out[:Td] == 0).all()) and bool(out[Td:].ne(0).any())
