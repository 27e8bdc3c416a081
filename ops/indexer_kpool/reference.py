"""The kpool indexer ops in plain PyTorch (docs/semantics.md §13): the oracle, and the CPU
kernel.

Insert: fp32 softmax pooling in slot order, then the same fp32 butterflies (stride 1 first)
as vLLM's Hadamard kernel, so the bytes are reproducible; scales are exact powers of two
(frexp, not log2). Selection: scores in float64 from the cached values, a stable descending
sort over pools (larger score first, equal scores by lower pool id), then each pool expanded
to its tokens and the tail appended (ops/indexer's ``select`` does the sort).
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common import checks, quant
from sparse_mla.ops.indexer import reference as indexer_ref
from sparse_mla.ops.indexer_kpool import format as fmt

# vLLM multiplies by the fp32 reciprocal of 448 (one rounding), not divides
INV_E4M3_MAX = torch.tensor(1.0 / 448.0, dtype=torch.float32)
INV_SQRT128 = torch.tensor(0.08838834764831845, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Hadamard-128 + e4m3 (§13.2)

def hadamard128(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [N, 128] fp32 times H_128 / sqrt(128): butterflies (a + b, a - b) of
    elements ``stride`` apart, stride 1, 2, .., 64, all in fp32, then one fp32 multiply."""
    x = x.float()
    n = x.shape[0]
    for stride in (1, 2, 4, 8, 16, 32, 64):
        v = x.reshape(n, fmt.DIM // (2 * stride), 2, stride)
        a, b = v[:, :, 0], v[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).reshape(n, fmt.DIM)
    return x * INV_SQRT128


def quantize_rotated(x: torch.Tensor):
    """bf16-valued rows ``x`` [N, 128] -> (e4m3 bytes [N, 128] uint8, fp32 scales [N]): rotate,
    round to bf16, scale 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))), saturating RNE e4m3."""
    y = hadamard128(x).to(torch.bfloat16).float()
    amax = y.abs().amax(dim=-1).clamp_min(1e-4) if y.shape[0] else y.new_zeros(0)
    e = quant.ceil_log2(amax * INV_E4M3_MAX)
    return quant.e4m3(y * quant.pow2(-e).unsqueeze(-1)), quant.pow2(e)


def fwht128_quant(q: torch.Tensor):
    """The query side (vLLM ``fwht128_quant_fp8``): bf16 rows [N, 128] -> (float8_e4m3fn
    [N, 128], fp32 scale [N]); fold the scale into the indexer weights."""
    vals, scale = quantize_rotated(q.to(torch.bfloat16).float())
    return vals.view(torch.float8_e4m3fn), scale


def pool(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """One pooled key per pool: ``k``, ``gate`` [P, kpool, 128] (bf16), ``ape`` [kpool, 128]
    fp32 -> fp32 [P, 128] holding bf16 values. Per dimension: s = gate + ape, p = exp(s -
    max s), sum(p k) / sum(p), accumulated slot 0 first in fp32, rounded to bf16."""
    s = gate.float() + ape.float().unsqueeze(0)
    m = s.amax(dim=1, keepdim=True)
    p = torch.exp(s - m)
    acc = torch.zeros(k.shape[0], fmt.DIM, dtype=torch.float32)
    den = torch.zeros_like(acc)
    kf = k.float()
    for slot in range(k.shape[1]):
        den = den + p[:, slot]
        acc = acc + kf[:, slot] * p[:, slot]
    return (acc / den).to(torch.bfloat16).float()


def scale_bytes(scales: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    """fp32 scales [N] -> their 4 cache bytes [N, 4]: the fp32, or the exponent byte x4."""
    s = scales.contiguous().float()
    if scale_fmt == "ue8m0":
        byte = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        return byte.unsqueeze(1).expand(-1, 4).contiguous()
    return s.view(torch.uint8).reshape(-1, 4)


def decode_scales(raw: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    """Cache scale bytes [..., 4] -> float64 scales [...]."""
    if scale_fmt == "ue8m0":
        return (raw[..., 0].to(torch.int32) << 23).view(torch.float32).double()
    return raw.contiguous().view(torch.float32).squeeze(-1).double()


# ---------------------------------------------------------------------------------------------
# insert (§13.1-13.3)

def pool_plan(positions, slot_mapping, tail_slot_mapping, kpool, ring):
    """Per row i whose ``slot_mapping`` is >= 0 (the last token of a complete pool): for each
    slot s of its pool (position p - kpool + 1 + s), the batch row holding that token (same
    position, same tail block, at row i - (kpool - 1 - s)), or -1 to read the tail ring.
    Returns (rows [W], members [W, kpool], tail block per row [N] (-1: none))."""
    pos = positions.long().cpu()
    slot = slot_mapping.long().cpu()
    tslot = tail_slot_mapping.long().cpu()
    blk = torch.where(tslot >= 0, torch.div(tslot, ring, rounding_mode="floor"), -1)
    n = pos.shape[0]
    rows = (slot >= 0).nonzero().flatten()
    d = torch.arange(kpool - 1, -1, -1)                 # distance back from the last token
    cand = rows.unsqueeze(1) - d.unsqueeze(0)
    safe = cand.clamp(0, max(n - 1, 0))
    same = ((cand >= 0) & (pos[safe] == (pos[rows].unsqueeze(1) - d))
            & (blk[safe] == blk[rows].unsqueeze(1)))
    return rows, torch.where(same, cand, -1), blk


def ring_writers(tail_slot_mapping, kpool, ring):
    """Rows that write their raw key + gate into the ring: tail slot >= 0 and no row kpool
    later in the batch in the same tail block (vLLM's seed rule: each request's last kpool
    batch tokens; a decode step of next_n <= kpool: every token)."""
    tslot = tail_slot_mapping.long().cpu()
    n = tslot.shape[0]
    blk = torch.where(tslot >= 0, torch.div(tslot, ring, rounding_mode="floor"), -1)
    ahead = torch.full((n,), -1, dtype=torch.long)
    if n > kpool:
        ahead[:n - kpool] = blk[kpool:]
    return ((tslot >= 0) & ~((ahead >= 0) & (ahead == blk))).nonzero().flatten()


def k_insert(k, gate, ape, positions, slot_mapping, tail_slot_mapping, k_cache, tail_cache,
             kpool, block_size, scale_fmt):
    n = slot_mapping.shape[0]
    ring = tail_cache.shape[2]
    rows, members, blk = pool_plan(positions[:n], slot_mapping[:n], tail_slot_mapping[:n],
                                   kpool, ring)
    kb, gb = k[:n].cpu().to(torch.bfloat16), gate[:n].cpu().to(torch.bfloat16)
    pos = positions[:n].long().cpu()
    if rows.numel():
        ring_cpu = tail_cache.cpu()                     # reads see the ring before this call
        w = rows.numel()
        pk = torch.zeros(w, kpool, fmt.DIM, dtype=torch.bfloat16)
        pg = torch.zeros_like(pk)
        ok = torch.ones(w, dtype=torch.bool)
        for a in range(w):
            i = int(rows[a])
            for s in range(kpool):
                m = int(members[a, s])
                if m >= 0:
                    pk[a, s], pg[a, s] = kb[m], gb[m]
                elif int(blk[i]) >= 0:
                    phys = (int(pos[i]) - (kpool - 1) + s) % ring
                    pk[a, s], pg[a, s] = ring_cpu[blk[i], 0, phys], ring_cpu[blk[i], 1, phys]
                else:                                   # no ring to complete it from
                    ok[a] = False
        vals, scales = quantize_rotated(pool(pk, pg, ape.cpu()))
        sb = scale_bytes(scales, scale_fmt)
        page = checks.block_bytes_view(k_cache, fmt.FP8, block_size)
        slots = slot_mapping[:n].long().cpu()
        for a in ok.nonzero().flatten().tolist():
            b, o = divmod(int(slots[rows[a]]), block_size)
            page[b, o * fmt.DIM:(o + 1) * fmt.DIM] = vals[a].to(page.device)
            t0 = block_size * fmt.DIM + o * 4
            page[b, t0:t0 + 4] = sb[a].to(page.device)
    tslot = tail_slot_mapping[:n].long().cpu()
    for i in ring_writers(tail_slot_mapping[:n], kpool, ring).tolist():
        b, o = divmod(int(tslot[i]), ring)
        tail_cache[b, 0, o] = kb[i].to(tail_cache.device)
        tail_cache[b, 1, o] = gb[i].to(tail_cache.device)


# ---------------------------------------------------------------------------------------------
# selection (§13.4-13.6)

def expand(pools: torch.Tensor, seq_len: torch.Tensor, kpool: int, out: torch.Tensor) -> None:
    """``pools`` [n, topk // kpool] (ids or -1), ``seq_len`` [n] (position + 1) -> ``out``
    [n, topk + kpool - 1]: column g * kpool + o holds pools[g] * kpool + o (-1 for a -1 pool);
    column topk + j holds the tail token (seq_len // kpool) * kpool + j while it is < seq_len,
    else -1."""
    n, groups = pools.shape
    topk = groups * kpool
    p = pools.long().unsqueeze(-1)
    hist = torch.where(p >= 0, p * kpool + torch.arange(kpool), -1).reshape(n, topk)
    start = torch.div(seq_len.long(), kpool, rounding_mode="floor") * kpool
    j = torch.arange(kpool - 1)
    tail = torch.where(start.unsqueeze(1) + j < seq_len.long().unsqueeze(1),
                       start.unsqueeze(1) + j, -1)
    out.copy_(torch.cat((hist, tail), dim=1).to(torch.int32).to(out.device))


def _select_expand(scores, cand, pos, kpool, out):
    groups = (out.shape[1] - kpool + 1) // kpool
    sel = torch.empty(scores.shape[0], groups, dtype=torch.int32)
    indexer_ref.select(scores, cand, sel)
    res = torch.empty(out.shape, dtype=torch.int32)
    expand(sel, pos + 1, kpool, res)
    out.copy_(res.to(out.device))


def topk_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, kpool, out,
                 chunk, max_seqlen_k):
    cu_q = cu_seqlens_q.long().cpu().tolist()
    cu_k = cu_seqlens_k.long().cpu().tolist()
    pos = positions.long().cpu()
    qd, wd = q.cpu().double(), weights.cpu().double()
    kd = indexer_ref._dense_keys(k.cpu(), None if k_scale is None else k_scale.cpu())
    chunk = chunk or 4096
    for r in range(len(cu_q) - 1):
        keys = kd[cu_k[r]:cu_k[r + 1]]
        cols = torch.arange(keys.shape[0])
        for s in range(cu_q[r], cu_q[r + 1], chunk):
            e = min(s + chunk, cu_q[r + 1])
            scores = indexer_ref._scores(qd[s:e], wd[s:e], keys)
            n_cand = torch.div(pos[s:e] + 1, kpool, rounding_mode="floor")
            _select_expand(scores, cols.unsqueeze(0) < n_cand.unsqueeze(1), pos[s:e], kpool,
                           out[s:e])


def paged_pools(k_cache, block_table_row, block_size, n, scale_fmt):
    """Pools 0..n-1 of one request as float64 [n, 128], and which are readable: the indexer's
    paged entries (same 132-byte record), its scales read as ``scale_fmt``."""
    return indexer_ref.paged_keys(k_cache, block_table_row, block_size, n,
                                  lambda raw: decode_scales(raw, scale_fmt))


def topk_decode(q, weights, k_cache, seq_lens, block_table, kpool, next_n, out, block_size,
                max_candidates, scale_fmt):
    width = block_table.shape[1] * block_size
    if max_candidates is not None:
        width = min(width, max_candidates)
    cache, bt = k_cache.cpu(), block_table.cpu()
    qd, wd = q.cpu().double(), weights.cpu().double()
    sl = seq_lens.long().cpu()
    cols = torch.arange(width)
    for b in range(q.shape[0] // next_n):
        keys, ok = paged_pools(cache, bt[b], block_size, width, scale_fmt)
        rows = slice(b * next_n, (b + 1) * next_n)
        pos = sl[b] - next_n + torch.arange(next_n)
        scores = indexer_ref._scores(qd[rows], wd[rows], keys)
        n_cand = torch.div(pos + 1, kpool, rounding_mode="floor")
        cand = (cols.unsqueeze(0) < n_cand.unsqueeze(1)) & ok.unsqueeze(0)
        _select_expand(scores, cand, pos.clamp_min(-1), kpool, out[rows])
