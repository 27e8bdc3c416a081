"""The indexer's top-k in Triton: the K largest selection keys of each row (triton_kernels.py
writes them), without sorting the row.

One program per row, in passes over the row's keys (L2-resident after the scores kernel):
1. radix passes over the 32 score bits of the key (``CONFIG["bits"]`` each: four of 8 bits,
   a 256-bin histogram of the candidates whose higher bits match the prefix found so far)
   find T, the score bits of the K-th largest candidate, and ``need``, how many candidates
   scoring exactly T it takes;
2. one pass keeps every candidate scoring above T and the first ``need`` scoring T in column
   order (the lower ids: the tie rule), compacted to the front of the row in place;
3. those K keys are sorted (a bitonic sort of a power of two in registers) and written out as
   ids, -1 past the candidates.
The result is the order of the full int64 keys, so it equals ``torch.topk`` over the keys
(ops/indexer/triton_impl.select_from_keys) exactly, ties included. No host sync; the row's
candidate count bounds the work, not the width alone (``lim``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_mla.ops.indexer.triton_kernels import NOT_A_CANDIDATE

MIN_KEY = tl.constexpr(NOT_A_CANDIDATE)
# Largest K the kernel sorts in registers; wider selections go through torch.topk.
MAX_K = 2048
CONFIG = {"block": 4096, "warps": 8, "bits": 8}
INTERPRET_CONFIG = {"block": 32}


@triton.jit
def _score_bits(key):
    """The key's score bits as an unsigned 32-bit number in int64 (same order as the key's
    high half)."""
    return (key >> 32) + 2147483648


@triton.jit
def select_topk_kernel(key_ptr, key_s0, lim_ptr, width, out_ptr, out_s0, K,
                       BLOCK: tl.constexpr, KP: tl.constexpr, HAS_LIM: tl.constexpr,
                       BITS: tl.constexpr = 8):
    """``out[row, :K]`` <- ids of the row's K largest keys, in key order, then -1. Columns at
    or past ``lim[row]`` (``width`` without ``lim``) are not read. Overwrites the row's first
    columns with the selected keys. ``BITS`` per radix pass (32 / BITS passes of 2^BITS
    bins)."""
    row = tl.program_id(0).to(tl.int64)
    base = key_ptr + row * key_s0
    n = width
    if HAS_LIM:
        n = tl.minimum(tl.maximum(tl.load(lim_ptr + row), 0), width)
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.zeros((), tl.int64)
    krem = tl.zeros((), tl.int32)
    for p in tl.static_range(32 // BITS):
        shift = 32 - BITS * (p + 1)
        hist = tl.zeros((1 << BITS,), tl.int32)
        for s in range(0, n, BLOCK):
            j = s + cols
            key = tl.load(base + j, mask=j < n, other=MIN_KEY)
            u = _score_bits(key)
            match = (key != MIN_KEY) & ((u >> (shift + BITS)) == prefix)
            digit = tl.where(match, (u >> shift) & ((1 << BITS) - 1), 0).to(tl.int32)
            # masked-out columns land in bin 0 and are taken back out of it
            miss = BLOCK - tl.sum(match.to(tl.int32), axis=0)
            hist += tl.histogram(digit, 1 << BITS) - tl.where(bins == 0, miss, 0)
        if p == 0:
            krem = tl.minimum(tl.sum(hist, axis=0), K)
        # at_least[d]: matching candidates whose digit is d or more
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        d = tl.max(tl.where(at_least >= krem, bins, 0), axis=0)
        krem -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
        prefix = (prefix << BITS) + d.to(tl.int64)
    taken = tl.zeros((), tl.int32)
    ties = tl.zeros((), tl.int32)
    for s in range(0, n, BLOCK):
        j = s + cols
        key = tl.load(base + j, mask=j < n, other=MIN_KEY)
        u = _score_bits(key)
        cand = key != MIN_KEY
        eq = (cand & (u == prefix)).to(tl.int32)
        take = (cand & (u > prefix)) | ((eq != 0) & (ties + tl.cumsum(eq, axis=0) <= krem))
        pos = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        # pos <= j: each store lands on a column this or an earlier block already read
        tl.store(base + pos, key, mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        ties += tl.sum(eq, axis=0)
    tl.debug_barrier()          # the compacted keys were stored by other threads
    r = tl.arange(0, KP)
    sel = tl.load(base + r, mask=r < taken, other=MIN_KEY)
    sel = tl.sort(sel, descending=True)
    ids = tl.where(sel == MIN_KEY, -1, 4294967295 - (sel & 4294967295))
    tl.store(out_ptr + row * out_s0 + r, ids.to(tl.int32), mask=r < K)


def selectable(k: int) -> bool:
    return 1 <= k <= MAX_K


def select_topk(keys: torch.Tensor, out: torch.Tensor, lim: torch.Tensor | None = None):
    """``out`` [n, K] <- the K largest ``keys`` [n, width] of each row as column ids (key
    order, -1 for "not a candidate" and past the candidates); ``lim`` [n]: the row's columns
    from ``lim[row]`` on are not candidates and are not read. Overwrites ``keys``."""
    n, width = keys.shape
    k = out.shape[1]
    if n == 0:
        return
    if not selectable(k):
        raise ValueError(f"select_topk selects 1..{MAX_K} per row, got K={k}")
    if width == 0:
        out.fill_(-1)
        return
    cfg = {**CONFIG, **INTERPRET_CONFIG} if keys.device.type == "cpu" else CONFIG
    select_topk_kernel[(n,)](
        keys, keys.stride(0), keys if lim is None else lim, width, out, out.stride(0), k,
        BLOCK=cfg["block"], KP=triton.next_power_of_2(k), HAS_LIM=lim is not None,
        BITS=cfg["bits"], num_warps=cfg["warps"])
