"""Inputs and a brute-force oracle for the V4.1 two-level indexer tests.

The oracle follows vLLM's Python / Triton path literally (``candidate_blocks.py``), one token at
a time and apart from ops/indexer_v41: the token's dense float64 logits over its request's
keys (tests/ops/indexer/cases.py ``scores``), then the masks. Level 1: block c's score is the
NaN-propagating max of its causal, readable logits (-inf without one), the block of position
n - 1 is +inf, the NB best blocks by (NaN first, larger score, lower id) are listed, -inf ones
as -1. Level 2: logits outside the listed blocks become non-candidates, then the top-k by
(-score, id) (cases.py ``expected``).

``int_case`` builds batches whose logits every route computes exactly (small integers in bf16,
e4m3 keys scaled by powers of two): drawn from a few distinct key rows, so many logits tie
exactly, across blocks and inside them, and every route must give the oracle's rows to the id.
"""
from __future__ import annotations

import math

import torch

from sparse_mla.ops.indexer import format as fmt
from sparse_mla.tests.ops.indexer import cases


def int_case(g, q_lens, k_lens, *, ratio, heads=2, fp8=True, distinct=3, positions=None):
    """``cases.prefill_case``'s batch with exactly computable logits (module docstring);
    positions default to each request's last tokens, the last one seeing all its keys."""
    T = sum(q_lens)
    q = torch.randint(-1, 2, (T, heads, fmt.DIM), generator=g).to(torch.bfloat16)
    w = torch.tensor([0.5, 1.0, 2.0, -1.0])[torch.randint(0, 4, (T, heads), generator=g)]
    vocab = torch.randint(-1, 3, (distinct, fmt.DIM), generator=g).double()
    ks, scales, keys = [], [], []
    for c in k_lens:
        rows = vocab[torch.randint(0, distinct, (c,), generator=g)]
        if fp8:
            s = torch.exp2(torch.randint(-2, 2, (c,), generator=g).double())
            ks.append((rows / s.unsqueeze(1)).to(cases.E4M3))
            scales.append(s.float())
        else:
            ks.append(rows.to(torch.bfloat16))
        keys.append(rows)
    k = torch.cat(ks) if ks else torch.empty(0, fmt.DIM, dtype=torch.bfloat16)
    if positions is None:
        positions = torch.cat([torch.arange(c * ratio - n, c * ratio)
                               for n, c in zip(q_lens, k_lens)]).clamp_min(0)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()))
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0).tolist()))
    return cases.Case(q, w, keys, k, torch.cat(scales) if fp8 else None, cu_q, cu_k,
                      torch.as_tensor(positions, dtype=torch.long), ratio)


def decode_seq_lens(case, next_n):
    """seq_lens of a decode step over ``case`` (next_n tokens per request): the request's
    last token's position + 1."""
    last = case.cu_q[1:] - 1
    return (case.positions[last] + 1).to(torch.int32)


def readable_fn(block_table, num_blocks, block_size):
    """readable(r, j): entry j of request r has a block id in [0, num_blocks) (§11.3)."""
    if block_table is None:
        return lambda r, j: True

    def readable(r, j):
        col = j // block_size
        return col < block_table.shape[1] and 0 <= int(block_table[r, col]) < num_blocks
    return readable


def _block_rank(scores, c):
    s = scores[c]
    return (0 if math.isnan(s) else 1, 0.0 if math.isnan(s) else -s, c)


def token_rows(case, r, t, cb, readable, width=None):
    """(logits, live mask, causal count n, block scores) of token t of request r."""
    keys = case.keys[r]
    n = (int(case.positions[t]) + 1) // case.ratio
    n = max(0, min(n, keys.shape[0] if width is None else width))
    s = cases.scores(case.q[t], case.w[t], keys)
    live = torch.tensor([j < n and readable(r, j) for j in range(keys.shape[0])],
                        dtype=torch.bool)
    blocks = []
    for c in range(-(-n // cb)):
        vals = [float(s[j]) for j in range(c * cb, min((c + 1) * cb, keys.shape[0]))
                if live[j]]
        if c == (n - 1) // cb:
            blocks.append(math.inf)
        elif any(math.isnan(v) for v in vals):
            blocks.append(math.nan)
        else:
            blocks.append(max(vals, default=-math.inf))
    return s, live, n, blocks


def level1(case, topk, nb, cb, readable=None, width=None):
    """Oracle (out [T, topk], candidates [T, nb], per-token (logits, live, block scores))."""
    readable = readable or readable_fn(None, 0, 1)
    outs, cands, rows = [], [], []
    for r in range(len(case.keys)):
        for t in range(int(case.cu_q[r]), int(case.cu_q[r + 1])):
            s, live, n, blocks = token_rows(case, r, t, cb, readable, width)
            outs.append(cases.expected(s, live, topk))
            listed = sorted((c for c in range(len(blocks)) if blocks[c] != -math.inf),
                            key=lambda c: _block_rank(blocks, c))[:nb]
            cands.append(listed + [-1] * (nb - len(listed)))
            rows.append((s, live, blocks))
    return (torch.tensor(outs, dtype=torch.int32).reshape(-1, topk),
            torch.tensor(cands, dtype=torch.int32).reshape(-1, nb), rows)


def level2(case, candidates, topk, cb, readable=None, width=None):
    """Oracle out [T, topk] of the candidate users, and per-token (logits, allowed)."""
    readable = readable or readable_fn(None, 0, 1)
    outs, rows = [], []
    for r in range(len(case.keys)):
        for t in range(int(case.cu_q[r]), int(case.cu_q[r + 1])):
            s, live, _, _ = token_rows(case, r, t, cb, readable, width)
            listed = set(candidates[t].tolist())
            allowed = torch.tensor([bool(live[j]) and j // cb in listed
                                    for j in range(s.shape[0])], dtype=torch.bool)
            outs.append(cases.expected(s, allowed, topk))
            rows.append((s, allowed))
    return torch.tensor(outs, dtype=torch.int32).reshape(-1, topk), rows


def assert_blocks(got, want, rows, tol_rel):
    """Candidate lists equal up to swaps of blocks whose scores tie within ``tol_rel`` (the
    pinned +inf block must match exactly; NaN blocks are compared exactly)."""
    got, want = got.cpu(), want.cpu()
    for t, (_, _, blocks) in enumerate(rows):
        finite = [b for b in blocks if math.isfinite(b)]
        big = 2 * max([abs(b) for b in finite], default=1.0) + 1
        s = torch.tensor([big if b == math.inf else (big + 1 if math.isnan(b) else b)
                          for b in blocks] or [0.0], dtype=torch.float64)
        allowed = torch.tensor([b != -math.inf for b in blocks] or [False])
        cases.assert_selection(got[t:t + 1], want[t:t + 1], [s], [allowed], tol_rel)
