"""The kpool indexer family's Triton route.

Selection: a pool is exactly a §11 indexer entry with ratio = kpool (candidate j < (p + 1) //
kpool, its block readable), the pooled cache is the indexer's fp8 page with fp32 scales, and
ops/indexer's select kernels keep the same order (larger score first, equal scores by lower
id, -1 after). So both top-k ops run ops/indexer's Triton scores + select for topk // kpool
pools, software e4m3 included (``SPARSE_MLA_SOFT_FP8``), then expand on the device (no host
sync). ``ue8m0`` scales are not read by those kernels: that case takes the reference.
Insert: triton_kernels.py, pools then ring writes (a pool reads the ring as it was before the
call). Its pooling exp is Triton's, so a pooled row may differ from the reference's by one
bf16 rounding (rarely); from the bf16 row on, the bytes are the reference's.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common import checks
from sparse_mla.ops.common.dispatch import triton_check_args
from sparse_mla.ops.common.triton_utils import soft_fp8
from sparse_mla.ops.indexer import triton_impl as indexer_triton
from sparse_mla.ops.indexer_kpool import format as fmt
from sparse_mla.ops.indexer_kpool import triton_kernels as tk


def insert_check(k, gate, ape, positions, slot_mapping, tail_slot_mapping, k_cache, tail_cache,
                 kpool, block_size, scale_fmt):
    if tail_cache.stride(3) != 1 or tail_cache.stride(2) != fmt.DIM:
        return "tail_cache rows are not contiguous [ring, 128] (the kernel's addressing)"
    return triton_check_args(k, gate, ape, positions, slot_mapping, tail_slot_mapping,
                             k_cache, tail_cache)


def plan(positions, tail_slot_mapping, kpool, ring):
    """On the device, no sync: per row its tail block (-1: none), its pool's members (batch
    row or -1: the ring; reference.pool_plan) and whether it writes the ring
    (reference.ring_writers)."""
    n = positions.shape[0]
    dev = positions.device
    pos = positions.long()
    ts = tail_slot_mapping.long()
    blk = torch.where(ts >= 0, torch.div(ts, ring, rounding_mode="floor"), -1)
    back = torch.arange(kpool - 1, -1, -1, device=dev)
    cand = torch.arange(n, device=dev).unsqueeze(1) - back
    safe = cand.clamp(0, max(n - 1, 0))
    same = (cand >= 0) & (pos[safe] == pos.unsqueeze(1) - back) & (blk[safe] == blk.unsqueeze(1))
    members = torch.where(same, cand, -1).to(torch.int32).contiguous()
    ahead = torch.full_like(blk, -1)
    if n > kpool:
        ahead[:n - kpool] = blk[kpool:]
    write = ((ts >= 0) & ~((ahead >= 0) & (ahead == blk))).to(torch.int8)
    return blk.contiguous(), members, write


def k_insert(k, gate, ape, positions, slot_mapping, tail_slot_mapping, k_cache, tail_cache,
             kpool, block_size, scale_fmt):
    n = slot_mapping.shape[0]
    if n == 0:
        return
    ring = tail_cache.shape[2]
    blk, members, write = plan(positions[:n], tail_slot_mapping[:n], kpool, ring)
    kc = k[:n].contiguous()
    gc = gate[:n].contiguous()
    # the kernels index these by row: any stride the op accepts becomes unit stride here
    pos, slots, tslots = (t[:n].contiguous() for t in (positions, slot_mapping,
                                                       tail_slot_mapping))
    cache = k_cache.view(torch.uint8) if k_cache.dtype != torch.uint8 else k_cache
    soft = soft_fp8(k.device)
    tk.pool_insert_kernel[(n,)](
        kc, gc, ape.contiguous(), pos, slots, blk, members, tail_cache,
        tail_cache.stride(0), tail_cache.stride(1), cache,
        checks.block_stride(k_cache, fmt.FP8, block_size), block_size, KPOOL=kpool, RING=ring,
        UE8M0=scale_fmt == "ue8m0", SOFT=soft)
    tk.ring_write_kernel[(n,)](kc, gc, tslots, write, tail_cache,
                               tail_cache.stride(0), tail_cache.stride(1), RING=ring)


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
