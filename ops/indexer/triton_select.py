"""The indexer's top-k in Triton: the K largest selection keys of each row (triton_kernels.py
writes them), split across the GPU, without sorting the row.

A row is cut into chunks of ``CH`` keys. Each program holds one chunk in registers and keeps
its K largest (``_chunk_top``): a radix select over the 64 bits of the key, a byte at a time
from the top, stopping as soon as the keys that share the prefix found so far are exactly the
ones still needed. Keys are unique within a row (the low half is the id), so the kept set is
the chunk's K largest exactly, ties included. The kept keys are written, unordered, to a
part row of ``KP`` (K rounded up to a power of two) slots, the rest not-a-candidate.
Part rows are chunked again until one chunk holds a row's survivors; that last program sorts
its K keys (a bitonic sort in registers) and writes the ids decoded from them, -1 past the
candidates.

So a long row is spread over many programs (one program per row could not fill the GPU at
small batch), each level shrinks the data by CH / KP, and the result is the order of the full
int64 keys: it equals ``torch.topk`` over the keys (triton_impl.select_from_keys) exactly. No
host sync; columns at or past a row's candidate count (``lim``) are not read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The selection key of an entry a token may not select (int64 min): never kept.
NOT_A_CANDIDATE = -(2 ** 63)
MIN_KEY = tl.constexpr(NOT_A_CANDIDATE)
# Largest K the kernels select; wider selections go through torch.topk.
MAX_K = 2048
# A row of at most ``row_max`` keys is one program's; longer rows are cut into chunks of
# ``chunk`` keys (at least 4 K, so each level keeps at most a quarter of its input); ``warps``
# per 4,096 keys a program holds, 4..16. A level takes about 20 us on an H200 whatever its
# size (its radix passes are chains of block-wide reductions), so at b 64 x 16k the row cut in
# four then merged (43 us) beat one program a row (56 us); 16 warps beat 8 by 3 us
# (docs/PERF.md, "Lightning indexer").
CONFIG = {"chunk": 4096, "row_max": 4096, "warps": 16}
INTERPRET_CONFIG = {"chunk": 64, "row_max": 64}


@triton.jit
def _chunk_top(key, K):
    """Which of the keys ``key`` [CH] (int64, unique but for ``MIN_KEY``, which is never
    kept) are the K largest: a mask, and how many it holds (min(K, candidates))."""
    valid = key != MIN_KEY
    CH: tl.constexpr = key.shape[0]
    bins = tl.arange(0, 256)
    count = tl.sum(valid.to(tl.int32), axis=0)
    krem = tl.minimum(count, K)
    # prefix: the top ``bits`` bits of the K-th largest key (arithmetic shifts keep the signed
    # order); keys above it are kept, and ``krem`` more among those equal to it
    prefix = tl.zeros((), tl.int64)
    bits = tl.zeros((), tl.int64)
    done = count <= K
    for p in tl.static_range(8):
        if not done:
            shift: tl.constexpr = 56 - 8 * p
            if p == 0:
                digit = ((key >> shift) + 128).to(tl.int32)
                match = valid
            else:
                digit = ((key >> shift) & 255).to(tl.int32)
                match = valid & ((key >> (shift + 8)) == prefix)
            # keys off the prefix land in bin 0 and are taken back out of it
            hist = tl.histogram(tl.where(match, digit, 0), 256) - tl.where(
                bins == 0, CH - tl.sum(match.to(tl.int32), axis=0), 0)
            above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)     # in bins > d
            # d: the highest digit with at least krem matching keys at or above it; one max
            # over (d, keys above d, keys at d) packed into an int64
            packed = (bins.to(tl.int64) << 42) | (above.to(tl.int64) << 21) | hist
            best = tl.max(tl.where(above + hist >= krem, packed, 0), axis=0)
            d = best >> 42
            krem -= ((best >> 21) & 0x1FFFFF).to(tl.int32)
            if p == 0:
                prefix = d - 128
            else:
                prefix = (prefix << 8) + d
            bits = tl.full((), 8 * (p + 1), tl.int64)
            done = (best & 0x1FFFFF).to(tl.int32) == krem
    # bits 0: every candidate is kept (no pass ran; a shift by 64 would be undefined)
    above_prefix = (key >> tl.maximum(64 - bits, 0)) >= prefix
    keep = valid & (above_prefix | (tl.zeros_like(key) == bits))
    return keep, tl.minimum(count, K)


@triton.jit
def keep_chunk(key, K, dst, KP: tl.constexpr):
    """The K largest of the keys ``key`` [CH] to ``dst[:KP]`` (unordered), the slots left
    not-a-candidate: one chunk's share of a row for the next level."""
    keep, taken = _chunk_top(key, K)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(dst + pos, key, mask=keep)
    r = tl.arange(0, KP)
    tl.store(dst + r, tl.full((KP,), MIN_KEY, tl.int64), mask=r >= taken)


@triton.jit
def partial_kernel(key_ptr, key_s0, lim_ptr, width, part_ptr, part_s0, K,
                   CH: tl.constexpr, KP: tl.constexpr, HAS_LIM: tl.constexpr):
    """Chunk pid1 of row pid0 -> its K largest keys in part[row, pid1 * KP:][:KP]."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = width
    if HAS_LIM:
        n = tl.minimum(tl.maximum(tl.load(lim_ptr + row), 0), width)
    j = c * CH + tl.arange(0, CH)
    key = tl.load(key_ptr + row * key_s0 + j, mask=j < n, other=MIN_KEY)
    keep_chunk(key, K, part_ptr + row * part_s0 + c * KP, KP)


@triton.jit
def final_kernel(key_ptr, key_s0, lim_ptr, width, out_ptr, out_s0, K,
                 CH: tl.constexpr, KP: tl.constexpr, HAS_LIM: tl.constexpr):
    """Row pid0's at most CH keys -> ``out[row, :K]``: the ids of its K largest, in key order,
    then -1. The kept keys are compacted to the front of the row in place (every key of the
    row is already in registers), then sorted."""
    row = tl.program_id(0).to(tl.int64)
    base = key_ptr + row * key_s0
    n = width
    if HAS_LIM:
        n = tl.minimum(tl.maximum(tl.load(lim_ptr + row), 0), width)
    j = tl.arange(0, CH)
    key = tl.load(base + j, mask=j < n, other=MIN_KEY)
    keep, taken = _chunk_top(key, K)
    tl.debug_barrier()          # every thread has read its keys before any is overwritten
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(base + pos, key, mask=keep)
    tl.debug_barrier()          # the compacted keys were stored by other threads
    r = tl.arange(0, KP)
    sel = tl.load(base + r, mask=r < taken, other=MIN_KEY)
    sel = tl.sort(sel, descending=True)
    ids = tl.where(sel == MIN_KEY, -1, 4294967295 - (sel & 4294967295))
    tl.store(out_ptr + row * out_s0 + r, ids.to(tl.int32), mask=r < K)


def selectable(k: int) -> bool:
    return 1 <= k <= MAX_K


def _cfg(device):
    return {**CONFIG, **INTERPRET_CONFIG} if device.type == "cpu" else CONFIG


def chunk_size(k: int, device) -> int:
    """Keys per program of a level for a top-``k``: ``CONFIG["chunk"]``, or 4 K where that
    is larger."""
    return max(_cfg(device)["chunk"], 4 * triton.next_power_of_2(k))


def select_topk(keys: torch.Tensor, out: torch.Tensor, lim: torch.Tensor | None = None):
    """``out`` [n, K] <- the K largest ``keys`` [n, width] of each row as ids decoded from the
    keys (key order, -1 for "not a candidate" and past the candidates); ``lim`` [n]: the row's
    columns from ``lim[row]`` on are not candidates and are not read. Overwrites ``keys`` where
    a row fits one chunk."""
    n, width = keys.shape
    k = out.shape[1]
    if n == 0:
        return
    if not selectable(k):
        raise ValueError(f"select_topk selects 1..{MAX_K} per row, got K={k}")
    if width == 0:
        out.fill_(-1)
        return
    finish(keys, width, out, lim)


def finish(keys: torch.Tensor, width: int, out: torch.Tensor, lim: torch.Tensor | None = None):
    """``select_topk`` once its arguments are checked: the levels of chunks, then the last
    program of each row (``keys`` holds at least ``width`` columns)."""
    n, k = out.shape
    kp = triton.next_power_of_2(k)
    ch = chunk_size(k, keys.device)
    warps = warps_for(ch)
    has_lim = lim is not None
    while width > max(ch, _cfg(keys.device)["row_max"]):   # a level: ch keys -> their kp largest
        parts = triton.cdiv(width, ch)
        part = torch.empty(n, parts * kp, dtype=torch.int64, device=keys.device)
        partial_kernel[(n, parts)](keys, keys.stride(0), lim if has_lim else keys, width, part,
                                   part.stride(0), k, CH=ch, KP=kp, HAS_LIM=has_lim,
                                   num_warps=warps)
        keys, width, has_lim = part, part.shape[1], False
    final_kernel[(n,)](keys, keys.stride(0), lim if has_lim else keys, width, out,
                       out.stride(0), k, CH=triton.next_power_of_2(width), KP=kp,
                       HAS_LIM=has_lim, num_warps=warps_for(triton.next_power_of_2(width)))


def warps_for(ch: int) -> int:
    """Warps of a program holding ``ch`` keys (``CONFIG["warps"]`` per 4,096)."""
    return max(4, min(16, CONFIG["warps"] * ch // 4096))
