"""The index ops (docs/semantics.md §4) as ``sparse_mla::`` custom ops.

Each op: validate (raises before anything is written) → dispatch (triton or reference; no
vendor package ships these metadata kernels) → implementation. Every op writes into
caller-provided int32 output buffers (persistent, stable addresses: CUDA-graph friendly) and
writes every element of them, so they need no pre-fill. Sizes that would need a host sync
arrive as Python ints or as tensor shapes. Fake implementations run the same validation.

Validation has two levels (ops/common/checks.py): dtype/shape/layout checks always; value
checks (e.g. ``query_len > seq_len``, a block table too short for a position) only for CPU
tensors or with ``SPARSE_MLA_CHECK_VALUES=1``. Without value checks the Triton kernels still
never read or write out of bounds: entries whose request id, block index or position would
leave a table come out as -1 (see each op's docstring for what else is clamped); the
reference computes the same values, so the two agree on any input.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import checks
from sparse_mla.ops.common.dispatch import implementations
from sparse_mla.ops.common.opdef import custom_op
from sparse_mla.ops.index_combine import reference, triton_impl, vendor

I32 = torch.int32
C128A_ALIGNMENT = 128        # FlashMLA decode needs extra_topk % 64 == 0; vLLM pads to 128
PREFILL_ALIGNMENT = 128      # FlashMLA sparse prefill needs topk % 128 == 0 (SM90)
TRTLLM_ALIGNMENT = 4         # TRTLLM-gen loads index rows with 16-byte cp.async


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# argument forms shared by several ops (the checks themselves: ops/common/checks.py)

def _index_matrix(name, t):
    """An int32 ``[num_tokens, topk]`` index matrix (last dim contiguous); returns its shape."""
    checks.expect_dtype(name, t, I32)
    if t.dim() != 2:
        raise ValueError(f"{name} must have shape [num_tokens, topk], got {list(t.shape)}")
    checks.expect_last_dim_contiguous(name, t)
    return t.shape


def _qsl_seq(query_start_loc, seq_lens):
    """``seq_lens`` [R] and ``query_start_loc`` [R + 1]; returns R."""
    checks.expect_vector("seq_lens", seq_lens, I32)
    R = seq_lens.shape[0]
    checks.expect_dtype("query_start_loc", query_start_loc, I32)
    checks.expect_shape("query_start_loc", query_start_loc, (R + 1,))
    return R


def _check_requests(query_start_loc, seq_lens, rebase):
    """Values: query_start_loc non-decreasing (and >= 0 unless ``rebase``); 0 <= query_len <=
    seq_len for every request."""
    ql = checks.expect_query_starts("query_start_loc", query_start_loc,
                                    lo=None if rebase else 0)
    checks.expect_values_in("seq_lens", seq_lens, 0, entry="request")
    checks.expect_seq_lens_cover(seq_lens, ql)


# ---------------------------------------------------------------------------------------------
# §4.1 compute_global_topk_indices_and_lens

_GLOBAL_TOPK = implementations("global_topk_indices_and_lens", vendor=vendor.ROUTE,
                               triton=triton_impl.global_topk_indices_and_lens,
                               reference=reference.global_topk_indices_and_lens)


def _validate_global_topk(topk_indices, token_to_req_indices, block_table, is_valid_token,
                          out_indices, out_lens, block_size):
    T, K = _index_matrix("topk_indices", topk_indices)
    checks.expect_vector("token_to_req_indices", token_to_req_indices, I32, at_least=T)
    checks.expect_vector("is_valid_token", is_valid_token, torch.bool, at_least=T)
    checks.expect_block_table("block_table", block_table)
    checks.expect_int("block_size", block_size, 1)
    checks.expect_tensor("out_indices", out_indices, I32, (T, K))
    checks.expect_tensor("out_lens", out_lens, I32, (T,))
    checks.expect_same_device(topk_indices=topk_indices, token_to_req_indices=token_to_req_indices,
                              block_table=block_table, is_valid_token=is_valid_token,
                              out_indices=out_indices, out_lens=out_lens)
    if checks.value_checks_enabled(topk_indices, out_indices):
        valid = is_valid_token[:T].nonzero().flatten()
        req = token_to_req_indices[:T].long()[valid]
        R = block_table.shape[0]
        checks.expect_request_ids("token_to_req_indices", valid, req, R)
        if K and valid.numel():
            last = topk_indices[valid].long().max(1).values
            checks.expect_table_covers("block_table", block_table, req, last, block_size,
                                       "top-k index")


@custom_op("sparse_mla::global_topk_indices_and_lens",
           mutates_args=("out_indices", "out_lens"))
def global_topk_indices_and_lens(topk_indices: Tensor, token_to_req_indices: Tensor,
                                 block_table: Tensor, is_valid_token: Tensor, out_indices: Tensor,
                                 out_lens: Tensor, block_size: int, impl: str = "auto") -> None:
    """docs/semantics.md §4.1 (vLLM ``compute_global_topk_indices_and_lens``): request-local top-k
    ids ``topk_indices`` [T, K] (-1 = padding) → global slots
    ``block_table[req, i // bs] * bs + i % bs`` in ``out_indices`` [T, K] and
    ``out_lens[t]`` = number of entries >= 0 (0 when ``is_valid_token[t]`` is False).

    Without value checks (CUDA): an entry whose block index is beyond ``block_table`` and every
    entry of a token whose request id is outside ``[0, R)`` becomes -1 and is not counted
    (vLLM would read outside the table). With value checks (CPU): such entries of valid tokens
    raise. The count is of all entries >= 0 wherever they sit; callers emit a left-aligned
    valid prefix (docs/semantics.md §4.1), as the attention kernels read the first ``lens`` columns.
    """
    _validate_global_topk(topk_indices, token_to_req_indices, block_table, is_valid_token,
                          out_indices, out_lens, block_size)
    _GLOBAL_TOPK(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token,
                 out_indices, out_lens, impl=impl)


@global_topk_indices_and_lens.register_fake
def _(topk_indices, token_to_req_indices, block_table, is_valid_token, out_indices, out_lens,
      block_size, impl="auto"):
    _validate_global_topk(topk_indices, token_to_req_indices, block_table, is_valid_token,
                          out_indices, out_lens, block_size)


def compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table,
                                         block_size, is_valid_token, *, out_indices=None,
                                         out_lens=None, impl="auto"):
    """vLLM-compatible wrapper; pass ``out_indices``/``out_lens`` (persistent) to avoid the
    allocation. Returns ``(global_indices, lens)``."""
    T, K = topk_indices.shape
    if out_indices is None:
        out_indices = torch.empty(T, K, dtype=I32, device=topk_indices.device)
    if out_lens is None:
        out_lens = torch.empty(T, dtype=I32, device=topk_indices.device)
    global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, is_valid_token,
                                 out_indices, out_lens, block_size, impl)
    return out_indices, out_lens


# ---------------------------------------------------------------------------------------------
# §4.1 V3.2 triton_convert_req_index_to_global_index

_CONVERT = implementations("convert_req_index_to_global", vendor=vendor.ROUTE,
                           triton=triton_impl.convert_req_index_to_global,
                           reference=reference.convert_req_index_to_global)


def _validate_convert(req_id, block_table, token_indices, out, valid_counts,
                      prefill_workspace_request_ids, prefill_workspace_starts, block_size,
                      block_stride_rows):
    T, K = _index_matrix("token_indices", token_indices)
    checks.expect_dtype("req_id", req_id, I32)
    checks.expect_shape("req_id", req_id, (T,))
    checks.expect_block_table("block_table", block_table)
    checks.expect_int("block_size", block_size, 1)
    if block_stride_rows is not None:
        checks.expect_int("block_stride_rows", block_stride_rows, block_size)
    checks.expect_tensor("out", out, I32, (T, K))
    if valid_counts is not None:
        checks.expect_tensor("valid_counts", valid_counts, I32, (T,))
    if (prefill_workspace_request_ids is None) != (prefill_workspace_starts is None):
        raise ValueError("prefill_workspace_request_ids and prefill_workspace_starts must be "
                         "given together")
    if prefill_workspace_request_ids is not None:
        checks.expect_dtype("prefill_workspace_request_ids", prefill_workspace_request_ids, I32)
        checks.expect_shape("prefill_workspace_request_ids", prefill_workspace_request_ids, (T,))
        checks.expect_vector("prefill_workspace_starts", prefill_workspace_starts, I32)
    checks.expect_same_device(req_id=req_id, block_table=block_table, token_indices=token_indices,
                              out=out, valid_counts=valid_counts,
                              prefill_workspace_request_ids=prefill_workspace_request_ids,
                              prefill_workspace_starts=prefill_workspace_starts)
    if checks.value_checks_enabled(token_indices, out):
        dec = torch.ones(T, dtype=torch.bool, device=req_id.device)
        if prefill_workspace_request_ids is not None:
            preq = prefill_workspace_request_ids.long()
            P = prefill_workspace_starts.shape[0]
            bad = (preq >= P).nonzero()
            if bad.numel():
                i = int(bad[0])
                raise ValueError(f"prefill_workspace_request_ids[{i}] = {int(preq[i])} but "
                                 f"prefill_workspace_starts has only {P} entries")
            dec = preq < 0
        rows = dec.nonzero().flatten()
        checks.expect_request_ids("req_id", rows, req_id.long()[rows], block_table.shape[0])


@custom_op("sparse_mla::convert_req_index_to_global",
           mutates_args=("out", "valid_counts"))
def convert_req_index_to_global(req_id: Tensor, block_table: Tensor, token_indices: Tensor,
                                out: Tensor, valid_counts: Optional[Tensor],
                                prefill_workspace_request_ids: Optional[Tensor],
                                prefill_workspace_starts: Optional[Tensor], block_size: int,
                                block_stride_rows: Optional[int] = None,
                                impl: str = "auto") -> None:
    """docs/semantics.md §4.1, V3.2 (vLLM ``triton_convert_req_index_to_global_index``), column for
    column: ``out[t, j] = block_table[req_id[t], tok // bs] * block_stride_rows + tok % bs`` with
    ``tok = token_indices[t, j]``; ``block_stride_rows`` (default ``block_size``) is the row
    distance between physical blocks of a packed pool. ``-1`` when ``tok < 0`` or its block
    index is beyond ``block_table`` (vLLM's documented "for safety" rule, so not an error).
    Prefill rows (``prefill_workspace_request_ids[t] >= 0``) map to
    ``prefill_workspace_starts[preq] + tok`` (a row of the gathered bf16 workspace); as in
    vLLM they also become -1 when ``tok // bs`` is beyond the block table.
    ``valid_counts[t]`` (optional) = number of entries that are not -1 (one program per row:
    no atomics, no zeroed buffer needed). ``NUM_TOPK_TOKENS % BLOCK_N`` is not required.
    Without value checks, a decode row whose ``req_id`` is outside ``[0, R)`` or a prefill row
    whose request id is ``>= len(prefill_workspace_starts)`` is all -1 (count 0).
    """
    _validate_convert(req_id, block_table, token_indices, out, valid_counts,
                      prefill_workspace_request_ids, prefill_workspace_starts, block_size,
                      block_stride_rows)
    _CONVERT(req_id, block_table, token_indices, out, valid_counts,
             prefill_workspace_request_ids, prefill_workspace_starts, block_size,
             block_size if block_stride_rows is None else block_stride_rows, impl=impl)


@convert_req_index_to_global.register_fake
def _(req_id, block_table, token_indices, out, valid_counts, prefill_workspace_request_ids,
      prefill_workspace_starts, block_size, block_stride_rows=None, impl="auto"):
    _validate_convert(req_id, block_table, token_indices, out, valid_counts,
                      prefill_workspace_request_ids, prefill_workspace_starts, block_size,
                      block_stride_rows)


def triton_convert_req_index_to_global_index(
        req_id, block_table, token_indices, BLOCK_SIZE=64, BLOCK_STRIDE_ROWS=None,
        NUM_TOPK_TOKENS=2048, BLOCK_N=128, HAS_PREFILL_WORKSPACE=False,
        prefill_workspace_request_ids=None, prefill_workspace_starts=None,
        return_valid_counts=False, *, out=None, valid_counts=None, impl="auto"):
    """vLLM-compatible wrapper (same argument names). ``BLOCK_N`` is accepted and ignored
    (tiling is internal). Returns ``out`` or ``(out, valid_counts)``."""
    if token_indices.dim() != 2 or token_indices.shape[1] != NUM_TOPK_TOKENS:
        raise ValueError(f"token_indices must have shape [num_tokens, NUM_TOPK_TOKENS="
                         f"{NUM_TOPK_TOKENS}], got {list(token_indices.shape)}")
    if not HAS_PREFILL_WORKSPACE:
        prefill_workspace_request_ids = prefill_workspace_starts = None
    elif prefill_workspace_request_ids is None or prefill_workspace_starts is None:
        raise ValueError("HAS_PREFILL_WORKSPACE needs prefill_workspace_request_ids and "
                         "prefill_workspace_starts")
    if out is None:
        out = torch.empty_like(token_indices, memory_format=torch.contiguous_format)
    if return_valid_counts and valid_counts is None:
        valid_counts = torch.empty(token_indices.shape[0], dtype=I32,
                                   device=token_indices.device)
    convert_req_index_to_global(req_id, block_table, token_indices, out,
                                valid_counts if return_valid_counts else None,
                                prefill_workspace_request_ids, prefill_workspace_starts,
                                BLOCK_SIZE, BLOCK_STRIDE_ROWS, impl)
    return (out, valid_counts) if return_valid_counts else out


# ---------------------------------------------------------------------------------------------
# §4.2 SWA window indices

_SWA = implementations("swa_indices_and_lens", vendor=vendor.ROUTE,
                       triton=triton_impl.swa_indices_and_lens,
                       reference=reference.swa_indices_and_lens)


def _validate_swa(query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
                  out_indices, out_lens, block_size, window_size, token_offset):
    R = _qsl_seq(query_start_loc, seq_lens)
    checks.expect_int("block_size", block_size, 1)
    checks.expect_int("window_size", window_size, 1)
    checks.expect_int("token_offset", token_offset, 0)
    checks.expect_dtype("out_lens", out_lens, I32)
    if out_lens.dim() != 1:
        raise ValueError(f"out_lens must be 1-D [num_tokens], got {list(out_lens.shape)}")
    T = out_lens.shape[0]
    checks.expect_dtype("out_indices", out_indices, I32)
    if out_indices.dim() == 3:
        checks.expect_shape("out_indices", out_indices, (T, 1, window_size))
    else:
        checks.expect_shape("out_indices", out_indices, (T, window_size))
    checks.expect_last_dim_contiguous("out_indices", out_indices)
    n_tokens = token_offset + T
    checks.expect_vector("token_to_req_indices", token_to_req_indices, I32, at_least=n_tokens)
    checks.expect_vector("is_valid_token", is_valid_token, torch.bool, at_least=n_tokens)
    checks.expect_block_table("block_table", block_table, R)
    checks.expect_same_device(query_start_loc=query_start_loc, seq_lens=seq_lens,
                              token_to_req_indices=token_to_req_indices,
                              is_valid_token=is_valid_token, block_table=block_table,
                              out_indices=out_indices, out_lens=out_lens)
    if checks.value_checks_enabled(seq_lens, out_lens):
        _check_requests(query_start_loc, seq_lens, rebase=False)
        t = torch.arange(token_offset, token_offset + T, device=out_lens.device)
        t = t[is_valid_token[t]]
        req = token_to_req_indices.long()[t]
        checks.expect_tokens_in_requests("token_to_req_indices", t, req, query_start_loc, R)
        pos = reference.token_positions(query_start_loc, seq_lens, req, t)
        checks.expect_table_covers("block_table", block_table, req, pos, block_size, "position")


@custom_op("sparse_mla::swa_indices_and_lens",
           mutates_args=("out_indices", "out_lens"))
def swa_indices_and_lens(query_start_loc: Tensor, seq_lens: Tensor, token_to_req_indices: Tensor,
                         is_valid_token: Tensor, block_table: Tensor, out_indices: Tensor,
                         out_lens: Tensor, block_size: int, window_size: int = 128,
                         token_offset: int = 0, impl: str = "auto") -> None:
    """docs/semantics.md §4.2 (vLLM ``_compute_swa_indices_and_lens_kernel``, newest form). Row
    ``i`` of ``out_indices`` ([T, W] or vLLM's [T, 1, W]) is batch token ``t = token_offset + i``
    (decode rows: offset 0; prefill rows: offset = num_decode_tokens; ``query_start_loc`` is
    absolute, not rebased). With ``pos = seq_len - query_len + (t - query_start)``: columns
    ``[0, min(pos+1, W))`` = SWA slots of positions ``max(pos-W+1, 0) ...  pos`` (oldest
    first) through ``block_table`` (block size ``block_size``, 64 in vLLM), the rest -1;
    ``out_lens[i] = min(pos+1, W)``. Graph-padding tokens (``is_valid_token`` False): length 0,
    row all -1.

    Without value checks (CUDA): a token whose request id is outside ``[0, R)`` is treated as
    padding; a negative ``pos`` gives length 0; a position beyond the block table gives a -1
    entry (its length still counts it). With value checks (CPU) these raise.
    """
    _validate_swa(query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
                  out_indices, out_lens, block_size, window_size, token_offset)
    _SWA(query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
         block_size, window_size, token_offset, out_indices, out_lens, impl=impl)


@swa_indices_and_lens.register_fake
def _(query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table, out_indices,
      out_lens, block_size, window_size=128, token_offset=0, impl="auto"):
    _validate_swa(query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
                  out_indices, out_lens, block_size, window_size, token_offset)


# ---------------------------------------------------------------------------------------------
# §4.3 C128A indices

_C128A = implementations("c128a_indices_and_lens", vendor=vendor.ROUTE,
                         triton=triton_impl.c128a_indices_and_lens,
                         reference=reference.c128a_indices_and_lens)


def c128a_width(max_model_len: int, compress_ratio: int = 128) -> int:
    """vLLM's C128A buffer width: ``round_up(cdiv(max_model_len, ratio), 128)``."""
    return round_up(-(-max_model_len // compress_ratio), C128A_ALIGNMENT)


def _validate_c128a(positions, slot_mapping, token_to_req_indices, block_table, out_decode,
                    out_decode_lens, out_prefill, block_size, compress_ratio):
    checks.expect_int("block_size", block_size, 1)
    checks.expect_int("compress_ratio", compress_ratio, 1)
    checks.expect_dtype("out_decode", out_decode, I32)
    if out_decode.dim() != 2:
        raise ValueError(f"out_decode must have shape [num_decode_tokens, width], "
                         f"got {list(out_decode.shape)}")
    Td, width = out_decode.shape
    if width % C128A_ALIGNMENT:
        raise ValueError(f"out_decode width must be a multiple of {C128A_ALIGNMENT} "
                         f"(round_up(cdiv(max_model_len, ratio), 128), see c128a_width), "
                         f"got {width}")
    checks.expect_last_dim_contiguous("out_decode", out_decode)
    checks.expect_tensor("out_decode_lens", out_decode_lens, I32, (Td,))
    checks.expect_dtype("out_prefill", out_prefill, I32)
    if out_prefill.dim() != 2 or out_prefill.shape[1] != width:
        raise ValueError(f"out_prefill must have shape [num_prefill_tokens, {width}] (the "
                         f"width of out_decode), got {list(out_prefill.shape)}")
    checks.expect_last_dim_contiguous("out_prefill", out_prefill)
    T = Td + out_prefill.shape[0]
    checks.expect_vector("positions", positions, checks.INDEX_DTYPES, at_least=T)
    checks.expect_vector("slot_mapping", slot_mapping, checks.INDEX_DTYPES, at_least=Td)
    checks.expect_vector("token_to_req_indices", token_to_req_indices, I32, at_least=Td)
    checks.expect_block_table("block_table", block_table)
    checks.expect_same_device(positions=positions, slot_mapping=slot_mapping,
                              token_to_req_indices=token_to_req_indices, block_table=block_table,
                              out_decode=out_decode, out_decode_lens=out_decode_lens,
                              out_prefill=out_prefill)
    if checks.value_checks_enabled(positions, out_decode):
        pos = positions[:T].long()
        checks.expect_values_in("positions", pos, 0, entry="token")
        valid = (slot_mapping[:Td] >= 0).nonzero().flatten()
        req = token_to_req_indices[:Td].long()[valid]
        R = block_table.shape[0]
        checks.expect_request_ids("token_to_req_indices", valid, req, R)
        n = torch.clamp((pos[valid] + 1) // compress_ratio, max=width)
        checks.expect_table_covers("block_table", block_table, req, n - 1, block_size,
                                   "compressed entry")


@custom_op("sparse_mla::c128a_indices_and_lens",
           mutates_args=("out_decode", "out_decode_lens", "out_prefill"))
def c128a_indices_and_lens(positions: Tensor, slot_mapping: Tensor, token_to_req_indices: Tensor,
                           block_table: Tensor, out_decode: Tensor, out_decode_lens: Tensor,
                           out_prefill: Tensor, block_size: int, compress_ratio: int = 128,
                           impl: str = "auto") -> None:
    """docs/semantics.md §4.3 (vLLM ``build_c128a_topk_metadata``), one launch for decode and
    prefill tokens (decodes first: token ``t < Td = out_decode.shape[0]`` is a decode token, token
    ``Td + i`` is prefill row ``i``). ``n = min((pos+1) // ratio, width)`` with ``width =
    out_decode.shape[1]`` (a multiple of 128, see :func:`c128a_width`).
    Decode rows: global slots of compressed entries ``0 .. n-1`` through ``block_table``
    (block size ``256 // ratio = 2`` in vLLM), then -1; ``out_decode_lens = n``.
    Prefill rows: request-local ids ``[0, 1, ..., n-1, -1, ...]``.

    Choice: a graph-padding decode token (``slot_mapping < 0``) gets length 0 **and** an
    all -1 row (vLLM still writes slots for it, through whatever request id the padding
    carries; the attention result is the same because the length is 0, and no table read
    happens for garbage request ids). Without value checks (CUDA): a negative position gives
    n = 0; a request id outside ``[0, R)`` or an entry beyond the block table gives -1 entries
    (the length is still n). With value checks (CPU) these raise.
    """
    _validate_c128a(positions, slot_mapping, token_to_req_indices, block_table, out_decode,
                    out_decode_lens, out_prefill, block_size, compress_ratio)
    _C128A(positions, slot_mapping, token_to_req_indices, block_table, block_size,
           compress_ratio, out_decode, out_decode_lens, out_prefill, impl=impl)


@c128a_indices_and_lens.register_fake
def _(positions, slot_mapping, token_to_req_indices, block_table, out_decode, out_decode_lens,
      out_prefill, block_size, compress_ratio=128, impl="auto"):
    _validate_c128a(positions, slot_mapping, token_to_req_indices, block_table, out_decode,
                    out_decode_lens, out_prefill, block_size, compress_ratio)


# ---------------------------------------------------------------------------------------------
# §4.4 combine_topk_swa_indices

_COMBINE = implementations("combine_topk_swa_indices", vendor=vendor.ROUTE,
                           triton=triton_impl.combine_topk_swa_indices,
                           reference=reference.combine_topk_swa_indices)


def combined_width(topk: int, window_size: int) -> int:
    return round_up(topk + window_size, PREFILL_ALIGNMENT)


def _validate_combine(topk_indices, query_start_loc, seq_lens, gather_lens, out_indices,
                      out_lens, window_size, compress_ratio, topk, M, N):
    R = _qsl_seq(query_start_loc, seq_lens)
    checks.expect_tensor("gather_lens", gather_lens, I32, (R,))
    for name, v, lo in (("window_size", window_size, 1), ("compress_ratio", compress_ratio, 1),
                        ("topk", topk, 0), ("N", N, 0)):
        checks.expect_int(name, v, lo)
    checks.expect_int("M", M, max(N, 1))
    if R * M >= 2 ** 31:
        raise ValueError(f"num_reqs * M = {R * M} does not fit int32 workspace row ids")
    checks.expect_dtype("out_lens", out_lens, I32)
    if out_lens.dim() != 1:
        raise ValueError(f"out_lens must be 1-D [num_tokens], got {list(out_lens.shape)}")
    T = out_lens.shape[0]
    checks.expect_tensor("out_indices", out_indices, I32, (T, combined_width(topk, window_size)))
    checks.expect_dtype("topk_indices", topk_indices, I32)
    if topk_indices.dim() != 2 or topk_indices.shape[0] != T:
        raise ValueError(f"topk_indices must have shape [{T}, *] (one row per token), "
                         f"got {list(topk_indices.shape)}")
    checks.expect_last_dim_contiguous("topk_indices", topk_indices)
    checks.expect_same_device(topk_indices=topk_indices, query_start_loc=query_start_loc,
                              seq_lens=seq_lens, gather_lens=gather_lens,
                              out_indices=out_indices, out_lens=out_lens)
    if checks.value_checks_enabled(seq_lens, out_lens):
        _check_requests(query_start_loc, seq_lens, rebase=True)
        qsl = query_start_loc.long() - query_start_loc[0].long()
        if R and int(qsl[-1]) > T:
            raise ValueError(f"query_start_loc spans {int(qsl[-1])} tokens but the output has "
                             f"{T} rows")
        ql, sl, gl = qsl[1:] - qsl[:-1], seq_lens.long(), gather_lens.long()
        need = ql + torch.clamp(sl - ql, max=window_size - 1)
        bad = ((gl < need) | (gl > sl)).nonzero()
        if bad.numel():
            r = int(bad[0])
            raise ValueError(f"gather_lens[{r}] = {int(gl[r])} must be in [query_len + "
                             f"min(prefix_len, W-1), seq_len] = [{int(need[r])}, {int(sl[r])}]")
        bad = (N + gl > M).nonzero()
        if bad.numel():
            r = int(bad[0])
            raise ValueError(f"N + gather_lens[{r}] = {N + int(gl[r])} exceeds the workspace "
                             f"rows per request M = {M}")
        if topk and R and int(qsl[-1]):
            t = torch.arange(int(qsl[-1]), device=qsl.device)
            req = torch.searchsorted(qsl[1:], t, right=True)
            pos = sl[req] - ql[req] + (t - qsl[req])
            tl_ = torch.clamp((pos + 1) // compress_ratio, max=topk)
            Kt = topk_indices.shape[1]
            if Kt:
                j = torch.arange(Kt, device=qsl.device)
                idx = topk_indices[:int(qsl[-1])].long()
                bad = ((j < tl_.unsqueeze(1)) & (idx >= N)).nonzero()
                if bad.numel():
                    i, c = int(bad[0, 0]), int(bad[0, 1])
                    raise ValueError(f"topk_indices[{i}, {c}] = {int(idx[i, c])} is not a "
                                     f"compressed row of the workspace (N = {N}); prefill "
                                     f"top-k ids must be request-local")


@custom_op("sparse_mla::combine_topk_swa_indices",
           mutates_args=("out_indices", "out_lens"))
def combine_topk_swa_indices(topk_indices: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                             gather_lens: Tensor, out_indices: Tensor, out_lens: Tensor,
                             window_size: int, compress_ratio: int, topk: int, M: int, N: int,
                             impl: str = "auto") -> None:
    """docs/semantics.md §4.4 (vLLM ``combine_topk_swa_indices``, FlashMLA prefill). Indices into
    the gathered bf16 workspace viewed as ``[num_reqs * M, 1, 512]``: request b owns rows
    ``[b*M, b*M + M)``, compressed entries at ``b*M + idx`` (``idx < N``) and SWA positions
    ``[seq_len - gather_len, seq_len)`` at ``b*M + N + ...``. ``query_start_loc`` is rebased by
    its first element; token ``t`` of the chunk is row ``t``. Per token: ``topk_len =
    min((pos+1)//ratio, topk)`` (topk = 0 for SWA-only layers), ``swa_len = min(pos+1, W)``;
    columns ``[0, topk_len)``: ``b*M + topk_indices[t, j]``; then ``swa_len`` window rows
    oldest first; every other column (up to ``round_up(topk + W, 128)``) is -1;
    ``out_lens = topk_len + swa_len``.

    Choices (docs/semantics.md §4.4 *(vX)*): a top-k id outside ``[0, N)`` in the active columns
    becomes -1 (newest vLLM guard; still counted in the length, as in vLLM), and columns beyond
    ``topk_indices.shape[1]`` read as -1. Rows beyond the last request's tokens (padding) get
    length 0 and all -1. With value checks (CPU) a top-k id >= N, a gather_len that does not
    cover the window, ``N + gather_len > M`` and ``query_len > seq_len`` raise; without them
    the kernel computes the same integers and never touches memory outside its inputs.
    """
    _validate_combine(topk_indices, query_start_loc, seq_lens, gather_lens, out_indices,
                      out_lens, window_size, compress_ratio, topk, M, N)
    _COMBINE(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
             topk, M, N, out_indices, out_lens, impl=impl)


@combine_topk_swa_indices.register_fake
def _(topk_indices, query_start_loc, seq_lens, gather_lens, out_indices, out_lens, window_size,
      compress_ratio, topk, M, N, impl="auto"):
    _validate_combine(topk_indices, query_start_loc, seq_lens, gather_lens, out_indices,
                      out_lens, window_size, compress_ratio, topk, M, N)


# ---------------------------------------------------------------------------------------------
# §4.5 build_flashinfer_mixed_sparse_indices

_MIXED = implementations("flashinfer_mixed_sparse_indices", vendor=vendor.ROUTE,
                         triton=triton_impl.flashinfer_mixed_sparse_indices,
                         reference=reference.flashinfer_mixed_sparse_indices)


def mixed_width(window_size: int, topk: int, decode_topk: int = 0) -> int:
    return window_size + round_up(max(topk, decode_topk), TRTLLM_ALIGNMENT)


def _validate_mixed(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                    prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices,
                    swa_block_table, compressed_block_table, decode_is_valid_token, out_indices,
                    out_lens, swa_block_size, compressed_block_size, window_size, compress_ratio,
                    topk, decode_compressed_indices_are_local, swa_block_span,
                    compressed_block_span):
    for name, v, lo in (("swa_block_size", swa_block_size, 1),
                        ("compressed_block_size", compressed_block_size, 1),
                        ("window_size", window_size, 1), ("compress_ratio", compress_ratio, 1),
                        ("topk", topk, 0)):
        checks.expect_int(name, v, lo)
    if swa_block_span is not None:
        checks.expect_int("swa_block_span", swa_block_span, swa_block_size)
    if compressed_block_span is not None:
        checks.expect_int("compressed_block_span", compressed_block_span, compressed_block_size)
    W = window_size
    R = _qsl_seq(query_start_loc, seq_lens)
    checks.expect_dtype("decode_swa_indices", decode_swa_indices, I32)
    if decode_swa_indices.dim() != 2 or decode_swa_indices.shape[1] != W:
        raise ValueError(f"decode_swa_indices must have shape [num_decode_tokens, {W}], "
                         f"got {list(decode_swa_indices.shape)}")
    checks.expect_last_dim_contiguous("decode_swa_indices", decode_swa_indices)
    Td = decode_swa_indices.shape[0]
    checks.expect_dtype("prefill_topk_indices", prefill_topk_indices, I32)
    if prefill_topk_indices.dim() != 2:
        raise ValueError(f"prefill_topk_indices must have shape [num_prefill_tokens, *], "
                         f"got {list(prefill_topk_indices.shape)}")
    checks.expect_last_dim_contiguous("prefill_topk_indices", prefill_topk_indices)
    Tp = prefill_topk_indices.shape[0]
    Kd = 0
    if decode_compressed_indices is not None:
        checks.expect_tensor("decode_compressed_indices", decode_compressed_indices, I32,
                             (Td, None))
        Kd = decode_compressed_indices.shape[1]
    if decode_compressed_topk_lens is not None:
        checks.expect_vector("decode_compressed_topk_lens", decode_compressed_topk_lens, I32,
                             at_least=Td)
    if Kd and decode_compressed_indices_are_local:
        if decode_is_valid_token is None:
            raise ValueError("decode_is_valid_token is required when "
                             "decode_compressed_indices_are_local")
        checks.expect_vector("decode_is_valid_token", decode_is_valid_token, torch.bool,
                             at_least=Td)
    elif decode_is_valid_token is not None:
        checks.expect_vector("decode_is_valid_token", decode_is_valid_token, torch.bool)
    checks.expect_vector("token_to_req_indices", token_to_req_indices, I32, at_least=Td + Tp)
    checks.expect_block_table("swa_block_table", swa_block_table, R)
    if compressed_block_table is not None:
        checks.expect_block_table("compressed_block_table", compressed_block_table, R)
    checks.expect_tensor("out_indices", out_indices, I32, (Td + Tp, mixed_width(W, topk, Kd)))
    checks.expect_tensor("out_lens", out_lens, I32, (Td + Tp,))
    checks.expect_same_device(
        decode_swa_indices=decode_swa_indices, decode_compressed_indices=decode_compressed_indices,
        decode_compressed_topk_lens=decode_compressed_topk_lens,
        prefill_topk_indices=prefill_topk_indices, query_start_loc=query_start_loc,
        seq_lens=seq_lens, token_to_req_indices=token_to_req_indices,
        swa_block_table=swa_block_table, compressed_block_table=compressed_block_table,
        decode_is_valid_token=decode_is_valid_token, out_indices=out_indices, out_lens=out_lens)
    if checks.value_checks_enabled(seq_lens, out_lens):
        cbt = swa_block_table if compressed_block_table is None else compressed_block_table
        _check_requests(query_start_loc, seq_lens, rebase=False)
        if Kd and decode_compressed_indices_are_local:
            valid = decode_is_valid_token[:Td].nonzero().flatten()
            req = token_to_req_indices[:Td].long()[valid]
            checks.expect_request_ids("token_to_req_indices", valid, req, R)
            if valid.numel():
                last = decode_compressed_indices[valid].long().max(1).values
                checks.expect_table_covers("compressed_block_table", cbt, req, last,
                                           compressed_block_size, "compressed index")
        t = torch.arange(Td, Td + Tp, device=out_lens.device)
        req = token_to_req_indices.long()[t]
        checks.expect_tokens_in_requests("token_to_req_indices", t, req, query_start_loc, R)
        if Tp:
            pos = reference.token_positions(query_start_loc, seq_lens, req, t)
            checks.expect_table_covers("swa_block_table", swa_block_table, req, pos,
                                       swa_block_size, "position")
            tk = torch.clamp((pos + 1) // compress_ratio, max=topk)
            Kp = prefill_topk_indices.shape[1]
            if Kp:
                j = torch.arange(Kp, device=t.device)
                loc = torch.where(j < tk.unsqueeze(1), prefill_topk_indices.long(), -1)
                checks.expect_table_covers("compressed_block_table", cbt, req,
                                           loc.max(1).values, compressed_block_size,
                                           "compressed index")


@custom_op("sparse_mla::flashinfer_mixed_sparse_indices",
           mutates_args=("out_indices", "out_lens"))
def flashinfer_mixed_sparse_indices(
        decode_swa_indices: Tensor, decode_compressed_indices: Optional[Tensor],
        decode_compressed_topk_lens: Optional[Tensor], prefill_topk_indices: Tensor,
        query_start_loc: Tensor, seq_lens: Tensor, token_to_req_indices: Tensor,
        swa_block_table: Tensor, compressed_block_table: Optional[Tensor],
        decode_is_valid_token: Optional[Tensor], out_indices: Tensor, out_lens: Tensor,
        swa_block_size: int, compressed_block_size: int, window_size: int, compress_ratio: int,
        topk: int, decode_compressed_indices_are_local: bool = False,
        swa_block_span: Optional[int] = None, compressed_block_span: Optional[int] = None,
        impl: str = "auto") -> None:
    """docs/semantics.md §4.5 (vLLM ``build_flashinfer_mixed_sparse_indices``), decode rows and
    prefill rows in ONE launch. Rows: ``Td = decode_swa_indices.shape[0]`` decode tokens, then
    ``Tp = prefill_topk_indices.shape[0]`` prefill tokens (batch token ``t`` = row ``t``;
    ``query_start_loc`` absolute). Width ``W + round_up(max(topk, Kd), 4)`` (:func:`mixed_width`):
    columns ``[0, W)`` index the SWA pool, the rest the compressed pool.
    Decode: SWA columns copied; compressed columns = ``decode_compressed_indices`` (-1 beyond
    Kd), converted through ``compressed_block_table`` when ``..._are_local`` (C4A; length =
    #converted entries, 0 for ``!decode_is_valid_token``), else taken as global (C128A; length
    ``decode_compressed_topk_lens[t]`` or Kd). Prefill: window from the position via
    ``swa_block_table`` (-1 beyond ``min(pos+1, W)``); compressed ``j < min((pos+1)//ratio,
    topk)`` converted through ``compressed_block_table`` (defaults to the SWA table, as vLLM),
    else -1. Lengths always count all W window columns: ``W + compressed_len``. Packed pools
    (``*_block_span != *_block_size``): every valid slot ``s`` becomes
    ``(s // bs) * span + s % bs`` (fused; vLLM does it as a second pass).

    Without value checks (CUDA): request ids outside ``[0, R)`` and entries beyond a block table
    give -1 (a local decode entry that becomes -1 is not counted; prefill lengths are
    position-based and unchanged). With value checks (CPU) these raise.
    """
    _validate_mixed(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                    prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices,
                    swa_block_table, compressed_block_table, decode_is_valid_token, out_indices,
                    out_lens, swa_block_size, compressed_block_size, window_size, compress_ratio,
                    topk, decode_compressed_indices_are_local, swa_block_span,
                    compressed_block_span)
    _MIXED(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
           prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices,
           swa_block_table, swa_block_size, compressed_block_table, compressed_block_size,
           window_size, compress_ratio, topk, decode_compressed_indices_are_local,
           decode_is_valid_token, swa_block_span, compressed_block_span, out_indices, out_lens,
           impl=impl)


@flashinfer_mixed_sparse_indices.register_fake
def _(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
      prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
      compressed_block_table, decode_is_valid_token, out_indices, out_lens, swa_block_size,
      compressed_block_size, window_size, compress_ratio, topk,
      decode_compressed_indices_are_local=False, swa_block_span=None,
      compressed_block_span=None, impl="auto"):
    _validate_mixed(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                    prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices,
                    swa_block_table, compressed_block_table, decode_is_valid_token, out_indices,
                    out_lens, swa_block_size, compressed_block_size, window_size, compress_ratio,
                    topk, decode_compressed_indices_are_local, swa_block_span,
                    compressed_block_span)


def build_flashinfer_mixed_sparse_indices(
        decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
        prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
        swa_block_size, compressed_block_table, compressed_block_size, window_size,
        compress_ratio, topk, decode_compressed_indices_are_local=False,
        decode_is_valid_token=None, swa_block_span=None, compressed_block_span=None, *,
        out_indices=None, out_lens=None, impl="auto"):
    """vLLM-compatible wrapper (same positional order). Returns ``(sparse_indices, lens)``."""
    Kd = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
    T = decode_swa_indices.shape[0] + prefill_topk_indices.shape[0]
    dev = decode_swa_indices.device
    if out_indices is None:
        out_indices = torch.empty(T, mixed_width(window_size, topk, Kd), dtype=I32, device=dev)
    if out_lens is None:
        out_lens = torch.empty(T, dtype=I32, device=dev)
    flashinfer_mixed_sparse_indices(
        decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
        prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
        compressed_block_table, decode_is_valid_token, out_indices, out_lens, swa_block_size,
        compressed_block_size, window_size, compress_ratio, topk,
        decode_compressed_indices_are_local, swa_block_span, compressed_block_span, impl)
    return out_indices, out_lens
