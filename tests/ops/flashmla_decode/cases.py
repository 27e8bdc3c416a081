"""Random FlashMLA-style decode / prefill inputs with every corner docs/semantics.md §9 asks for.

Value ranges follow FlashMLA's own tests (tests/test_flash_mla_sparse_decoding.py): q ~ randn
clamped to ±1, K rows ~ randn / 10 clamped to ±1. docs/semantics.md §9's tolerances (FlashMLA's) are
calibrated for that scale: with K ~ randn both FlashMLA and this kernel exceed abs 1e-3 on a
few near-zero outputs (bf16 P in P·V), measured on an H200.
"""
import torch

from sparse_mla.ops.cache_insert import (compressed_insert_v41, quantize_insert_v32,
                                         quantize_insert_v4)
from sparse_mla.ops.common import checks, formats

POISON = 0xFF           # e4m3 0xFF is NaN: a kernel that reads an unused row produces NaN


def paged_cache(fmt, n_rows, block_size, device, g, extra_pages=0, pad_bytes=0):
    """A cache whose first ``n_rows`` slots hold random rows; every other byte is NaN poison.
    Pages are padded by ``576 * extra_pages + pad_bytes`` bytes."""
    nb = n_rows // block_size + 2
    f = formats.get_format(fmt)
    cache = formats.alloc_paged_cache(
        fmt, nb, block_size, device=device, fill=POISON,
        page_bytes=f.page_bytes(block_size) + 576 * extra_pages + pad_bytes)
    x = (torch.randn(n_rows, 512, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16).to(device)
    slots = torch.arange(n_rows, device=device)
    if fmt == "v4":
        quantize_insert_v4(x, cache, slots)
    elif fmt in formats.V41_RECORD_OF:
        identity = torch.cat([torch.ones(1, 32), torch.zeros(1, 32)], dim=1).to(device)
        compressed_insert_v41(x, cache, slots, torch.zeros_like(slots), identity, 1,
                              cache_format=fmt)
    else:
        rope = (torch.randn(n_rows, 64, generator=g) / 10).clamp(-1, 1)
        quantize_insert_v32(x, rope.to(torch.bfloat16).to(device), cache, slots)
    return cache


def index_rows(b, s_q, width, n_rows, g, invalid_frac=0.1):
    """Distinct valid ids with -1 holes; the last batch row is all -1 (no key)."""
    idx = torch.stack([torch.randperm(n_rows, generator=g)[:width] if width <= n_rows else
                       torch.randint(0, n_rows, (width,), generator=g)
                       for _ in range(b * s_q)]).view(b, s_q, width).to(torch.int32)
    holes = torch.rand(b, s_q, width, generator=g) < invalid_frac
    idx[holes] = -1
    if b > 1:
        idx[-1] = -1
    return idx


def lengths(b, width, g):
    """Per batch row: full, partial and zero lengths."""
    lens = torch.randint(0, width + 1, (b,), generator=g, dtype=torch.int32)
    lens[0] = width
    if b > 2:
        lens[1] = 0
    return lens


def garbage_past_length(idx, lens, capacity):
    """``idx`` with every column at or past its batch row's length replaced by ids a kernel
    must never dereference there (docs/semantics.md §5.1: such entries may hold garbage): INT_MAX,
    -2, the capacity and past it, a NaN-poisoned unused slot and a real row's slot."""
    junk = torch.tensor([2 ** 31 - 1, -2, capacity, capacity + 1000, capacity - 1, 0],
                        dtype=idx.dtype)
    cols = torch.arange(idx.shape[2])
    past = cols[None, None, :] >= lens.cpu().long()[:, None, None]
    fill = junk[(cols + torch.arange(idx.shape[1])[:, None]) % junk.numel()]
    return torch.where(past, fill.expand_as(idx), idx.cpu()).to(idx.device)


def decode_case(device, *, b, s_q, h, fmt="v4", bs=64, topk=128, extra=True, extra_bs=2,
                extra_topk=64, use_lengths=True, sink="random", seed=0, noncontig_q=False,
                pad_bytes=0, extra_pad_bytes=None, extra_fmt=None):
    """``pad_bytes`` pads the pages of both caches, ``extra_pad_bytes`` (if given) the extra
    cache's instead. ``extra_fmt``: the extra cache's record where it differs from ``fmt``
    (passed on as ``extra_kv_format``)."""
    g = torch.Generator().manual_seed(seed)
    d = 576 if fmt == "v32" else 512
    n_main = max(3 * topk // 2, 8)
    q = torch.randn(b, s_q, 2 * h if noncontig_q else h, d, generator=g).clamp(-1, 1)
    q = q.to(torch.bfloat16)
    q = q[:, :, ::2] if noncontig_q else q
    a = dict(q=q.to(device), k_cache=paged_cache(fmt, n_main, bs, device, g,
                                                 pad_bytes=pad_bytes),
             indices=index_rows(b, s_q, topk, n_main, g).to(device), kv_format=fmt)
    if use_lengths:
        a["topk_length"] = lengths(b, topk, g).to(device)
        a["indices"] = garbage_past_length(a["indices"], a["topk_length"],
                                           _capacity(a["k_cache"], bs))
    if extra:
        n_extra = max(extra_topk + 5, 8)
        if extra_fmt is not None:
            a["extra_kv_format"] = extra_fmt
        a["extra_k_cache"] = paged_cache(
            extra_fmt or fmt, n_extra, extra_bs, device, g,
            pad_bytes=pad_bytes if extra_pad_bytes is None else extra_pad_bytes)
        a["extra_indices_in_kvcache"] = index_rows(b, s_q, extra_topk, n_extra, g).to(device)
        if use_lengths:
            a["extra_topk_length"] = lengths(b, extra_topk, g).to(device)
            a["extra_indices_in_kvcache"] = garbage_past_length(
                a["extra_indices_in_kvcache"], a["extra_topk_length"],
                _capacity(a["extra_k_cache"], extra_bs))
    if sink == "random":
        # ±inf sinks on the first two heads; a single head keeps a finite one (a +inf sink
        # zeroes every output, and a check of all-zero rows would prove nothing)
        s = torch.randn(h, generator=g)
        if h > 1:
            s[0] = float("inf")
            s[1] = float("-inf")
        a["attn_sink"] = s.to(device)
    return a


def out_of_cache_ids(capacity):
    """Ids a decode kernel must skip inside the lengths: -1 and every other id outside
    [0, capacity). FlashMLA itself skips only -1; unguarded, it faults on -2, -64 and INT_MAX
    and reads past the cache at the capacity and beyond (lab/perf-log.md, "Vendor decode
    route")."""
    return [-1, -2, -64, 2 ** 31 - 1, capacity, capacity + 1000]


def plant(idx, ids):
    """``ids`` written into row 0's first columns of every token (inside any length: the
    cases give batch row 0 the full width)."""
    idx = idx.clone()
    idx[0, :, :len(ids)] = torch.tensor(ids, dtype=idx.dtype, device=idx.device)
    return idx


def cache_view(cache, view, block_size, fmt="v4"):
    """``cache`` ([nb, bs, B] uint8) as another view the op accepts over the same bytes:
    FlashMLA's "4-D" [nb, bs, 1, B], a "2-D" [nb, bs * B] view (the caller passes
    block_size), or typed as "float8_e4m3fn" / "int8"."""
    if view == "4-D":
        return cache.unsqueeze(-2)
    if view == "2-D":
        return checks.block_bytes_view(cache, formats.get_format(fmt), block_size)
    return cache.view(getattr(torch, view))


def _capacity(cache, block_size):
    return cache.shape[0] * block_size


def prefill_case(device, *, s_q, h, s_kv, topk, seed=0, d=512):
    """Every 7th kv row is NaN and only columns past their row's ``topk_length`` point at
    them (docs/semantics.md §5.2 warns that FlashMLA may leak such a row); the rest hold ids in
    [-2, s_kv + 3), some of them invalid. ``d``: d_qk, 512 (V4) or 576 (V3.2)."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(s_kv + 4, 1, d, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    kv[s_kv:] = float("nan")                       # rows beyond s_kv: never valid
    unused = torch.arange(0, s_kv, 7)
    kv[unused] = float("nan")
    kv = kv[:s_kv]
    idx = torch.randint(-2, s_kv + 3, (s_q, 1, topk), generator=g, dtype=torch.int32)
    idx = torch.where((idx >= 0) & (idx < s_kv) & (idx % 7 == 0), idx + 1, idx)
    extreme = torch.tensor([-2 ** 31, 2 ** 31 - 1, s_kv + 1000], dtype=torch.int32)[:topk]
    idx[0, 0, :extreme.numel()] = extreme          # row 0 keeps its whole width: all used
    lens = torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32)
    lens[0] = topk
    if s_q > 2:
        lens[1] = 0                                # a row without keys: out 0, lse +inf
    past = torch.arange(topk)[None, :] >= lens[:, None].long()
    idx[:, 0] = torch.where(past, unused[torch.arange(topk) % unused.numel()].to(idx.dtype),
                            idx[:, 0])
    sink = torch.randn(h, generator=g)
    if h > 1:
        sink[0], sink[1] = float("inf"), float("-inf")
    return dict(q=torch.randn(s_q, h, d, generator=g).clamp(-1, 1).to(torch.bfloat16)
                .to(device),
                kv=kv.to(device), indices=idx.to(device), topk_length=lens.to(device),
                attn_sink=sink.to(device), sm_scale=d ** -0.5)


# FlashMLA's own V3.2 prefill test classes (tests/test_flash_mla_sparse_prefill.py upstream):
# (name, s_q, h, s_kv, topk). Regular and irregular s_kv / topk, s_q 1 / 62 / 213 / 1024.
V32_PREFILL_CLASSES = [
    ("regular", 62, 128, 4096, 2048),
    ("regular_h64", 213, 64, 8192, 2048),
    ("irregular_skv", 62, 128, 592, 512),
    ("irregular_topk", 213, 64, 1234, 1000),
    ("sq1", 1, 128, 4096, 2048),
    ("sq1024", 1024, 128, 4096, 2048),
    ("sq1024_h64", 1024, 64, 8192, 1024),
]


def v32_prefill_case(device, *, s_q, h, s_kv, topk, seed=0, out_of_range=False,
                     invalid_rows=0, lengths=True):
    """A 576-wide V3.2 prefill in FlashMLA's test style: distinct ids in [0, s_kv) per row
    (topk may exceed s_kv: then ids repeat), q ~ randn clamped, kv ~ randn / 10.

    ``out_of_range``: about a tenth of each row's ids are s_kv..s_kv + 999 or -1 (FlashMLA's
    "invalid index" class). ``invalid_rows``: that many leading rows hold only invalid ids
    (all -1 / >= s_kv): out 0 and lse +inf whatever the sink. ``lengths``: random
    ``topk_length`` per row (columns past it point at NaN rows, which must stay unread)."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(s_kv, 1, 576, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    if topk <= s_kv:
        idx = torch.stack([torch.randperm(s_kv, generator=g)[:topk] for _ in range(s_q)])
    else:
        idx = torch.randint(0, s_kv, (s_q, topk), generator=g)
    idx = idx.to(torch.int32)
    if out_of_range:
        bad = torch.rand(s_q, topk, generator=g) < 0.1
        junk = torch.where(torch.rand(s_q, topk, generator=g) < 0.5, -1,
                           s_kv + torch.randint(0, 1000, (s_q, topk), generator=g))
        idx = torch.where(bad, junk.to(torch.int32), idx)
    idx[:invalid_rows] = torch.where(torch.arange(topk) % 2 == 0, -1, s_kv + 5).to(torch.int32)
    a = dict(q=torch.randn(s_q, h, 576, generator=g).clamp(-1, 1).to(torch.bfloat16),
             kv=kv, indices=idx.unsqueeze(1), sm_scale=576 ** -0.5)
    if lengths:
        lens = torch.randint(1, topk + 1, (s_q,), generator=g, dtype=torch.int32)
        lens[-1] = topk
        nan_rows = torch.arange(0, s_kv, 97)
        kv[nan_rows] = float("nan")
        # ids of NaN rows only past the length; inside it, moved to the next row
        inside = torch.arange(topk)[None, :] < lens[:, None].long()
        hit = (idx % 97 == 0) & (idx >= 0) & (idx < s_kv)
        idx = torch.where(inside & hit, idx + 1, idx)
        idx = torch.where(~inside, nan_rows[torch.arange(topk) % nan_rows.numel()]
                          .to(torch.int32), idx)
        idx[:invalid_rows] = torch.where(torch.arange(topk) % 2 == 0, -1,
                                         s_kv + 5).to(torch.int32)
        a.update(indices=idx.unsqueeze(1), topk_length=lens)
    sink = torch.randn(h, generator=g)
    if h > 1:
        sink[0], sink[1] = float("inf"), float("-inf")
    a["attn_sink"] = sink
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
