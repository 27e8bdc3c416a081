"""Inputs and checks for the indexer tests.

``Case`` holds one batch: requests' tokens and compressed keys as the prefill op takes them
(dense keys per request) and the same keys in a paged indexer cache as the decode op reads
them. ``expected`` is an oracle written apart from ops/indexer/reference.py: one token at a
time, all heads in one einsum, selection by Python's ``sorted`` on (-score, id).
``assert_selection`` compares a route's rows with the oracle's, allowing swaps only between
entries whose float64 scores tie within the route's rounding (``tol``).
"""
from __future__ import annotations

import dataclasses

import torch

from sparse_mla.ops.indexer import format as fmt

E4M3 = torch.float8_e4m3fn


def e4m3_table():
    """Every finite e4m3fn value with its byte."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = b.view(E4M3).double()
    ok = ~v.isnan()
    return b[ok], v[ok]


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even e4m3fn bytes of float64 ``x`` (|x| <= 448) by search over every
    value: the closest one, and on a tie the one with an even mantissa."""
    b, v = e4m3_table()
    dist = (x.double().unsqueeze(-1) - v).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tie_even = (dist == best) & ((b.to(torch.int32) & 1) == 0)
    pick = torch.where(tie_even.any(-1, keepdim=True), tie_even, dist == best)
    idx = pick.to(torch.int8).argmax(dim=-1)
    return b[idx]


def bf16_exact(shape, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)


@dataclasses.dataclass
class Case:
    q: torch.Tensor            # [T, H, 128] bf16 or e4m3
    w: torch.Tensor            # [T, H] fp32
    keys: list                 # per request: [C_r, 128] float64 (what the cache holds)
    k: torch.Tensor            # [sum C_r, 128] bf16 or e4m3 (dense, for prefill)
    k_scale: torch.Tensor      # [sum C_r] fp32 or None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    positions: torch.Tensor
    ratio: int


def make_keys(n, g, fp8, scale=1.0):
    """``n`` keys as (values to pass, fp32 scales or None, float64 values they stand for)."""
    x = bf16_exact((n, fmt.DIM), g, scale)
    if not fp8:
        return x, None, x.double()
    e = torch.randint(-3, 4, (n,), generator=g)
    s = torch.exp2(e.float())
    vals = (x.float() / s.unsqueeze(1)).clamp(-448, 448).to(E4M3)
    return vals, s, vals.double() * s.double().unsqueeze(1)


def prefill_case(g, q_lens, k_lens, positions=None, heads=4, ratio=4, fp8=False,
                 q_fp8=False):
    """Requests with ``q_lens[r]`` tokens and ``k_lens[r]`` keys; positions default to the
    request's last tokens (a prefill of a prompt ending at k_len * ratio + 3)."""
    T = sum(q_lens)
    q = bf16_exact((T, heads, fmt.DIM), g)
    if q_fp8:
        q = q.float().to(E4M3)
    w = torch.randn(T, heads, generator=g)
    ks, scales, keys = [], [], []
    for c in k_lens:
        v, s, d = make_keys(c, g, fp8)
        ks.append(v)
        scales.append(s)
        keys.append(d)
    k = torch.cat(ks) if ks else torch.empty(0, fmt.DIM, dtype=torch.bfloat16)
    k_scale = torch.cat(scales) if fp8 else None
    if positions is None:
        positions = torch.cat([torch.arange(c * ratio + 3 - n, c * ratio + 3)
                               for n, c in zip(q_lens, k_lens)]).clamp_min(0)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    cuk = [0]
    for c in k_lens:
        cuk.append(cuk[-1] + c)
    return Case(q, w, keys, k, k_scale, torch.tensor(cu), torch.tensor(cuk),
                torch.as_tensor(positions, dtype=torch.long), ratio)


def paged(case: Case, g, block_size, poison=0xFF, spare_blocks=2):
    """The case's keys written into a paged indexer cache (fp8 when the case's keys are; every
    other byte ``poison``) and the block table [R, blocks + 1] (random block order, unused
    cells -1)."""
    fp8 = case.k_scale is not None
    need = [-(-k.shape[0] // block_size) for k in case.keys]
    nb = sum(need) + spare_blocks
    cache = fmt.alloc_cache(nb, block_size, fp8=fp8, fill=poison)
    perm = torch.randperm(nb, generator=g)
    bt = torch.full((len(need), max(need + [1]) + 1), -1, dtype=torch.int32)
    used = 0
    for r in range(len(case.keys)):
        bt[r, :need[r]] = perm[used:used + need[r]].to(torch.int32)
        used += need[r]
        for j in range(case.keys[r].shape[0]):
            row = int(case.cu_k[r]) + j
            write_entry(cache, int(bt[r, j // block_size]), j % block_size, block_size,
                        case.k[row], None if case.k_scale is None else case.k_scale[row])
    return cache, bt


def write_entry(cache, blk, off, block_size, value, scale):
    """Entry ``off`` of block ``blk``: bf16 ``value``, or e4m3 ``value`` bytes then fp32
    ``scale`` at the page's documented offsets (values of the block first, then scales)."""
    if scale is None:
        cache[blk, off] = value
        return
    page = cache.view(torch.uint8).as_strided((cache.shape[0], cache.stride(0)),
                                              (cache.stride(0), 1))
    page[blk, off * fmt.DIM:(off + 1) * fmt.DIM] = value.view(torch.uint8)
    tail = block_size * fmt.DIM + off * 4
    page[blk, tail:tail + 4] = scale.reshape(1).view(torch.uint8)


def scores(q, w, keys):
    """float64 sum_h w[h] relu(q[h] . key) of one token against [C, 128] ``keys``."""
    return (w.double().unsqueeze(1) * torch.einsum("hd,cd->hc", q.double(), keys).clamp_min(0)
            ).sum(0)


def expected(s, allowed, k):
    """Oracle row: ids of ``allowed`` (bool [C]) sorted by (-score, id), first k, -1 padded."""
    ids = sorted((j for j in range(s.shape[0]) if allowed[j]), key=lambda j: (-float(s[j]), j))
    ids = ids[:k]
    return ids + [-1] * (k - len(ids))


def prefill_oracle(case: Case, k):
    rows, score_rows, allowed_rows = [], [], []
    for r in range(len(case.keys)):
        keys = case.keys[r]
        for t in range(int(case.cu_q[r]), int(case.cu_q[r + 1])):
            s = scores(case.q[t], case.w[t], keys)
            n = min(keys.shape[0], (int(case.positions[t]) + 1) // case.ratio)
            allowed = torch.arange(keys.shape[0]) < n
            rows.append(expected(s, allowed, k))
            score_rows.append(s)
            allowed_rows.append(allowed)
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, k), score_rows, allowed_rows


def assert_selection(got, want, score_rows, allowed_rows, tol_rel=1e-4):
    """``got`` rows equal ``want`` rows up to swaps among scores tied within ``tol_rel`` of
    the row's score scale: same number of valid ids, left-aligned, no duplicates, only
    allowed ids, and every id one side has and the other lacks scores within the tolerance
    of the selection threshold; ``got``'s order non-increasing within the tolerance."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    for t in range(got.shape[0]):
        g_row, w_row = got[t].tolist(), want[t].tolist()
        n_valid = sum(1 for x in w_row if x >= 0)
        assert all(x >= 0 for x in g_row[:n_valid]) and all(x == -1 for x in g_row[n_valid:]), \
            f"row {t}: {g_row} vs oracle {w_row}"
        gs, ws = set(g_row[:n_valid]), set(w_row[:n_valid])
        assert len(gs) == n_valid, f"row {t} repeats an id: {g_row}"
        if gs == ws and g_row == w_row:
            continue
        s, allowed = score_rows[t], allowed_rows[t]
        assert all(bool(allowed[j]) for j in gs), f"row {t} selects a non-candidate: {g_row}"
        tol = tol_rel * max(float(s.abs().max()), 1e-30)
        threshold = float(s[w_row[n_valid - 1]])
        for j in gs ^ ws:
            assert abs(float(s[j]) - threshold) <= tol, (
                f"row {t}: id {j} (score {float(s[j])}) differs from the oracle's selection "
                f"beyond a tie (threshold {threshold}, tol {tol}): {g_row} vs {w_row}")
        sc = [float(s[j]) for j in g_row[:n_valid]]
        assert all(a >= b - tol for a, b in zip(sc, sc[1:])), f"row {t} out of order: {g_row}"


def decode_oracle(case: Case, block_table, num_blocks, block_size, k, width=None):
    """Oracle rows of a decode step over ``paged``'s cache: token t of request r may select
    entry j < (p + 1) // ratio (and j < ``width``) whose block id is in [0, num_blocks)."""
    rows, score_rows, allowed_rows = [], [], []
    for r in range(len(case.keys)):
        keys = case.keys[r]
        c = keys.shape[0]
        blk = block_table[r].long()
        for t in range(int(case.cu_q[r]), int(case.cu_q[r + 1])):
            n = (int(case.positions[t]) + 1) // case.ratio
            allowed = torch.tensor([
                j < n and (width is None or j < width) and j // block_size < blk.shape[0]
                and 0 <= int(blk[j // block_size]) < num_blocks for j in range(c)],
                dtype=torch.bool)
            s = scores(case.q[t], case.w[t], keys)
            rows.append(expected(s, allowed, k))
            score_rows.append(s)
            allowed_rows.append(allowed)
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, k), score_rows, allowed_rows


def decode_case(g, k_lens, next_n=1, heads=4, ratio=4, fp8=False, q_fp8=False):
    """``prefill_case`` shaped as a decode step: ``next_n`` tokens per request, the last at
    position k_len * ratio + 2 (it sees all k_len entries); also returns seq_lens."""
    case = prefill_case(g, [next_n] * len(k_lens), k_lens, heads=heads, ratio=ratio, fp8=fp8,
                        q_fp8=q_fp8)
    seq_lens = torch.tensor([c * ratio + 3 for c in k_lens], dtype=torch.int32)
    return case, seq_lens


def to_device(cache, device):
    """``cache`` on ``device`` with the same page layout (``Tensor.to`` would pack a strided
    view's rows together and drop the pages' padding)."""
    if str(cache.device) == str(torch.device(device)):
        return cache
    from sparse_mla.tests.helpers import storage_bytes
    raw = storage_bytes(cache).to(device).view(cache.dtype)
    return raw.as_strided(cache.shape, cache.stride(), cache.storage_offset())
