"""DeepSeek-V4.1's two-level Lightning indexer (docs/semantics.md §11.6) as ``sparse_mla::``
custom ops.

Level 1 (the candidate source layer): the V4 indexer's top-k, plus each row's best candidate
blocks of ``candidate_block`` positions. Level 2 (the candidate users): the top-k among the
positions of the row's candidate blocks only. Arguments are ops/indexer's (§11.3); its checks
run first, then the candidate ones, all before anything is written.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import checks
from sparse_mla.ops.common.dispatch import implementations
from sparse_mla.ops.common.opdef import custom_op
from sparse_mla.ops.indexer import ops as v4
from sparse_mla.ops.indexer_v41 import reference, triton_impl, vendor

DEFAULT_TOPK = v4.DEFAULT_TOPK
DEFAULT_BLOCKS = 2048          # candidate_topk_blocks of V4.1-Flash
DEFAULT_CANDIDATE_BLOCK = 8    # candidate_block_size of V4.1-Flash


def _check_candidates(candidates, n, written):
    checks.expect_tensor("candidates", candidates, torch.int32, (n, None))
    if written and candidates.shape[1] < 1:
        raise ValueError("candidates must have at least one column (the number of candidate "
                         "blocks NB)")


def _check_level(ratio, candidate_block):
    checks.expect_int("ratio", ratio, 1)
    checks.expect_int("candidate_block", candidate_block, 1)


# ---------------------------------------------------------------------------------------------
# decode (paged cache)

_CAND_DECODE = implementations("indexer_v41_candidates_decode", vendor=vendor.ROUTE,
                               triton=triton_impl.candidates_decode,
                               reference=reference.candidates_decode)
_TOPK_DECODE = implementations("indexer_v41_topk_in_candidates_decode", vendor=vendor.ROUTE,
                               triton=triton_impl.topk_in_candidates_decode,
                               reference=reference.topk_in_candidates_decode)


def _validate_decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio, next_n,
                     block_size, candidate_block, max_candidates, written):
    _check_level(ratio, candidate_block)
    bs = v4._validate_decode(q, weights, k_cache, seq_lens, block_table, out, ratio, next_n,
                             block_size, max_candidates)
    _check_candidates(candidates, q.shape[0], written)
    checks.expect_same_device(q=q, candidates=candidates)
    return bs


@custom_op("sparse_mla::indexer_v41_candidates_decode", mutates_args=("out", "candidates"),
           caches=("k_cache",))
def indexer_v41_candidates_decode(q: Tensor, weights: Tensor, k_cache: Tensor, seq_lens: Tensor,
                                  block_table: Tensor, out: Tensor, candidates: Tensor,
                                  ratio: int, next_n: int = 1, block_size: Optional[int] = None,
                                  candidate_block: int = DEFAULT_CANDIDATE_BLOCK,
                                  max_candidates: Optional[int] = None,
                                  impl: str = "auto") -> None:
    """The candidate source layer's decode step: ``out`` [T, K] = ``indexer_topk_decode``'s
    top-K (same arguments), ``candidates`` [T, NB] = each row's NB best blocks of
    ``candidate_block`` positions (block c: positions c*cb .. c*cb + cb - 1), request-local,
    by block score (the max of its causal, readable logits, NaN first; the row's newest block
    +inf) then lower id; blocks without a logit and the columns left are -1."""
    bs = _validate_decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio,
                          next_n, block_size, candidate_block, max_candidates, True)
    _CAND_DECODE(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio, next_n, bs,
                 candidate_block, max_candidates, impl=impl)


@indexer_v41_candidates_decode.register_fake
def _(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio, next_n=1,
      block_size=None, candidate_block=DEFAULT_CANDIDATE_BLOCK, max_candidates=None,
      impl="auto"):
    _validate_decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio, next_n,
                     block_size, candidate_block, max_candidates, True)


@custom_op("sparse_mla::indexer_v41_topk_in_candidates_decode", mutates_args=("out",),
           caches=("k_cache",))
def indexer_v41_topk_in_candidates_decode(q: Tensor, weights: Tensor, k_cache: Tensor,
                                          seq_lens: Tensor, block_table: Tensor,
                                          candidates: Tensor, out: Tensor, ratio: int,
                                          next_n: int = 1, block_size: Optional[int] = None,
                                          candidate_block: int = DEFAULT_CANDIDATE_BLOCK,
                                          impl: str = "auto") -> None:
    """A candidate user's decode step: ``out`` [T, K] = the top-K (§11.4 order) among the
    positions of row t's ``candidates[t]`` blocks that are causal and readable; only those
    NB * candidate_block positions are scored. Candidate ids that are -1, repeated, past the
    causal range or unreadable add nothing."""
    bs = _validate_decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio,
                          next_n, block_size, candidate_block, None, False)
    _TOPK_DECODE(q, weights, k_cache, seq_lens, block_table, candidates, out, ratio, next_n, bs,
                 candidate_block, impl=impl)


@indexer_v41_topk_in_candidates_decode.register_fake
def _(q, weights, k_cache, seq_lens, block_table, candidates, out, ratio, next_n=1,
      block_size=None, candidate_block=DEFAULT_CANDIDATE_BLOCK, impl="auto"):
    _validate_decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio, next_n,
                     block_size, candidate_block, None, False)


# ---------------------------------------------------------------------------------------------
# prefill (dense keys per request)

_CAND_PREFILL = implementations("indexer_v41_candidates_prefill", vendor=vendor.ROUTE,
                                triton=triton_impl.candidates_prefill,
                                reference=reference.candidates_prefill)
_TOPK_PREFILL = implementations("indexer_v41_topk_in_candidates_prefill", vendor=vendor.ROUTE,
                                triton=triton_impl.topk_in_candidates_prefill,
                                reference=reference.topk_in_candidates_prefill)


def _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      candidates, ratio, candidate_block, chunk, max_seqlen_k, written):
    _check_level(ratio, candidate_block)
    v4._validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                         ratio, chunk, max_seqlen_k)
    _check_candidates(candidates, q.shape[0], written)
    checks.expect_same_device(q=q, candidates=candidates)


@custom_op("sparse_mla::indexer_v41_candidates_prefill", mutates_args=("out", "candidates"))
def indexer_v41_candidates_prefill(q: Tensor, weights: Tensor, k: Tensor,
                                   k_scale: Optional[Tensor], cu_seqlens_q: Tensor,
                                   cu_seqlens_k: Tensor, positions: Tensor, out: Tensor,
                                   candidates: Tensor, ratio: int,
                                   candidate_block: int = DEFAULT_CANDIDATE_BLOCK,
                                   chunk: int = 0, max_seqlen_k: Optional[int] = None,
                                   impl: str = "auto") -> None:
    """``indexer_v41_candidates_decode`` for a ragged prefill batch, arguments as
    ``indexer_topk_prefill``: ``out`` its top-K, ``candidates`` [T, NB] the best blocks of
    each token's causal range min(C_r, (p + 1) // ratio)."""
    _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      candidates, ratio, candidate_block, chunk, max_seqlen_k, True)
    _CAND_PREFILL(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                  candidates, ratio, candidate_block, chunk, max_seqlen_k, impl=impl)


@indexer_v41_candidates_prefill.register_fake
def _(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out, candidates, ratio,
      candidate_block=DEFAULT_CANDIDATE_BLOCK, chunk=0, max_seqlen_k=None, impl="auto"):
    _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      candidates, ratio, candidate_block, chunk, max_seqlen_k, True)


@custom_op("sparse_mla::indexer_v41_topk_in_candidates_prefill", mutates_args=("out",))
def indexer_v41_topk_in_candidates_prefill(q: Tensor, weights: Tensor, k: Tensor,
                                           k_scale: Optional[Tensor], cu_seqlens_q: Tensor,
                                           cu_seqlens_k: Tensor, positions: Tensor,
                                           candidates: Tensor, out: Tensor, ratio: int,
                                           candidate_block: int = DEFAULT_CANDIDATE_BLOCK,
                                           impl: str = "auto") -> None:
    """``indexer_v41_topk_in_candidates_decode`` for a ragged prefill batch, arguments as
    ``indexer_topk_prefill``."""
    _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      candidates, ratio, candidate_block, 0, None, False)
    _TOPK_PREFILL(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, candidates, out,
                  ratio, candidate_block, impl=impl)


@indexer_v41_topk_in_candidates_prefill.register_fake
def _(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, candidates, out, ratio,
      candidate_block=DEFAULT_CANDIDATE_BLOCK, impl="auto"):
    _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      candidates, ratio, candidate_block, 0, None, False)


# ---------------------------------------------------------------------------------------------
# wrappers that allocate ``out`` / ``candidates``

def _alloc(q, cols):
    return torch.empty(q.shape[0], cols, dtype=torch.int32, device=q.device)


def lightning_indexer_v41_candidates_decode(q, weights, k_cache, seq_lens, block_table, *, ratio,
                                            topk=DEFAULT_TOPK, blocks=DEFAULT_BLOCKS, next_n=1,
                                            block_size=None,
                                            candidate_block=DEFAULT_CANDIDATE_BLOCK,
                                            max_candidates=None, out=None, candidates=None,
                                            impl="auto"):
    """``indexer_v41_candidates_decode`` returning ``(out [T, topk], candidates [T, blocks])``
    (allocated unless given)."""
    out = _alloc(q, topk) if out is None else out
    candidates = _alloc(q, blocks) if candidates is None else candidates
    indexer_v41_candidates_decode(q, weights, k_cache, seq_lens, block_table, out, candidates,
                                  ratio, next_n, block_size, candidate_block, max_candidates,
                                  impl)
    return out, candidates


def lightning_indexer_v41_decode(q, weights, k_cache, seq_lens, block_table, candidates, *,
                                 ratio, topk=DEFAULT_TOPK, next_n=1, block_size=None,
                                 candidate_block=DEFAULT_CANDIDATE_BLOCK, out=None, impl="auto"):
    """``indexer_v41_topk_in_candidates_decode`` returning ``out`` [T, topk]."""
    out = _alloc(q, topk) if out is None else out
    indexer_v41_topk_in_candidates_decode(q, weights, k_cache, seq_lens, block_table, candidates,
                                          out, ratio, next_n, block_size, candidate_block, impl)
    return out


def lightning_indexer_v41_candidates_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k,
                                             positions, *, ratio, topk=DEFAULT_TOPK,
                                             blocks=DEFAULT_BLOCKS,
                                             candidate_block=DEFAULT_CANDIDATE_BLOCK, chunk=0,
                                             max_seqlen_k=None, out=None, candidates=None,
                                             impl="auto"):
    """``indexer_v41_candidates_prefill`` returning ``(out [T, topk], candidates [T,
    blocks])``."""
    out = _alloc(q, topk) if out is None else out
    candidates = _alloc(q, blocks) if candidates is None else candidates
    indexer_v41_candidates_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions,
                                   out, candidates, ratio, candidate_block, chunk, max_seqlen_k,
                                   impl)
    return out, candidates


def lightning_indexer_v41_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions,
                                  candidates, *, ratio, topk=DEFAULT_TOPK,
                                  candidate_block=DEFAULT_CANDIDATE_BLOCK, out=None, impl="auto"):
    """``indexer_v41_topk_in_candidates_prefill`` returning ``out`` [T, topk]."""
    out = _alloc(q, topk) if out is None else out
    indexer_v41_topk_in_candidates_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k,
                                           positions, candidates, out, ratio, candidate_block,
                                           impl)
    return out
