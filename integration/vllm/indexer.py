"""vLLM's DeepSeek-V4 indexer top-k on sparse_mla's indexer op (docs/integrations.md, "The
indexer"), for where vLLM's own cannot run.

vLLM 0.32.0 selects the indexer's top-k in ``SparseAttnIndexer`` (model_executor/layers/
sparse_attn_indexer.py): on CUDA with DeepGEMM's ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits``
(sm_90 / sm_100 only; the constructor refuses CUDA without DeepGEMM), on CPU with
``fp8_paged_mqa_logits_cpu`` + ``topk_transform_512_cpu`` (K = 512 only, no MTP). Its inputs
are what :func:`indexer_topk` takes: ``q_quant`` (e4m3 ``[T, H, 128]``), ``weights`` (fp32
``[T, H]``, the softmax scale, H^-0.5 and each (token, head)'s power-of-two q scale folded in),
the paged indexer cache (fp8 pages, docs/semantics.md §11.1) and its
``DeepseekV32IndexerMetadata``, whose lengths are already compressed for DeepSeek-V4: every
query row comes with the count of entries it may select (prefill ``cu_seqlen_ke -
cu_seqlen_ks``, decode ``seq_lens`` = tokens // ratio). So each row runs as a one-token
request of ``indexer_topk_decode`` with ratio 1 over its request's block-table row: the same
per-row paged formulation as vLLM's CPU path, on any GPU the Triton op runs on, any K, MTP
included.

The math is vLLM's (tests/integration/vllm/test_indexer_math.py compares the selected sets
against vLLM's own CPU kernels); the one difference is the order of the ids in a row: ours by
score (ties by lower id, §11.4), vLLM's in its top-k kernel's order. Consumers (the sparse
attention) read the row as a set.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.indexer import indexer_topk_decode


def indexer_topk(q_quant, weights, kv_cache, metadata, topk_out, impl="auto"):
    """``topk_out[:T]`` <- each row's request-local top ``topk_out.shape[1]`` entries, -1
    padded, from vLLM's ``DeepseekV32IndexerMetadata`` (``T`` = its slot mapping's length);
    returns ``topk_out``. ``kv_cache``: vLLM's ``[num_blocks, block_size, 132]`` view."""
    num_tokens = metadata.slot_mapping.shape[0]
    topk_out[:num_tokens] = -1
    block_size = kv_cache.shape[1]
    if metadata.num_prefills > 0 and metadata.prefill is not None:
        for chunk in metadata.prefill.chunks:
            rows = slice(chunk.token_start, chunk.token_end)
            counts = (chunk.cu_seqlen_ke - chunk.cu_seqlen_ks).to(torch.int32)
            if counts.numel() == 0:
                continue
            starts = chunk.local_cu_seq_lens
            if starts is None:
                starts = chunk.cu_seq_lens
            # A row's request from its row-start tag (zero-length requests tie harmlessly:
            # their rows have no candidate).
            req = torch.searchsorted(starts, chunk.cu_seqlen_ks, right=True) - 1
            _rows_topk(q_quant[rows], weights[rows], kv_cache, counts,
                       chunk.block_table[req.clamp_min(0)], topk_out[rows], block_size,
                       int(counts.max()), impl)
    if metadata.num_decodes > 0 and metadata.decode is not None:
        n = metadata.num_decode_tokens
        seq, table = decode_rows(metadata.decode, n)
        _rows_topk(q_quant[:n], weights[:n], kv_cache, seq, table, topk_out[:n], block_size,
                   None, impl)
    return topk_out


def decode_rows(decode, num_tokens):
    """Each decode token's entry count and block-table row from vLLM's
    ``DeepSeekV32IndexerDecodeMetadata``, on the device, without a host sync.

    ``decode_lens[b]`` tokens of entry b (a request, or one token where vLLM flattened the
    batch) lie back to back; its token j reads ``seq_lens[b, j]`` (2-D, native MTP) or
    ``seq_lens[b]`` (1-D) and ``block_table[b]``. That is vLLM's own pairing in every layout,
    the padded one (``requires_padding``: unequal ``decode_lens``, which vLLM packs to
    ``[B, max]`` rows and unpacks after its top-k) included. Tokens past ``sum(decode_lens)``
    (a padded batch's tail) get no entry.
    """
    lens = decode.decode_lens.reshape(-1).to(torch.int64)
    ends = torch.cumsum(lens, 0)
    t = torch.arange(num_tokens, device=lens.device)
    b = torch.searchsorted(ends, t, right=True).clamp_max(max(lens.numel() - 1, 0))
    j = t - (ends[b] - lens[b])
    live = j < lens[b]
    seq_lens = decode.seq_lens
    if seq_lens.ndim == 2:
        seq = seq_lens[b, j.clamp(0, seq_lens.shape[1] - 1)]
    else:
        seq = seq_lens[b]
    seq = torch.where(live, seq, torch.zeros_like(seq)).to(torch.int32)
    return seq, decode.block_table[b]


def _rows_topk(q, weights, kv_cache, counts, table, out, block_size, max_count, impl):
    """Row i selects among entries ``< counts[i]`` of block-table row ``table[i]``: a one-token
    request at position ``counts[i] - 1`` with ratio 1."""
    indexer_topk_decode(q, weights, kv_cache, counts, table, out, ratio=1, next_n=1,
                        block_size=block_size, max_candidates=max_count, impl=impl)
