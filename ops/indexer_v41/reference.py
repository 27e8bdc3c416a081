"""The V4.1 two-level indexer in plain PyTorch (docs/semantics.md §11.6): the oracle.

Written as vLLM does it (``candidate_blocks.py``): the row's dense float64 logits first, then the
block scores (a NaN-propagating max per candidate block, the newest block pinned to +inf) or the
candidate mask, then the top-k. Logits come from ops/indexer/reference.py's helpers, so the
scores are §11.2's to the bit.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.indexer import format as fmt
from sparse_mla.ops.indexer.reference import _dense_keys, _scores, paged_keys, select


def block_scores(logits: torch.Tensor, live: torch.Tensor, n: torch.Tensor, cb: int):
    """[rows, ceil(width / cb)] float64: the max of each block's ``live`` logits, NaN if any of
    them is NaN, -inf with none; the block holding column ``n[row] - 1`` is +inf."""
    rows, width = logits.shape
    nblk = -(-width // cb)
    pad = nblk * cb - width
    vals = torch.where(live, logits, torch.full_like(logits, float("-inf")))
    vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf")).view(rows, nblk, cb)
    scores = vals.amax(dim=2)
    scores[vals.isnan().any(dim=2)] = float("nan")
    newest = torch.div(n - 1, cb, rounding_mode="floor")
    pinned = (n > 0).unsqueeze(1) & (torch.arange(nblk).unsqueeze(0) == newest.unsqueeze(1))
    return torch.where(pinned, torch.full_like(scores, float("inf")), scores)


def select_blocks(scores: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` [rows, NB] <- the NB best block ids: larger score first (NaN first, as
    ``torch.topk`` ranks it), equal scores by the lower id; -inf blocks and the rest -1."""
    nb = out.shape[1]
    out.fill_(-1)
    if scores.shape[0] == 0 or scores.shape[1] == 0:
        return
    vals, order = torch.sort(scores, dim=1, descending=True, stable=True)
    k = min(nb, scores.shape[1])
    ids = torch.where(vals[:, :k] == float("-inf"), -1, order[:, :k]).to(torch.int32)
    out[:, :k] = ids.to(out.device)


def in_candidates(candidates: torch.Tensor, width: int, cb: int) -> torch.Tensor:
    """[rows, width] bool: column s's block s // cb is listed (ids outside the row's blocks,
    -1 and repeats do nothing)."""
    rows = candidates.shape[0]
    nblk = -(-width // cb)
    flags = torch.zeros(rows, nblk + 1, dtype=torch.bool)
    c = candidates.long().cpu()
    c = torch.where((c >= 0) & (c < nblk), c, nblk)        # the spare column absorbs the rest
    flags.scatter_(1, c, True)
    return flags[:, torch.arange(width) // cb] if width else flags[:, :0]


def _level(logits, live, n, out, candidates, cb, write_candidates):
    """One level on float64 ``logits`` [rows, width] whose ``live`` columns are causal and
    readable: level 1 writes ``out`` (its own top-k) and ``candidates``; level 2 the top-k
    among live columns in ``candidates``' blocks."""
    rows = torch.empty(out.shape, dtype=torch.int32)
    if write_candidates:
        select(logits, live, rows)
        blocks = torch.empty(candidates.shape, dtype=torch.int32)
        select_blocks(block_scores(logits, live, n, cb), blocks)
        candidates.copy_(blocks.to(candidates.device))
    else:
        select(logits, live & in_candidates(candidates, logits.shape[1], cb), rows)
    out.copy_(rows.to(out.device))


def _decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio, next_n,
            block_size, cb, width, write_candidates):
    cache = k_cache.cpu()
    qd, wd = q.cpu().double(), weights.cpu().double()
    sl = seq_lens.long().cpu()
    bt = block_table.cpu()
    cols = torch.arange(width)
    for b in range(q.shape[0] // next_n):
        keys, ok = paged_keys(cache, bt[b], block_size, width)
        r = slice(b * next_n, (b + 1) * next_n)
        p1 = sl[b] - next_n + torch.arange(next_n) + 1
        n = torch.div(p1.clamp_min(0), ratio, rounding_mode="floor").clamp_max(width)
        live = (cols.unsqueeze(0) < n.unsqueeze(1)) & ok.unsqueeze(0)
        _level(_scores(qd[r], wd[r], keys), live, n, out[r], candidates[r], cb, write_candidates)


def candidates_decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio,
                      next_n, block_size, cb, max_candidates):
    width = fmt.decode_width(block_table, block_size, max_candidates)
    _decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio, next_n,
            block_size, cb, width, True)


def topk_in_candidates_decode(q, weights, k_cache, seq_lens, block_table, candidates, out,
                              ratio, next_n, block_size, cb):
    width = fmt.decode_width(block_table, block_size, None)
    _decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio, next_n,
            block_size, cb, width, False)


def _prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out, candidates,
             ratio, cb, write_candidates):
    cu_q = cu_seqlens_q.long().cpu().tolist()
    cu_k = cu_seqlens_k.long().cpu().tolist()
    pos = positions.long().cpu()
    qd, wd = q.cpu().double(), weights.cpu().double()
    kd = _dense_keys(k.cpu(), None if k_scale is None else k_scale.cpu())
    for r in range(len(cu_q) - 1):
        s, e = cu_q[r], cu_q[r + 1]
        keys = kd[cu_k[r]:cu_k[r + 1]]
        width = keys.shape[0]
        n = torch.div((pos[s:e] + 1).clamp_min(0), ratio, rounding_mode="floor").clamp_max(width)
        live = torch.arange(width).unsqueeze(0) < n.unsqueeze(1)
        _level(_scores(qd[s:e], wd[s:e], keys), live, n, out[s:e], candidates[s:e], cb,
               write_candidates)


def candidates_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                       candidates, ratio, cb, chunk, max_seqlen_k):
    _prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out, candidates,
             ratio, cb, True)


def topk_in_candidates_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions,
                               candidates, out, ratio, cb):
    _prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out, candidates,
             ratio, cb, False)
