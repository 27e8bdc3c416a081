"""The TRTLLM-gen-semantics ops' PyTorch reference (the oracle and the CPU kernel): their
arguments as key sources of the shared attention reference, and the family's own arithmetic,
which leading index columns each query token may use. The tensor-op forms of those counts are
the readable definitions; ``triton_impl.py`` computes the same int32 counts in one launch.

Addressing: FlashInfer's TRTLLM-gen kernels see a pool as flat token rows (page size 1): slot
``s`` is read at ``base + s * token_stride`` (``flat_rows``); ops.py validates the pools.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import formats
from sparse_mla.ops.attention import KeySource, sparse_attention_reference

I32 = torch.int32
SWA_COLS = 128                        # fixed SWA window columns of a DSv4 index row
DSV4_DIM = formats.HEAD_DIM
V32_DIM = formats.V32.out_dim         # 576 = 512 latent + 64 RoPE
V_DIM = formats.HEAD_DIM


def token_map(T: int, B: int, Q: int, cum_seq_lens_q: Optional[Tensor], device):
    """Per token: request id, index inside its request, its request's query length, and
    whether it belongs to a request at all (varlen rows outside ``cum_seq_lens_q`` do not).
    Tensor ops only (no host sync)."""
    t = torch.arange(T, device=device)
    if cum_seq_lens_q is None:
        req = t // Q
        return req, t - req * Q, torch.full_like(t, Q), torch.ones_like(t, dtype=torch.bool)
    cu = cum_seq_lens_q.long()
    req = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp_(max=B - 1)
    start, end = cu[req], cu[req + 1]
    return req, t - start, end - start, (t >= start) & (t < end)


def dsv4_lengths(T, B, Q, sparse_topk_lens, seq_lens, cum_seq_lens_q, topk):
    """SWA: ``min(seq_len - q_len + q_idx + 1, 128)`` leading columns (0 if negative);
    compressed: ``sparse_topk_lens - 128`` leading columns (clamped to [0, TOPK - 128])."""
    req, qi, ql, inb = token_map(T, B, Q, cum_seq_lens_q, sparse_topk_lens.device)
    visible = seq_lens.long()[req] - ql + qi + 1 if B else torch.zeros_like(req)
    zero = torch.zeros_like(req)
    swa_len = torch.where(inb, visible.clamp(0, SWA_COLS), zero).to(I32)
    cmp_len = torch.where(inb, (sparse_topk_lens.long() - SWA_COLS).clamp(0, topk - SWA_COLS),
                          zero).to(I32)
    return swa_len, cmp_len


def v32_lengths(T, B, Q, seq_lens, cum_seq_lens_q, K):
    req, _, _, inb = token_map(T, B, Q, cum_seq_lens_q, seq_lens.device)
    n = seq_lens.long()[req].clamp(0, K) if B else torch.zeros_like(req)
    return torch.where(inb, n, torch.zeros_like(n)).to(I32)


# ---------------------------------------------------------------------------------------------
# pools: flat token rows

def pool_view(cache: Tensor, kv_layout: str) -> Tensor:
    """The ``[pages, page_size, width]`` view of a pool ops.py validated: 3-D as it is, 4-D
    with its one KV head selected (``HND`` [pages, 1, page_size, width], ``NHD`` [pages,
    page_size, 1, width])."""
    if cache.dim() == 3:
        return cache
    return cache.select(1, 0) if kv_layout == "HND" else cache.select(2, 0)


def token_stride(v: Tensor) -> int:
    pages, ps, d = v.shape
    if ps > 1:
        return v.stride(1)
    return v.stride(0) if pages > 1 else d


def pool_rows(v: Tensor) -> int:
    """Rows of a pool view addressed as flat tokens (pages may lie further apart than
    ``page_size`` rows: a packed pool)."""
    pages, ps, _ = v.shape
    span = v.stride(0) // token_stride(v) if pages > 1 else ps
    return (pages - 1) * span + ps


def flat_rows(v: Tensor) -> Tensor:
    """``[rows, 1, D]`` view of a pool view: row ``s`` at ``base + s * token_stride``."""
    tok = token_stride(v)
    return v.as_strided((pool_rows(v), 1, v.shape[2]), (tok, tok, 1), v.storage_offset())


def plain_format(dtype) -> str:
    return "plain_bf16" if dtype == torch.bfloat16 else "plain_fp8"


def host_scale(value: float, tensor: Optional[Tensor]) -> float:
    """The scale as a float (a tensor scale is read on the host: the reference syncs)."""
    return value if tensor is None else float(tensor.reshape(-1)[0])


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4: trtllm_batch_decode_sparse_mla_dsv4

def dsv4_problem(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens,
                 seq_lens, out, kv_layout, cum_seq_lens_q, max_q_len, lengths=None):
    """(q [T, H, 512], sources, out [T, H, 512]) for the shared attention layer; ``lengths``
    computes a varlen batch's per-token column counts (default: the PyTorch definition)."""
    H = query.shape[-2]
    q = query.reshape(-1, H, DSV4_DIM)
    T = q.shape[0]
    B = seq_lens.shape[0]
    Q = query.shape[1] if cum_seq_lens_q is None else max_q_len
    swa = flat_rows(pool_view(swa_kv_cache, kv_layout))
    cmp = flat_rows(pool_view(compressed_kv_cache, kv_layout))
    topk = sparse_indices.shape[1]
    fmt = plain_format(query.dtype)
    if cum_seq_lens_q is None:
        # One query length Q: the kernels derive each token's counts from seq_lens and
        # sparse_topk_lens themselves, with no lengths launch (lab/perf-log.md, "In-kernel
        # TRTLLM column counts")
        swa_counts = dict(lengths=seq_lens, tokens_per_length=Q, causal=True)
        cmp_counts = dict(lengths=sparse_topk_lens, length_offset=SWA_COLS)
    else:
        swa_len, cmp_len = (lengths or dsv4_lengths)(T, B, Q, sparse_topk_lens, seq_lens,
                                                      cum_seq_lens_q, topk)
        swa_counts, cmp_counts = dict(lengths=swa_len), dict(lengths=cmp_len)
    sources = [KeySource(swa, fmt, 1, sparse_indices[:, :SWA_COLS], **swa_counts)]
    if topk > SWA_COLS:
        sources.append(KeySource(cmp, fmt, 1, sparse_indices[:, SWA_COLS:], **cmp_counts))
    return q, sources, out.view(T, H, V_DIM)


def dsv4(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens, seq_lens,
         out, bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor, sinks, kv_layout,
         cum_seq_lens_q, max_q_len, workspace_buffer):
    q, sources, o = dsv4_problem(query, swa_kv_cache, sparse_indices, compressed_kv_cache,
                                 sparse_topk_lens, seq_lens, out, kv_layout, cum_seq_lens_q,
                                 max_q_len)
    res, _ = sparse_attention_reference(q, sources, sinks,
                                        host_scale(bmm1_scale, bmm1_scale_tensor),
                                        host_scale(bmm2_scale, bmm2_scale_tensor))
    o.copy_(res)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3.2: trtllm_batch_decode_with_kv_cache_mla(..., sparse_mla_top_k=K)

def v32_problem(query, kv_cache, block_tables, seq_lens, out, cum_seq_lens_q, max_q_len,
                lengths=None):
    """As :func:`dsv4_problem`, for the V3.2 op (one plain 576-wide pool)."""
    H = query.shape[-2]
    q = query.reshape(-1, H, V32_DIM)
    T = q.shape[0]
    B = seq_lens.shape[0]
    Q = query.shape[1] if query.dim() == 4 else (1 if cum_seq_lens_q is None else max_q_len)
    idx = block_tables.reshape(T, -1)
    rows = flat_rows(pool_view(kv_cache, "HND"))
    if cum_seq_lens_q is None:      # one query length: the kernels read seq_lens[t // Q]
        n, per = seq_lens, Q
    else:
        n, per = (lengths or v32_lengths)(T, B, Q, seq_lens, cum_seq_lens_q, idx.shape[1]), 1
    return q, [KeySource(rows, plain_format(query.dtype), 1, idx, n, per)], out.view(T, H, V_DIM)


def v32(query, kv_cache, block_tables, seq_lens, out, bmm1_scale, bmm1_scale_tensor, bmm2_scale,
        bmm2_scale_tensor, sinks, cum_seq_lens_q, max_q_len, workspace_buffer):
    q, sources, o = v32_problem(query, kv_cache, block_tables, seq_lens, out, cum_seq_lens_q,
                                max_q_len)
    res, _ = sparse_attention_reference(q, sources, sinks,
                                        host_scale(bmm1_scale, bmm1_scale_tensor),
                                        host_scale(bmm2_scale, bmm2_scale_tensor))
    o.copy_(res)
