"""PyTorch reference for the index-combine family (docs/semantics.md §4): the oracle and the
CPU kernel.

Arguments arrive validated (see ops.py; on CPU the validation includes the value checks, so
inconsistent batches raise there). The functions below still define a value for every input
the kernels can see — a request id outside the table, a block index beyond the block table, a
negative position all give -1 entries — so Triton and reference agree even on inputs that only
pass because value checks are off (CUDA without SPARSE_MLA_CHECK_VALUES=1).
All outputs are int32 and are written completely (every column of every row).
"""
from __future__ import annotations

import torch


def _slots(block_table, req, req_ok, block_size, local, live, stride_rows=None):
    """``block_table[req, local // bs] * stride_rows + local % bs`` where ``live`` and the lookup
    is inside the table, else -1. ``req``/``req_ok`` broadcast against ``local``."""
    R, B = block_table.shape
    loc = local.long().clamp(min=0)
    blk = loc // block_size
    good = live & (local >= 0) & (blk < B) & req_ok
    r = torch.where(req_ok, req.long(), 0).expand_as(loc)
    num = block_table[r.clamp(0, max(R - 1, 0)), blk.clamp(0, max(B - 1, 0))].long() \
        if R and B else torch.zeros_like(loc)
    stride = block_size if stride_rows is None else stride_rows
    return torch.where(good, num * stride + loc % block_size, -1), good


def _remap_span(v, block_size, span):
    if span is None or span == block_size:
        return v
    vv = v.clamp(min=0)
    return torch.where(v >= 0, (vv // block_size) * span + vv % block_size, v)


def _req_ok(req, R):
    return (req >= 0) & (req < R)


# ---------------------------------------------------------------------------------------------
# §4.1

def global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size,
                                 is_valid_token, out_indices, out_lens):
    T, K = topk_indices.shape
    req = token_to_req_indices[:T].long().unsqueeze(1)
    ok = _req_ok(req, block_table.shape[0])
    live = torch.ones_like(topk_indices, dtype=torch.bool)
    slots, good = _slots(block_table, req, ok, block_size, topk_indices.long(), live)
    out_indices.copy_(slots.to(torch.int32))
    count = good.sum(1).to(torch.int32)
    out_lens.copy_(torch.where(is_valid_token[:T], count, 0))


def convert_req_index_to_global(req_id, block_table, token_indices, out, valid_counts,
                                prefill_request_ids, prefill_workspace_starts, block_size,
                                block_stride_rows):
    T, K = token_indices.shape
    tok = token_indices.long()
    req = req_id[:T].long().unsqueeze(1)
    in_table = (tok >= 0) & (tok.clamp(min=0) // block_size < block_table.shape[1])
    dec_row = _req_ok(req, block_table.shape[0])
    if prefill_request_ids is not None:
        preq = prefill_request_ids[:T].long().unsqueeze(1)
        dec_row = dec_row & (preq < 0)
    val, dec_good = _slots(block_table, req, dec_row, block_size, tok, in_table,
                           stride_rows=block_stride_rows)
    good = dec_good
    if prefill_request_ids is not None:
        P = prefill_workspace_starts.shape[0]
        pre_ok = (preq >= 0) & (preq < P)
        ws = prefill_workspace_starts[preq.clamp(0, max(P - 1, 0))].long() if P else \
            torch.zeros_like(preq)
        pre_good = in_table & pre_ok
        val = torch.where(pre_good, ws + tok, val)
        good = dec_good | pre_good
    out.copy_(val.to(torch.int32))
    if valid_counts is not None:
        valid_counts.copy_(good.sum(1).to(torch.int32))


# ---------------------------------------------------------------------------------------------
# §4.2

def token_positions(query_start_loc, seq_lens, req, t, ok=None):
    """pos = seq_len - query_len + (t - query_start) for tokens ``t`` of requests ``req``
    (tokens where ``ok`` is False read request 0's entries instead; their value is unused)."""
    if ok is None:
        ok = torch.ones_like(req, dtype=torch.bool)
    r = torch.where(ok, req, 0)
    qs = torch.where(ok, query_start_loc[r].long(), 0)
    qe = torch.where(ok, query_start_loc[r + 1].long(), 0)
    sl = torch.where(ok, seq_lens[r].long(), 0)
    return sl - (qe - qs) + (t - qs)


def swa_indices_and_lens(query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
                         block_table, block_size, window_size, token_offset, out_indices,
                         out_lens):
    T = out_lens.shape[0]
    W = window_size
    t = torch.arange(token_offset, token_offset + T, device=out_lens.device)
    req = token_to_req_indices[t].long()
    ok = is_valid_token[t] & _req_ok(req, seq_lens.shape[0])
    pos = token_positions(query_start_loc, seq_lens, req, t, ok)
    start = (pos - W + 1).clamp(min=0)
    n = torch.where(ok, torch.minimum(pos + 1, torch.full_like(pos, W)).clamp(min=0), 0)
    i = torch.arange(W, device=out_lens.device)
    slots, _ = _slots(block_table, req.unsqueeze(1), ok.unsqueeze(1), block_size,
                      start.unsqueeze(1) + i, i < n.unsqueeze(1))
    out = out_indices[:, 0] if out_indices.dim() == 3 else out_indices
    out.copy_(slots.to(torch.int32))
    out_lens.copy_(n.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# §4.3

def c128a_indices_and_lens(positions, slot_mapping, token_to_req_indices, block_table,
                           block_size, compress_ratio, out_decode, out_decode_lens,
                           out_prefill):
    Td, Tp = out_decode.shape[0], out_prefill.shape[0]
    width = out_decode.shape[1]
    dev = out_decode.device
    pos = positions[:Td + Tp].long()
    n = torch.clamp((pos + 1).clamp(min=0) // compress_ratio, max=width)
    i = torch.arange(width, device=dev)
    # decode rows: global slots of 0..n-1; a graph-padding token gets length 0 and all -1
    ok = slot_mapping[:Td] >= 0
    req = token_to_req_indices[:Td].long()
    nd = torch.where(ok, n[:Td], 0)
    slots, _ = _slots(block_table, req.unsqueeze(1), (ok & _req_ok(req, block_table.shape[0]))
                      .unsqueeze(1), block_size, i.expand(Td, width), i < nd.unsqueeze(1))
    out_decode.copy_(slots.to(torch.int32))
    out_decode_lens.copy_(nd.to(torch.int32))
    # prefill rows: request-local ids 0..n-1
    npf = n[Td:].unsqueeze(1)
    out_prefill.copy_(torch.where(i < npf, i, -1).to(torch.int32))


# ---------------------------------------------------------------------------------------------
# §4.4

def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens,
                             window_size, compress_ratio, topk, M, N, out_indices, out_lens):
    T, CT = out_indices.shape
    dev = out_indices.device
    out_indices.fill_(-1)
    out_lens.zero_()
    qsl = query_start_loc.long() - query_start_loc[0].long()
    Kt = topk_indices.shape[1]
    for b in range(seq_lens.shape[0]):
        qs, qe = int(qsl[b]), min(int(qsl[b + 1]), T)
        if qe <= qs:
            continue
        sl, gl = int(seq_lens[b]), int(gather_lens[b])
        t = torch.arange(qs, qe, device=dev)
        pos = sl - (int(qsl[b + 1]) - qs) + (t - qs)
        pos1 = (pos + 1).clamp(min=0)
        topk_len = torch.clamp(pos1 // compress_ratio, max=topk)
        swa_len = torch.clamp(pos1, max=window_size)
        j = torch.arange(CT, device=dev)
        # compressed part: entries 0 <= idx < N of the top-k row, offset by b*M
        idx = torch.full((qe - qs, CT), -1, dtype=torch.long, device=dev)
        kk = min(Kt, CT)
        idx[:, :kk] = topk_indices[qs:qe, :kk].long()
        in_topk = j < topk_len.unsqueeze(1)
        val = torch.where(in_topk & (idx >= 0) & (idx < N), b * M + idx, -1)
        # window part: positions pos-swa_len+1 .. pos, rows N + (position - gather_start)
        i = j - topk_len.unsqueeze(1)
        win = b * M + N + (pos - swa_len + 1 - (sl - gl)).unsqueeze(1) + i
        val = torch.where((i >= 0) & (i < swa_len.unsqueeze(1)), win, val)
        out_indices[qs:qe] = val.to(torch.int32)
        out_lens[qs:qe] = (topk_len + swa_len).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# §4.5

def flashinfer_mixed_sparse_indices(decode_swa_indices, decode_compressed_indices,
                                    decode_compressed_topk_lens, prefill_topk_indices,
                                    query_start_loc, seq_lens, token_to_req_indices,
                                    swa_block_table, swa_block_size, compressed_block_table,
                                    compressed_block_size, window_size, compress_ratio, topk,
                                    decode_compressed_indices_are_local, decode_is_valid_token,
                                    swa_block_span, compressed_block_span, out_indices,
                                    out_lens):
    Td, Tp = decode_swa_indices.shape[0], prefill_topk_indices.shape[0]
    W = window_size
    PK = out_indices.shape[1] - W
    dev = out_indices.device
    cbt = swa_block_table if compressed_block_table is None else compressed_block_table
    R = seq_lens.shape[0]
    k = torch.arange(PK, device=dev)
    w = torch.arange(W, device=dev)

    # decode rows
    if Td:
        swa = decode_swa_indices.long()
        Kd = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
        comp = torch.full((Td, PK), -1, dtype=torch.long, device=dev)
        if Kd:
            comp[:, :min(Kd, PK)] = decode_compressed_indices[:, :PK].long()
        clen = torch.zeros(Td, dtype=torch.long, device=dev)
        if Kd and decode_compressed_indices_are_local:
            req = token_to_req_indices[:Td].long().unsqueeze(1)
            comp, good = _slots(cbt, req, _req_ok(req, R), compressed_block_size, comp,
                                torch.ones_like(comp, dtype=torch.bool))
            clen = torch.where(decode_is_valid_token[:Td], good.sum(1), 0)
        elif Kd and decode_compressed_topk_lens is not None:
            clen = decode_compressed_topk_lens[:Td].long()
        elif Kd:
            clen = torch.full((Td,), Kd, dtype=torch.long, device=dev)
        out_indices[:Td, :W] = _remap_span(swa, swa_block_size, swa_block_span).to(torch.int32)
        out_indices[:Td, W:] = _remap_span(comp, compressed_block_size,
                                           compressed_block_span).to(torch.int32)
        out_lens[:Td] = (W + clen).to(torch.int32)

    # prefill rows
    if Tp:
        t = torch.arange(Td, Td + Tp, device=dev)
        req = token_to_req_indices[t].long()
        ok = _req_ok(req, R)
        pos = token_positions(query_start_loc, seq_lens, req, t, ok)
        pos1 = (pos + 1).clamp(min=0)
        swa_len = torch.where(ok, pos1.clamp(max=W), 0)
        topk_len = torch.where(ok, torch.clamp(pos1 // compress_ratio, max=topk), 0)
        start = pos - swa_len + 1
        swa, _ = _slots(swa_block_table, req.unsqueeze(1), ok.unsqueeze(1), swa_block_size,
                        start.unsqueeze(1) + w, w < swa_len.unsqueeze(1))
        Kp = prefill_topk_indices.shape[1]
        loc = torch.full((Tp, PK), -1, dtype=torch.long, device=dev)
        loc[:, :min(Kp, PK)] = prefill_topk_indices[:, :PK].long()
        live = k < topk_len.unsqueeze(1)
        loc = torch.where(live, loc, -1)
        comp, _ = _slots(cbt, req.unsqueeze(1), ok.unsqueeze(1), compressed_block_size, loc,
                         live)
        out_indices[Td:, :W] = _remap_span(swa, swa_block_size, swa_block_span).to(torch.int32)
        out_indices[Td:, W:] = _remap_span(comp, compressed_block_size,
                                           compressed_block_span).to(torch.int32)
        out_lens[Td:] = (W + topk_len).to(torch.int32)
