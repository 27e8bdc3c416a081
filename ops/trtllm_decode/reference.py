"""PyTorch reference for the TRTLLM-gen-semantics family's own arithmetic: which leading
index columns each query token may use. These tensor-op forms are the readable definitions
(and the reference path's); ``triton_kernels.py`` computes the same int32 counts in one
launch. The attention itself is the shared reference, ops/attention/reference.py.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

I32 = torch.int32
SWA_COLS = 128                        # fixed SWA window columns of a DSv4 index row


def token_map(T: int, B: int, Q: int, cum_seq_lens_q: Optional[Tensor], device):
    """Per token: request id, index inside its request, its request's query length, and
    whether it belongs to a request at all (varlen rows outside ``cum_seq_lens_q`` do not).
    Tensor ops only (no host sync)."""
    t = torch.arange(T, device=device)
    if cum_seq_lens_q is None:
        req = t // Q
        return req, t - req * Q, torch.full_like(t, Q), torch.ones_like(t, dtype=torch.bool)
    cu = cum_seq_lens_q.long()
    req = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp_(max=B - 1)
    start, end = cu[req], cu[req + 1]
    return req, t - start, end - start, (t >= start) & (t < end)


def dsv4_lengths(T, B, Q, sparse_topk_lens, seq_lens, cum_seq_lens_q, topk):
    """SWA: ``min(seq_len - q_len + q_idx + 1, 128)`` leading columns (0 if negative);
    compressed: ``sparse_topk_lens - 128`` leading columns (clamped to [0, TOPK - 128])."""
    req, qi, ql, inb = token_map(T, B, Q, cum_seq_lens_q, sparse_topk_lens.device)
    visible = seq_lens.long()[req] - ql + qi + 1 if B else torch.zeros_like(req)
    zero = torch.zeros_like(req)
    swa_len = torch.where(inb, visible.clamp(0, SWA_COLS), zero).to(I32)
    cmp_len = torch.where(inb, (sparse_topk_lens.long() - SWA_COLS).clamp(0, topk - SWA_COLS),
                          zero).to(I32)
    return swa_len, cmp_len


def v32_lengths(T, B, Q, seq_lens, cum_seq_lens_q, K):
    req, _, _, inb = token_map(T, B, Q, cum_seq_lens_q, seq_lens.device)
    n = seq_lens.long()[req].clamp(0, K) if B else torch.zeros_like(req)
    return torch.where(inb, n, torch.zeros_like(n)).to(I32)
