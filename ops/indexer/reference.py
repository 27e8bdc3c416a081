"""The indexer ops in plain PyTorch (docs/semantics.md §11): the oracle, and the CPU kernel.

Scores are computed in float64 from the exact values the caches hold (e4m3 times its scale, or
bf16), one head at a time, so memory stays O(chunk x candidates) like the GPU route. The
selection is a stable descending sort: larger score first, equal scores by lower id (§11.4).
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common import checks, quant
from sparse_mla.ops.indexer import format as fmt


# ---------------------------------------------------------------------------------------------
# K insert (§11.1)

def quantize_fp8(k: torch.Tensor):
    """Rows ``k`` [N, 128] -> (e4m3 bytes [N, 128] uint8, fp32 scales [N]): bf16 first, then
    a power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) and round-to-nearest-even e4m3."""
    x = k.to(torch.bfloat16).float()
    amax = x.abs().amax(dim=-1).clamp_min(1e-4)
    e = quant.ceil_log2(quant.div(amax, quant.formats.E4M3_MAX))
    return quant.e4m3(x * quant.pow2(-e).unsqueeze(-1)), quant.pow2(e)


def k_insert(k, k_cache, slot_mapping, block_size):
    n = slot_mapping.shape[0]
    slots = slot_mapping[:n].long().cpu()
    live = (slots >= 0).nonzero().flatten().tolist()
    if not live:
        return
    if k_cache.dtype == torch.bfloat16:
        rows = k[:n].to(torch.bfloat16)
        for t in live:
            k_cache[int(slots[t]) // block_size, int(slots[t]) % block_size] = rows[t]
        return
    values, scales = quantize_fp8(k[:n])
    page = checks.block_bytes_view(k_cache, fmt.FP8, block_size)
    scale_bytes = scales.contiguous().view(torch.uint8).reshape(n, 4)
    for t in live:
        blk, off = int(slots[t]) // block_size, int(slots[t]) % block_size
        page[blk, off * fmt.DIM:(off + 1) * fmt.DIM] = values[t]
        tail = block_size * fmt.DIM + off * 4
        page[blk, tail:tail + 4] = scale_bytes[t]


# ---------------------------------------------------------------------------------------------
# selection (§11.4)

def select(scores: torch.Tensor, cand: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` [n, K] <- the ids of the K largest ``scores`` [n, C] among candidates ``cand``
    [n, C] (bool), larger score first, equal scores by lower id, then -1."""
    n, k = out.shape
    if n == 0:
        return
    c = scores.shape[1]
    masked = torch.where(cand, scores, torch.full_like(scores, float("-inf")))
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]
    count = cand.sum(dim=1, keepdim=True)
    rank = torch.arange(order.shape[1]).unsqueeze(0)
    ids = torch.where(rank < count, order, -1).to(torch.int32)
    out.fill_(-1)
    out[:, :min(k, c)] = ids.to(out.device)


def _scores(q, w, keys):
    """sum_h w[:, h] * relu(q[:, h] . keys^T) in float64, one head at a time: [n, C]."""
    acc = torch.zeros(q.shape[0], keys.shape[0], dtype=torch.float64)
    for h in range(q.shape[1]):
        acc += w[:, h:h + 1] * (q[:, h] @ keys.T).clamp_min(0)
    return acc


def _dense_keys(k, k_scale):
    if k_scale is None:
        return k.double()
    return k.view(torch.float8_e4m3fn).double() * k_scale.double().unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# prefill (§11.3): ragged requests, keys given densely per request

def topk_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, ratio, out,
                 chunk, max_seqlen_k):
    cu_q = cu_seqlens_q.long().cpu().tolist()
    cu_k = cu_seqlens_k.long().cpu().tolist()
    pos = positions.long().cpu()
    qd, wd = q.cpu().double(), weights.cpu().double()
    kd = _dense_keys(k.cpu(), None if k_scale is None else k_scale.cpu())
    chunk = chunk or fmt.auto_chunk(max_seqlen_k or max(1, kd.shape[0]))
    for r in range(len(cu_q) - 1):
        keys = kd[cu_k[r]:cu_k[r + 1]]
        cols = torch.arange(keys.shape[0])
        for s in range(cu_q[r], cu_q[r + 1], chunk):
            e = min(s + chunk, cu_q[r + 1])
            scores = _scores(qd[s:e], wd[s:e], keys)
            n_cand = torch.div(pos[s:e] + 1, ratio, rounding_mode="floor")
            rows = torch.empty(e - s, out.shape[1], dtype=torch.int32)
            select(scores, cols.unsqueeze(0) < n_cand.unsqueeze(1), rows)
            out[s:e] = rows.to(out.device)


# ---------------------------------------------------------------------------------------------
# decode (§11.3): the paged cache, s_q = next_n tokens per request

def _fp32_scales(raw):
    return raw.contiguous().view(torch.float32).squeeze(-1).double()


def paged_keys(k_cache, block_table_row, block_size, n, scales=_fp32_scales):
    """Entries 0..n-1 of one request as float64 [n, 128], and which of them are readable
    (block id in [0, num_blocks)); unreadable rows are zeros. ``scales``: an fp8 entry's 4
    scale bytes [m, 4] -> float64 [m] (the fp32 the V3.2 / V4 cache stores; GLM-5.3's pooled
    cache may store ue8m0)."""
    nb = k_cache.shape[0]
    j = torch.arange(n)
    col = j // block_size
    blk = torch.full((n,), -1, dtype=torch.long)
    inside = col < block_table_row.shape[0]
    blk[inside] = block_table_row.long()[col[inside]]
    ok = (blk >= 0) & (blk < nb)
    keys = torch.zeros(n, fmt.DIM, dtype=torch.float64)
    idx = ok.nonzero().flatten()
    if idx.numel() == 0:
        return keys, ok
    b, o = blk[idx], (j % block_size)[idx]
    if k_cache.dtype == torch.bfloat16:
        keys[idx] = k_cache[b, o].double()
        return keys, ok
    page = checks.block_bytes_view(k_cache, fmt.FP8, block_size)
    vals = page[b.unsqueeze(1), (o * fmt.DIM).unsqueeze(1) + torch.arange(fmt.DIM)]
    tail = (block_size * fmt.DIM + o * 4).unsqueeze(1) + torch.arange(4)
    scale = scales(page[b.unsqueeze(1), tail])
    keys[idx] = vals.contiguous().view(torch.float8_e4m3fn).double() * scale.unsqueeze(1)
    return keys, ok


def decode_requests(q, weights, k_cache, seq_lens, block_table, next_n, block_size, width):
    """Per request b of a decode step: (its rows' slice, their float64 scores over entries
    0..width-1 [next_n, width], which entries are readable, its tokens' positions)."""
    cache = k_cache.cpu()
    qd, wd = q.cpu().double(), weights.cpu().double()
    sl = seq_lens.long().cpu()
    bt = block_table.cpu()
    for b in range(q.shape[0] // next_n):
        keys, ok = paged_keys(cache, bt[b], block_size, width)
        rows = slice(b * next_n, (b + 1) * next_n)
        yield rows, _scores(qd[rows], wd[rows], keys), ok, sl[b] - next_n + torch.arange(next_n)


def topk_decode(q, weights, k_cache, seq_lens, block_table, ratio, next_n, out, block_size,
                max_candidates):
    width = fmt.decode_width(block_table, block_size, max_candidates)
    cols = torch.arange(width)
    for rows, scores, ok, pos in decode_requests(q, weights, k_cache, seq_lens, block_table,
                                                 next_n, block_size, width):
        n_cand = torch.div(pos + 1, ratio, rounding_mode="floor")
        cand = (cols.unsqueeze(0) < n_cand.unsqueeze(1)) & ok.unsqueeze(0)
        sel = torch.empty(next_n, out.shape[1], dtype=torch.int32)
        select(scores, cand, sel)
        out[rows] = sel.to(out.device)
