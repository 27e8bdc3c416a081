"""GLM-5.3-Flash's pooled-key (kpool) Lightning-indexer ops (docs/semantics.md §13) as
``sparse_mla::`` custom ops.

Each op: validate (raises before anything is written) -> dispatch (vendor, Triton, reference)
-> implementation. The fake implementations validate too.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import checks
from sparse_mla.ops.common.dispatch import implementations
from sparse_mla.ops.common.opdef import custom_op
from sparse_mla.ops.indexer import ops as indexer_ops
from sparse_mla.ops.indexer_kpool import format as fmt
from sparse_mla.ops.indexer_kpool import reference, triton_impl, vendor

FP8_KEYS = indexer_ops.FP8_KEYS
DEFAULT_KPOOL = 4
DEFAULT_TOPK = 2048


def _check_scale_fmt(scale_fmt):
    if scale_fmt not in fmt.SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {fmt.SCALE_FMTS}, got {scale_fmt!r}")


def _pool_cache_block_size(k_cache, block_size):
    if k_cache.dtype not in checks.BYTE_DTYPES:
        raise TypeError(f"k_cache must be the pooled-key cache of bytes (uint8), got "
                        f"{k_cache.dtype}")
    return checks.paged_cache_block_size("k_cache", k_cache, fmt.FP8, block_size)


def _check_out(out, n, kpool):
    """``out`` [n, topk + kpool - 1] int32, topk a positive multiple of kpool; returns topk."""
    checks.expect_tensor("out", out, torch.int32, (n, None))
    topk = out.shape[1] - (kpool - 1)
    if topk < kpool or topk % kpool:
        raise ValueError(f"out must have topk + kpool - 1 columns with topk a positive "
                         f"multiple of kpool={kpool}, got {out.shape[1]} columns")
    return topk


# ---------------------------------------------------------------------------------------------
# insert: pool + Hadamard + e4m3 into the pooled cache, raw tokens into the tail ring (§13.1)

_INSERT = implementations("kpool_k_insert", vendor=vendor.ROUTE, triton=triton_impl.k_insert,
                          reference=reference.k_insert)
# a strided tail ring: the reference (triton_impl)
_INSERT.register("triton", triton_impl.k_insert, triton_impl.insert_check)


def _validate_insert(k, gate, ape, positions, slot_mapping, tail_slot_mapping, k_cache,
                     tail_cache, kpool, block_size, scale_fmt):
    checks.expect_int("kpool", kpool, 2)
    _check_scale_fmt(scale_fmt)
    bs = _pool_cache_block_size(k_cache, block_size)
    n = k.shape[0] if k.dim() == 2 else -1
    checks.expect_tensor("k", k, (torch.bfloat16,), (n, fmt.DIM))
    checks.expect_tensor("gate", gate, (torch.bfloat16,), (n, fmt.DIM))
    checks.expect_tensor("ape", ape, (torch.float32,), (kpool, fmt.DIM))
    checks.expect_tensor("tail_cache", tail_cache, (torch.bfloat16,), (None, 2, None, fmt.DIM))
    ring = tail_cache.shape[2]
    if ring < kpool or ring % kpool:
        raise ValueError(f"tail_cache ring (shape[2]={ring}) must be a positive multiple of "
                         f"kpool={kpool}")
    checks.expect_vector("slot_mapping", slot_mapping, checks.INDEX_DTYPES, at_most=n,
                         note=" (one per row of k)")
    m = slot_mapping.shape[0]
    checks.expect_vector("positions", positions, checks.INDEX_DTYPES, at_least=m,
                         note=" (one per row of slot_mapping)")
    checks.expect_vector("tail_slot_mapping", tail_slot_mapping, checks.INDEX_DTYPES,
                         at_least=m, note=" (one per row of slot_mapping)")
    checks.expect_same_device(k=k, gate=gate, ape=ape, positions=positions,
                              slot_mapping=slot_mapping, tail_slot_mapping=tail_slot_mapping,
                              k_cache=k_cache, tail_cache=tail_cache)
    if checks.value_checks_enabled(slot_mapping, positions, tail_slot_mapping):
        checks.expect_slots_in_range("slot_mapping", slot_mapping, k_cache.shape[0] * bs)
        checks.expect_slots_in_range("tail_slot_mapping", tail_slot_mapping[:m],
                                     tail_cache.shape[0] * ring)
        checks.expect_values_in("positions", positions[:m], 0, entry="token")
        bad = (slot_mapping >= 0) & (positions[:m].long() % kpool != kpool - 1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"slot_mapping[{i}] >= 0 but positions[{i}]={int(positions[i])} "
                             f"is not the last token of a pool (position % {kpool} != "
                             f"{kpool - 1})")
    return bs


@custom_op("sparse_mla::kpool_k_insert", mutates_args=("k_cache", "tail_cache"))
def kpool_k_insert(k: Tensor, gate: Tensor, ape: Tensor, positions: Tensor,
                   slot_mapping: Tensor, tail_slot_mapping: Tensor, k_cache: Tensor,
                   tail_cache: Tensor, kpool: int = DEFAULT_KPOOL,
                   block_size: Optional[int] = None, scale_fmt: str = "fp32",
                   impl: str = "auto") -> None:
    """Insert a batch's indexer keys ``k`` and gate scores ``gate`` [N, 128] (bf16).

    Rows of a request are contiguous in position order (``positions``). A row whose
    ``slot_mapping`` (pool-granular, vLLM's ``compress_ratio == kpool`` mapping) is >= 0 is
    the last token of a pool: the pool's kpool tokens (from the batch where present, else
    from the tail ring as it was before this call) are softmax(gate + ``ape``)-pooled per
    dimension, rounded to bf16, Hadamard-rotated, bf16 again, and e4m3-quantized with one
    power-of-two scale into the pooled cache ``k_cache`` (uint8 ``[num_blocks, bs, 132]``;
    scale fp32 or ``ue8m0`` x4). ``tail_slot_mapping`` (token-granular ``block * ring + pos %
    ring``, -1 skips) places the raw key and gate in ``tail_cache`` [num_blocks, 2, ring, 128]
    for each request's last kpool tokens of the batch.
    """
    bs = _validate_insert(k, gate, ape, positions, slot_mapping, tail_slot_mapping, k_cache,
                          tail_cache, kpool, block_size, scale_fmt)
    _INSERT(k, gate, ape, positions, slot_mapping, tail_slot_mapping, k_cache, tail_cache,
            kpool, bs, scale_fmt, impl=impl)


@kpool_k_insert.register_fake
def _(k, gate, ape, positions, slot_mapping, tail_slot_mapping, k_cache, tail_cache,
      kpool=DEFAULT_KPOOL, block_size=None, scale_fmt="fp32", impl="auto"):
    _validate_insert(k, gate, ape, positions, slot_mapping, tail_slot_mapping, k_cache,
                     tail_cache, kpool, block_size, scale_fmt)


# ---------------------------------------------------------------------------------------------
# prefill: scores over a request's pools, top pools, expanded, tail appended (§13.4-13.6)

_PREFILL = implementations("kpool_topk_prefill", vendor=vendor.ROUTE,
                           triton=triton_impl.topk_prefill, reference=reference.topk_prefill)


def _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      kpool, chunk, max_seqlen_k):
    checks.expect_int("kpool", kpool, 2)
    indexer_ops._validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k,
                                  positions, out, kpool, chunk, max_seqlen_k)
    _check_out(out, q.shape[0], kpool)


@custom_op("sparse_mla::kpool_topk_prefill", mutates_args=("out",))
def kpool_topk_prefill(q: Tensor, weights: Tensor, k: Tensor, k_scale: Optional[Tensor],
                       cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, positions: Tensor,
                       out: Tensor, kpool: int = DEFAULT_KPOOL, chunk: int = 0,
                       max_seqlen_k: Optional[int] = None, impl: str = "auto") -> None:
    """Top-k token ids for a ragged batch of prefill tokens, into ``out`` [T, topk + kpool -
    1] int32.

    As ``indexer_topk_prefill`` (``q`` Hadamard-rotated, bf16 or e4m3; pooled keys ``k`` of
    request r at ``cu_seqlens_k[r]..``), with pools: token t at position p scores pools j <
    min(P_r, (p + 1) // kpool), picks the topk // kpool best (larger score first, equal by
    lower id, -1 pools after), writes pool g's tokens g*kpool..g*kpool+kpool-1 in columns
    g'*kpool.., then in columns topk.. the tail tokens ((p+1)//kpool)*kpool..p, then -1.
    Ids are request-local token ids.
    """
    _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      kpool, chunk, max_seqlen_k)
    _PREFILL(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, kpool, out, chunk,
             max_seqlen_k, impl=impl)


@kpool_topk_prefill.register_fake
def _(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out, kpool=DEFAULT_KPOOL,
      chunk=0, max_seqlen_k=None, impl="auto"):
    _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      kpool, chunk, max_seqlen_k)


# ---------------------------------------------------------------------------------------------
# decode over the paged pooled cache (§13.4-13.7)

_DECODE = implementations("kpool_topk_decode", vendor=vendor.ROUTE,
                          triton=triton_impl.topk_decode, reference=reference.topk_decode)
# ue8m0 scales: the reference (triton_impl)
_DECODE.register("triton", triton_impl.topk_decode, triton_impl.decode_check)


def _validate_decode(q, weights, k_cache, seq_lens, block_table, out, kpool, next_n,
                     block_size, max_candidates, scale_fmt):
    checks.expect_int("kpool", kpool, 2)
    _check_scale_fmt(scale_fmt)
    bs = _pool_cache_block_size(k_cache, block_size)
    indexer_ops.check_decode_inputs(q, weights, k_cache, seq_lens, block_table, out, next_n,
                                    max_candidates, lambda: _check_out(out, q.shape[0], kpool))
    return bs


@custom_op("sparse_mla::kpool_topk_decode", mutates_args=("out",), caches=("k_cache",))
def kpool_topk_decode(q: Tensor, weights: Tensor, k_cache: Tensor, seq_lens: Tensor,
                      block_table: Tensor, out: Tensor, kpool: int = DEFAULT_KPOOL,
                      next_n: int = 1, block_size: Optional[int] = None,
                      max_candidates: Optional[int] = None, scale_fmt: str = "fp32",
                      impl: str = "auto") -> None:
    """Top-k token ids for decode tokens over the paged pooled cache, into ``out``.

    ``q`` [B * next_n, H, 128] (Hadamard-rotated): request b's token i at position p =
    ``seq_lens[b] - next_n + i`` (token-granular lengths, this step included). Pool j is a
    candidate if j < (p + 1) // kpool and its block ``block_table[b, j // bs]`` (the pooled
    cache's pages) is in [0, num_blocks). Scores, order, expansion, tail and -1 padding as
    ``kpool_topk_prefill``. Scores ``block_table.shape[1] * bs`` pools (at most
    ``max_candidates``): no host sync.
    """
    bs = _validate_decode(q, weights, k_cache, seq_lens, block_table, out, kpool, next_n,
                          block_size, max_candidates, scale_fmt)
    _DECODE(q, weights, k_cache, seq_lens, block_table, kpool, next_n, out, bs, max_candidates,
            scale_fmt, impl=impl)


@kpool_topk_decode.register_fake
def _(q, weights, k_cache, seq_lens, block_table, out, kpool=DEFAULT_KPOOL, next_n=1,
      block_size=None, max_candidates=None, scale_fmt="fp32", impl="auto"):
    _validate_decode(q, weights, k_cache, seq_lens, block_table, out, kpool, next_n,
                     block_size, max_candidates, scale_fmt)


# ---------------------------------------------------------------------------------------------
# wrappers that allocate ``out``

def kpool_indexer_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, *,
                          topk=DEFAULT_TOPK, kpool=DEFAULT_KPOOL, chunk=0, max_seqlen_k=None,
                          out=None, impl="auto"):
    """``kpool_topk_prefill`` returning ``out`` [T, topk + kpool - 1] int32."""
    if out is None:
        out = torch.empty(q.shape[0], topk + kpool - 1, dtype=torch.int32, device=q.device)
    kpool_topk_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                       kpool, chunk, max_seqlen_k, impl)
    return out


def kpool_indexer_decode(q, weights, k_cache, seq_lens, block_table, *, topk=DEFAULT_TOPK,
                         kpool=DEFAULT_KPOOL, next_n=1, block_size=None, max_candidates=None,
                         scale_fmt="fp32", out=None, impl="auto"):
    """``kpool_topk_decode`` returning ``out`` [B * next_n, topk + kpool - 1] int32."""
    if out is None:
        out = torch.empty(q.shape[0], topk + kpool - 1, dtype=torch.int32, device=q.device)
    kpool_topk_decode(q, weights, k_cache, seq_lens, block_table, out, kpool, next_n,
                      block_size, max_candidates, scale_fmt, impl)
    return out
