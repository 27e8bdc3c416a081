"""The kpool indexer family's Triton route.

Selection: a pool is exactly a §11 indexer entry with ratio = kpool (candidate j < (p + 1) //
kpool, its block readable), the pooled cache is the indexer's fp8 page with fp32 scales, and
ops/indexer's select kernels keep the same order (larger score first, equal scores by lower
id, -1 after). So both top-k ops run ops/indexer's Triton scores + select for topk // kpool
pools, software e4m3 included (``SPARSE_MLA_SOFT_FP8``), then expand on the device (no host
sync). ``ue8m0`` scales are not read by those kernels: that case takes the reference.
Insert: not written yet; its check rejects the route with a reason.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common.dispatch import triton_check_args
from sparse_mla.ops.indexer import triton_impl as indexer_triton

INSERT_REASON = "the kpool insert's Triton kernel is not written yet (reference route only)"


def insert_unavailable(*args, **kwargs):
    return INSERT_REASON


def k_insert(*args, **kwargs):
    raise NotImplementedError(INSERT_REASON)


def decode_check(q, weights, k_cache, seq_lens, block_table, kpool, next_n, out, block_size,
                 max_candidates, scale_fmt):
    if scale_fmt != "fp32":
        return f"scale_fmt={scale_fmt!r}: ops/indexer's kernels read fp32 scales only"
    return triton_check_args(q, weights, k_cache, seq_lens, block_table, out)


def expand(pools, seq_len, kpool, out):
    """reference.expand on the device: pools [n, G], seq_len [n] (position + 1, >= 0)."""
    n, groups = pools.shape
    dev = pools.device
    p = pools.long().unsqueeze(-1)
    hist = torch.where(p >= 0, p * kpool + torch.arange(kpool, device=dev), -1)
    start = torch.div(seq_len.long(), kpool, rounding_mode="floor") * kpool
    tail = start.unsqueeze(1) + torch.arange(kpool - 1, device=dev)
    tail = torch.where(tail < seq_len.long().unsqueeze(1), tail, -1)
    out[:, :groups * kpool] = hist.reshape(n, groups * kpool).to(out.dtype)
    out[:, groups * kpool:] = tail.to(out.dtype)


def _pools(out, kpool):
    return torch.empty(out.shape[0], (out.shape[1] - kpool + 1) // kpool, dtype=torch.int32,
                       device=out.device)


def topk_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, kpool, out,
                 chunk, max_seqlen_k):
    n = q.shape[0]
    if n == 0:
        return
    pools = _pools(out, kpool)
    indexer_triton.topk_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k,
                                positions, kpool, pools, chunk, max_seqlen_k)
    expand(pools, positions[:n].long() + 1, kpool, out)


def topk_decode(q, weights, k_cache, seq_lens, block_table, kpool, next_n, out, block_size,
                max_candidates, scale_fmt):
    n = q.shape[0]
    if n == 0:
        return
    pools = _pools(out, kpool)
    indexer_triton.topk_decode(q, weights, k_cache, seq_lens, block_table, kpool, next_n,
                               pools, block_size, max_candidates)
    batch = n // next_n
    i = torch.arange(next_n, device=q.device)
    seq = (seq_lens[:batch].long().unsqueeze(1) - next_n + 1 + i).clamp_min(0).reshape(n)
    expand(pools, seq, kpool, out)
