"""The Lightning-indexer ops (docs/semantics.md §11) as ``sparse_mla::`` custom ops.

Each op: validate (raises before anything is written) -> dispatch (vendor, Triton, reference)
-> implementation. The fake implementations validate too, so torch.compile traces fail with
the same messages.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import checks
from sparse_mla.ops.common.dispatch import implementations
from sparse_mla.ops.common.opdef import custom_op
from sparse_mla.ops.indexer import format as fmt
from sparse_mla.ops.indexer import reference, triton_impl, vendor

FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)
Q_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
W_DTYPES = (torch.float32, torch.bfloat16)
FP8_KEYS = (torch.float8_e4m3fn, torch.uint8)
DEFAULT_TOPK = 512


def _cache_block_size(k_cache, block_size):
    """The indexer cache's block size: bf16 ``[num_blocks, bs, 128]``, or fp8 pages in any
    view ``checks.paged_cache_block_size`` takes for the 132-byte format."""
    if k_cache.dtype == torch.bfloat16:
        checks.expect_tensor("k_cache", k_cache, torch.bfloat16, (None, None, fmt.DIM))
        if block_size is not None and block_size != k_cache.shape[1]:
            raise ValueError(f"block_size={block_size} does not match k_cache.shape[1]="
                             f"{k_cache.shape[1]}")
        return k_cache.shape[1]
    if k_cache.dtype not in checks.BYTE_DTYPES:
        raise TypeError(f"k_cache must be a bfloat16 cache [num_blocks, block_size, 128] or an "
                        f"fp8 indexer cache of bytes (uint8), got {k_cache.dtype}")
    return checks.paged_cache_block_size("k_cache", k_cache, fmt.FP8, block_size)


def _check_q_weights(q, weights, n=None):
    checks.expect_dtype("q", q, Q_DTYPES)
    if q.dim() != 3 or q.shape[2] != fmt.DIM or (n is not None and q.shape[0] != n):
        want = "num_tokens" if n is None else str(n)
        raise ValueError(f"q must have shape [{want}, num_heads, {fmt.DIM}], got "
                         f"{list(q.shape)}")
    if not 1 <= q.shape[1] <= fmt.MAX_HEADS:
        raise ValueError(f"q has {q.shape[1]} heads; expected 1..{fmt.MAX_HEADS}")
    checks.expect_last_dim_contiguous("q", q)
    checks.expect_tensor("weights", weights, W_DTYPES, (q.shape[0], q.shape[1]))


def _check_starts(name, cu, rows, of):
    """Request starts: 0 first, non-decreasing, within ``rows`` rows of ``of``; returns the
    requests' lengths."""
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    return checks.expect_query_starts(name, cu, "length", hi=rows, note=f" (rows of {of})")


def _check_out(out, n):
    checks.expect_tensor("out", out, torch.int32, (n, None))
    if out.shape[1] < 1:
        raise ValueError("out must have at least one column (the top-k width K)")


# ---------------------------------------------------------------------------------------------
# K insert (§11.1)

_INSERT = implementations("indexer_k_insert", vendor=vendor.ROUTE,
                          triton=triton_impl.k_insert, reference=reference.k_insert)


def _validate_insert(k, k_cache, slot_mapping, block_size):
    bs = _cache_block_size(k_cache, block_size)
    n = k.shape[0] if k.dim() == 2 else -1
    checks.expect_tensor("k", k, FLOAT_IN, (n, fmt.DIM))
    checks.expect_vector("slot_mapping", slot_mapping, checks.INDEX_DTYPES, at_most=n,
                         note=" (one per row of k)")
    checks.expect_same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    if checks.value_checks_enabled(slot_mapping, k):
        checks.expect_slots_in_range("slot_mapping", slot_mapping, k_cache.shape[0] * bs)
    return bs


@custom_op("sparse_mla::indexer_k_insert", mutates_args=("k_cache",))
def indexer_k_insert(k: Tensor, k_cache: Tensor, slot_mapping: Tensor,
                     block_size: Optional[int] = None, impl: str = "auto") -> None:
    """Write the indexer's compressed keys ``k`` [N, 128] at ``slot_mapping`` (-1 skips).

    fp8 cache (uint8; vLLM's ``[num_blocks, block_size, 132]`` view or ``[num_blocks, bytes]``
    with ``block_size``): per block ``[bs x 128 e4m3][bs x fp32 scale]``, scale
    2^ceil(log2(max(amax, 1e-4) / 448)) of the bf16-rounded row. bf16 cache
    ``[num_blocks, block_size, 128]``: the rows rounded to bf16.
    """
    bs = _validate_insert(k, k_cache, slot_mapping, block_size)
    _INSERT(k, k_cache, slot_mapping, bs, impl=impl)


@indexer_k_insert.register_fake
def _(k, k_cache, slot_mapping, block_size=None, impl="auto"):
    _validate_insert(k, k_cache, slot_mapping, block_size)


# ---------------------------------------------------------------------------------------------
# prefill scores + top-k (§11.2-11.4)

_PREFILL = implementations("indexer_topk_prefill", vendor=vendor.ROUTE,
                           triton=triton_impl.topk_prefill, reference=reference.topk_prefill)


def _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      ratio, chunk, max_seqlen_k):
    _check_q_weights(q, weights)
    n = q.shape[0]
    checks.expect_dtype("k", k, (torch.bfloat16,) + FP8_KEYS)
    checks.expect_tensor("k", k, k.dtype, (None, fmt.DIM))
    if k.dtype == torch.bfloat16:
        if k_scale is not None:
            raise ValueError("k_scale applies only to fp8 keys (k float8_e4m3fn or uint8)")
    else:
        if k_scale is None:
            raise ValueError("fp8 keys need k_scale: one fp32 scale per row of k")
        checks.expect_tensor("k_scale", k_scale, torch.float32, (k.shape[0],))
    checks.expect_vector("cu_seqlens_q", cu_seqlens_q, checks.INDEX_DTYPES, at_least=1)
    checks.expect_vector("cu_seqlens_k", cu_seqlens_k, checks.INDEX_DTYPES,
                         at_least=cu_seqlens_q.shape[0])
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k must have one entry per entry of cu_seqlens_q "
                         f"({cu_seqlens_q.shape[0]}), got {cu_seqlens_k.shape[0]}")
    checks.expect_vector("positions", positions, checks.INDEX_DTYPES, at_least=n,
                         note=" (one per token)")
    _check_out(out, n)
    checks.expect_int("ratio", ratio, 1)
    checks.expect_int("chunk", chunk, 0)
    if max_seqlen_k is not None:
        checks.expect_int("max_seqlen_k", max_seqlen_k, 0)
    checks.expect_same_device(q=q, weights=weights, k=k, k_scale=k_scale,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              positions=positions, out=out)
    if checks.value_checks_enabled(q, cu_seqlens_q, cu_seqlens_k, positions):
        _check_starts("cu_seqlens_q", cu_seqlens_q, n, "q")
        if int(cu_seqlens_q[-1]) != n:
            raise ValueError(f"cu_seqlens_q[-1] must be the number of tokens {n}, got "
                             f"{int(cu_seqlens_q[-1])}")
        lens = _check_starts("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")
        checks.expect_values_in("positions", positions[:n], 0, entry="token")
        if max_seqlen_k is not None and lens.numel() and int(lens.max()) > max_seqlen_k:
            raise ValueError(f"max_seqlen_k={max_seqlen_k} is less than the longest request's "
                             f"{int(lens.max())} entries")


@custom_op("sparse_mla::indexer_topk_prefill", mutates_args=("out",))
def indexer_topk_prefill(q: Tensor, weights: Tensor, k: Tensor, k_scale: Optional[Tensor],
                         cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, positions: Tensor,
                         out: Tensor, ratio: int = 4, chunk: int = 0,
                         max_seqlen_k: Optional[int] = None, impl: str = "auto") -> None:
    """The indexer's top-k for a ragged batch of prefill tokens, into ``out`` [T, K] int32.

    Request r owns tokens ``cu_seqlens_q[r]..cu_seqlens_q[r+1]`` of ``q`` [T, H, 128] (bf16
    or e4m3) and compressed keys ``cu_seqlens_k[r]..`` of ``k`` [Ck, 128] (bf16, or e4m3 with
    ``k_scale`` [Ck] fp32). Token t at ``positions[t]`` may select entry j < min(C_r,
    (p + 1) // ratio); its score is sum_h weights[t, h] * relu(q[t, h] . k[j]) (the model's
    scales folded into ``weights``). ``out[t]``: request-local ids, larger score first, equal
    scores by lower id, then -1. Tokens are scored ``chunk`` at a time (0: the route's size,
    a bounded buffer of int64 selection keys: 1 GiB on the reference, the Triton route's
    ``CONFIG["prefill_chunk_bytes"]``); pass ``max_seqlen_k`` to spare a sync.
    """
    _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      ratio, chunk, max_seqlen_k)
    _PREFILL(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, ratio, out, chunk,
             max_seqlen_k, impl=impl)


@indexer_topk_prefill.register_fake
def _(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out, ratio=4, chunk=0,
      max_seqlen_k=None, impl="auto"):
    _validate_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                      ratio, chunk, max_seqlen_k)


# ---------------------------------------------------------------------------------------------
# decode scores + top-k over the paged cache (§11.2-11.4)

_DECODE = implementations("indexer_topk_decode", vendor=vendor.ROUTE,
                          triton=triton_impl.topk_decode, reference=reference.topk_decode)


def _validate_decode(q, weights, k_cache, seq_lens, block_table, out, ratio, next_n,
                     block_size, max_candidates):
    bs = _cache_block_size(k_cache, block_size)
    checks.expect_int("ratio", ratio, 1)
    check_decode_inputs(q, weights, k_cache, seq_lens, block_table, out, next_n,
                        max_candidates, lambda: _check_out(out, q.shape[0]))
    return bs


def check_decode_inputs(q, weights, k_cache, seq_lens, block_table, out, next_n,
                        max_candidates, check_out) -> None:
    """The paged decode ops' shared checks (this family's and the kpool indexer's): q /
    weights, the ``[B * next_n]`` request grid, seq_lens, block table, devices and, where
    value checks run, the lengths; ``check_out()`` checks ``out`` for the family."""
    _check_q_weights(q, weights)
    checks.expect_int("next_n", next_n, 1)
    if q.shape[0] % next_n:
        raise ValueError(f"q has {q.shape[0]} tokens, not a multiple of next_n={next_n} "
                         f"(each request decodes next_n tokens)")
    batch = q.shape[0] // next_n
    checks.expect_vector("seq_lens", seq_lens, checks.INDEX_DTYPES, at_least=batch,
                         note=" (one per request)")
    checks.expect_block_table("block_table", block_table, min_rows=batch)
    check_out()
    if max_candidates is not None:
        checks.expect_int("max_candidates", max_candidates, 0)
    checks.expect_same_device(q=q, weights=weights, k_cache=k_cache, seq_lens=seq_lens,
                              block_table=block_table, out=out)
    if checks.value_checks_enabled(q, seq_lens):
        checks.expect_values_in("seq_lens", seq_lens[:batch], 0, entry="request")


@custom_op("sparse_mla::indexer_topk_decode", mutates_args=("out",), caches=("k_cache",))
def indexer_topk_decode(q: Tensor, weights: Tensor, k_cache: Tensor, seq_lens: Tensor,
                        block_table: Tensor, out: Tensor, ratio: int = 4, next_n: int = 1,
                        block_size: Optional[int] = None, max_candidates: Optional[int] = None,
                        impl: str = "auto") -> None:
    """The indexer's top-k for decode tokens over the paged indexer cache, into ``out``.

    ``q`` [B * next_n, H, 128]: request b's tokens b*next_n.. (next_n > 1 for MTP), token i at
    position ``seq_lens[b] - next_n + i`` (``seq_lens`` counts tokens, this step's included).
    It may select entry j < (p + 1) // ratio whose block ``block_table[b, j // bs]`` is in
    [0, num_blocks); scores, order and -1 padding as ``indexer_topk_prefill``. Scores
    ``block_table.shape[1] * bs`` columns (at most ``max_candidates``): no host sync, graph
    safe.
    """
    bs = _validate_decode(q, weights, k_cache, seq_lens, block_table, out, ratio, next_n,
                          block_size, max_candidates)
    _DECODE(q, weights, k_cache, seq_lens, block_table, ratio, next_n, out, bs, max_candidates,
            impl=impl)


@indexer_topk_decode.register_fake
def _(q, weights, k_cache, seq_lens, block_table, out, ratio=4, next_n=1, block_size=None,
      max_candidates=None, impl="auto"):
    _validate_decode(q, weights, k_cache, seq_lens, block_table, out, ratio, next_n,
                     block_size, max_candidates)


# ---------------------------------------------------------------------------------------------
# wrappers that allocate ``out``

def lightning_indexer_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, *,
                              topk=DEFAULT_TOPK, ratio=4, chunk=0, max_seqlen_k=None, out=None,
                              impl="auto"):
    """``indexer_topk_prefill`` returning ``out`` [T, topk] int32 (allocated unless given)."""
    if out is None:
        out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    indexer_topk_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                         ratio, chunk, max_seqlen_k, impl)
    return out


def lightning_indexer_decode(q, weights, k_cache, seq_lens, block_table, *, topk=DEFAULT_TOPK,
                             ratio=4, next_n=1, block_size=None, max_candidates=None, out=None,
                             impl="auto"):
    """``indexer_topk_decode`` returning ``out`` [B * next_n, topk] int32."""
    if out is None:
        out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    indexer_topk_decode(q, weights, k_cache, seq_lens, block_table, out, ratio, next_n,
                        block_size, max_candidates, impl)
    return out
