"""Random mixed batches (decode, MTP, prefill, graph padding) for the index-op tests.

Layout (vLLM order): decode tokens, then prefill tokens, then ``n_tail_pad`` graph-padding
tokens beyond the last request. Some decode tokens are also marked invalid (slot_mapping -1)
and carry junk request ids / top-k rows, as stale persistent buffers do.
"""
from __future__ import annotations

import dataclasses

import torch

I32 = torch.int32


@dataclasses.dataclass
class Batch:
    query_lens: list
    seq_lens_l: list
    n_decode_reqs: int
    Td: int           # decode tokens
    Tp: int           # prefill tokens
    n_tail_pad: int
    t: dict           # name -> tensor (CPU)

    def to(self, device):
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.t.items()}


def _table(g, seq_lens, per_block, extra_cols=2):
    """Block table [R, B] with a random permutation of physical blocks; unused cells junk."""
    need = [-(-max(s, 0) // per_block) for s in seq_lens]
    B = max(need + [1]) + extra_cols
    nblk = sum(need) + 4
    perm = torch.randperm(nblk, generator=g)
    bt = torch.randint(0, nblk, (len(seq_lens), B), generator=g, dtype=I32)
    k = 0
    for r, n in enumerate(need):
        bt[r, :n] = perm[k:k + n].to(I32)
        k += n
    return bt


def _topk_rows(g, pos, K, ratio):
    """Request-local C4A-style ids: min(n, K) distinct ids of [0, n), n = (pos+1)//ratio,
    left-aligned, -1 padded."""
    rows = torch.full((len(pos), K), -1, dtype=I32)
    for i, p in enumerate(pos):
        n = (p + 1) // ratio
        m = min(n, K)
        if m:
            rows[i, :m] = torch.randperm(n, generator=g)[:m].to(I32)
    return rows


def make_batch(seed, *, n_decode=3, mtp=1, n_prefill=2, max_prefill_q=40, max_ctx=300,
               ratio=4, swa_bs=64, comp_bs=None, topk=16, n_invalid_decode=1, n_tail_pad=2):
    g = torch.Generator()
    g.manual_seed(seed)
    comp_bs = comp_bs or max(256 // ratio, 1)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    qls, sls = [], []
    for r in range(n_decode):
        q = ri(1, mtp)
        # bias towards short contexts: pos < W-1 and (p+1) < ratio must occur
        prefix = ri(0, 6) if r % 3 == 0 else ri(0, max_ctx)
        qls.append(q)
        sls.append(prefix + q)
    for r in range(n_prefill):
        q = ri(2, max_prefill_q)
        prefix = 0 if r % 2 == 0 else ri(0, max_ctx)
        qls.append(q)
        sls.append(prefix + q)
    R = len(qls)
    Td = sum(qls[:n_decode])
    Tp = sum(qls[n_decode:])
    T = Td + Tp
    qsl = torch.tensor([0] + list(torch.tensor(qls).cumsum(0)), dtype=I32) if R else \
        torch.zeros(1, dtype=I32)
    t2r = torch.repeat_interleave(torch.arange(R), torch.tensor(qls, dtype=torch.long)) \
        if R else torch.zeros(0, dtype=torch.long)
    pos = []
    for r in range(R):
        pos += list(range(sls[r] - qls[r], sls[r]))
    pos = torch.tensor(pos, dtype=torch.long)
    valid = torch.ones(T + n_tail_pad, dtype=torch.bool)
    valid[T:] = False
    if Td and n_invalid_decode:
        bad = torch.randperm(Td, generator=g)[:n_invalid_decode]
        valid[bad] = False
    t2r_full = torch.cat([t2r, torch.zeros(n_tail_pad, dtype=torch.long)])
    # junk request ids on invalid tokens: out of range and in range
    junk = torch.tensor([R + 5, -3, 0, 10 ** 6])
    inv = (~valid).nonzero().flatten()
    t2r_full[inv] = junk[torch.arange(len(inv)) % 4]
    slot_mapping = torch.where(valid, torch.arange(T + n_tail_pad), -1).to(torch.long)
    positions = torch.cat([pos, torch.zeros(n_tail_pad, dtype=torch.long)])

    swa_bt = _table(g, sls, swa_bs)
    comp_bt = _table(g, [s // ratio for s in sls], comp_bs)
    topk_rows = _topk_rows(g, positions.tolist(), topk, ratio)
    # junk on invalid tokens (beyond every table)
    topk_rows[inv] = torch.randint(-1, 10 ** 6, (len(inv), topk), generator=g, dtype=I32)
    t = dict(query_start_loc=qsl, seq_lens=torch.tensor(sls, dtype=I32),
             token_to_req=t2r_full.to(I32), is_valid=valid, slot_mapping=slot_mapping,
             positions=positions.to(I32), swa_bt=swa_bt, comp_bt=comp_bt, topk=topk_rows,
             ratio=ratio, swa_bs=swa_bs, comp_bs=comp_bs, K=topk)
    return Batch(qls, sls, n_decode, Td, Tp, n_tail_pad, t)


def poisoned(*shape, device="cpu"):
    return torch.full(shape, 12345, dtype=I32, device=device)
