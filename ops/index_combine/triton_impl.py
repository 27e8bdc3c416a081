"""The index-combine ops' Triton implementations: launchers of the kernels in
triton_kernels.py with the ops' signatures. ops.py validates the arguments before these run;
each launcher writes every element of its output buffers (the kernels' rules)."""
from __future__ import annotations

import triton

from sparse_mla.ops.index_combine.triton_kernels import (c128a_kernel, combine_kernel,
                                                         convert_kernel, global_topk_kernel,
                                                         mixed_kernel, swa_kernel)

BLOCK = 128


def _block(width: int) -> int:
    return max(16, min(BLOCK * 4, triton.next_power_of_2(max(width, 1))))


# ---------------------------------------------------------------------------------------------
# §4.1 compute_global_topk_indices_and_lens

def global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size,
                                 is_valid_token, out_indices, out_lens):
    T, K = topk_indices.shape
    if T == 0:
        return
    global_topk_kernel[(T,)](
        topk_indices, topk_indices.stride(0), token_to_req_indices, is_valid_token,
        block_table, block_table.stride(0), block_table.shape[0], block_table.shape[1],
        block_size, out_indices, out_indices.stride(0), out_lens, K, BLOCK=_block(K))


# ---------------------------------------------------------------------------------------------
# §4.1 V3.2 triton_convert_req_index_to_global_index

def convert_req_index_to_global(req_id, block_table, token_indices, out, valid_counts,
                                prefill_request_ids, prefill_workspace_starts, block_size,
                                block_stride_rows):
    T, K = token_indices.shape
    if T == 0:
        return
    has_pre = prefill_request_ids is not None
    convert_kernel[(T,)](
        req_id, block_table, block_table.stride(0), block_table.shape[0], block_table.shape[1],
        block_size, block_stride_rows, token_indices, token_indices.stride(0), out,
        out.stride(0), valid_counts if valid_counts is not None else out,
        prefill_request_ids if has_pre else req_id,
        prefill_workspace_starts if has_pre else req_id,
        prefill_workspace_starts.shape[0] if has_pre else 0, K,
        HAS_PREFILL=has_pre, COUNT=valid_counts is not None, BLOCK=_block(K))


# ---------------------------------------------------------------------------------------------
# §4.2 SWA window indices

def swa_indices_and_lens(query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
                         block_table, block_size, window_size, token_offset, out_indices,
                         out_lens):
    T = out_lens.shape[0]
    if T == 0:
        return
    swa_kernel[(T,)](
        query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
        block_table.stride(0), seq_lens.shape[0], block_table.shape[1], block_size,
        token_offset, out_indices, out_indices.stride(0), out_lens, window_size,
        BLOCK=_block(window_size))


# ---------------------------------------------------------------------------------------------
# §4.3 C128A indices

def c128a_indices_and_lens(positions, slot_mapping, token_to_req_indices, block_table,
                           block_size, compress_ratio, out_decode, out_decode_lens,
                           out_prefill):
    Td, Tp = out_decode.shape[0], out_prefill.shape[0]
    if Td + Tp == 0:
        return
    width = out_decode.shape[1]
    c128a_kernel[(Td + Tp,)](
        positions, slot_mapping, token_to_req_indices, block_table, block_table.stride(0),
        block_table.shape[0], block_table.shape[1], block_size, compress_ratio, Td,
        out_decode, out_decode.stride(0), out_decode_lens, out_prefill, out_prefill.stride(0),
        width, BLOCK=_block(width))


# ---------------------------------------------------------------------------------------------
# §4.4 combine_topk_swa_indices

# Launch shape of the prefill combine (lab/tools/tune_index.py sweeps it; block None = widest):
# 128 columns on 1 warp beat the earlier 256 on 2 (lab/perf-log.md, "Attention core rework",
# "Index combine (issue 3), corrected").
COMBINE_CONFIG = {"block": 128, "num_warps": 1}


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens,
                             window_size, compress_ratio, topk, M, N, out_indices, out_lens):
    T = out_lens.shape[0]
    R = seq_lens.shape[0]
    if T == 0:
        return
    CT = out_indices.shape[1]
    niter = max(1, (max(R, 1)).bit_length())
    block = COMBINE_CONFIG["block"] or _block(CT)
    combine_kernel[(T,)](
        topk_indices, topk_indices.stride(0), topk_indices.shape[1], query_start_loc, seq_lens,
        gather_lens, R, niter, M, N, window_size, compress_ratio, topk, out_indices,
        out_indices.stride(0), out_lens, CT, BLOCK=block, num_warps=COMBINE_CONFIG["num_warps"])


# ---------------------------------------------------------------------------------------------
# §4.5 build_flashinfer_mixed_sparse_indices

def flashinfer_mixed_sparse_indices(decode_swa_indices, decode_compressed_indices,
                                    decode_compressed_topk_lens, prefill_topk_indices,
                                    query_start_loc, seq_lens, token_to_req_indices,
                                    swa_block_table, swa_block_size, compressed_block_table,
                                    compressed_block_size, window_size, compress_ratio, topk,
                                    decode_compressed_indices_are_local, decode_is_valid_token,
                                    swa_block_span, compressed_block_span, out_indices,
                                    out_lens):
    Td, Tp = decode_swa_indices.shape[0], prefill_topk_indices.shape[0]
    if Td + Tp == 0:
        return
    W = window_size
    PK = out_indices.shape[1] - W
    has_dcomp = decode_compressed_indices is not None and decode_compressed_indices.shape[1] > 0
    cbt = swa_block_table if compressed_block_table is None else compressed_block_table
    sspan = swa_block_size if swa_block_span is None else swa_block_span
    cspan = compressed_block_size if compressed_block_span is None else compressed_block_span
    dcomp = decode_compressed_indices if has_dcomp else decode_swa_indices
    mixed_kernel[(Td + Tp,)](
        decode_swa_indices, decode_swa_indices.stride(0), dcomp, dcomp.stride(0),
        decode_compressed_indices.shape[1] if has_dcomp else 0,
        decode_compressed_topk_lens if decode_compressed_topk_lens is not None else out_lens,
        decode_is_valid_token if decode_is_valid_token is not None else out_lens,
        prefill_topk_indices, prefill_topk_indices.stride(0), prefill_topk_indices.shape[1],
        query_start_loc, seq_lens, token_to_req_indices, seq_lens.shape[0],
        swa_block_table, swa_block_table.stride(0), swa_block_table.shape[1], swa_block_size,
        sspan, cbt, cbt.stride(0), cbt.shape[1], compressed_block_size, cspan,
        Td, W, compress_ratio, topk, PK, out_indices, out_indices.stride(0), out_lens,
        HAS_DCOMP=has_dcomp, LOCAL=bool(decode_compressed_indices_are_local),
        HAS_DLENS=decode_compressed_topk_lens is not None,
        SPACKED=sspan != swa_block_size, CPACKED=cspan != compressed_block_size,
        WBLOCK=_block(W), KBLOCK=_block(PK))
