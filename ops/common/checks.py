"""Input validation shared by all ops.

Every op validates shapes, dtypes and layouts before it writes anything, raising TypeError
(wrong dtype) or ValueError (wrong shape, layout or value) with the argument's name and what
was expected. Value checks (e.g. a slot beyond the cache) need the data on the host: they always
run for CPU tensors; for CUDA tensors they would synchronize the hot path, so they run only when
``SPARSE_MLA_CHECK_VALUES=1`` (kernels still never touch memory outside the cache: they skip
such entries). They never run on fake tensors (torch.compile tracing) or during graph capture.
"""
from __future__ import annotations

import os

import torch

from sparse_mla.ops.common import formats

INDEX_DTYPES = (torch.int32, torch.int64)
BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)


def expect_dtype(name: str, t: torch.Tensor, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = tuple(dtypes) if isinstance(dtypes, (tuple, list)) else (dtypes,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {str(t.dtype).removeprefix('torch.')}")


def expect_shape(name: str, t: torch.Tensor, shape) -> None:
    """``shape`` entries are ints or None (any size)."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def expect_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride(-1) == 1), "
                         f"got strides {t.stride()}")


def expect_tensor(name: str, t: torch.Tensor, dtypes, shape) -> None:
    """A tensor the kernels read or write row by row: dtype among ``dtypes``, ``shape``
    (entries ints or None, see :func:`expect_shape`) and a contiguous last dimension."""
    expect_dtype(name, t, dtypes)
    expect_shape(name, t, shape)
    expect_last_dim_contiguous(name, t)


def expect_vector(name: str, t: torch.Tensor, dtypes, *, at_least: int | None = None,
                  at_most: int | None = None, note: str = "") -> None:
    """A 1-D per-token / per-request list with at least ``at_least`` entries (persistent
    buffers may be longer) or at most ``at_most`` (``note`` says why), unit stride."""
    expect_dtype(name, t, dtypes)
    if t.dim() != 1 or (at_least is not None and t.shape[0] < at_least) or (
            at_most is not None and t.shape[0] > at_most):
        bound = (f" with at least {at_least} entries" if at_least is not None else "") + (
            f" with at most {at_most} entries" if at_most is not None else "")
        raise ValueError(f"{name} must be 1-D{bound}{note}, got shape {list(t.shape)}")
    expect_last_dim_contiguous(name, t)


def expect_block_table(name: str, t: torch.Tensor, min_rows: int | None = None) -> None:
    """An int32 ``[num_reqs, max_blocks]`` block table (at least ``min_rows`` rows where
    given: persistent tables may be taller), last dimension contiguous."""
    expect_dtype(name, t, torch.int32)
    if t.dim() != 2 or (min_rows is not None and t.shape[0] < min_rows):
        want = "[num_reqs, max_blocks]" if min_rows is None else f"[>= {min_rows}, max_blocks]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    expect_last_dim_contiguous(name, t)


def expect_scalar_tensor(name: str, t: torch.Tensor) -> None:
    """A scale passed as a one-element fp32 device tensor (read by the kernels: no sync)."""
    expect_dtype(name, t, torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one scalar (one fp32 element), got shape "
                         f"{list(t.shape)}")


def unit_stride(t):
    """``t`` with a unit stride in its last dimension: ``t`` itself, or a contiguous copy.

    Kernels here and FlashMLA's take index lists, lengths and sinks by base pointer (index
    lists with their row stride), so an argument given as a strided view, e.g. every second
    column of a wider list, is copied first: read as it is, its elements are the wrong ones
    (lab/perf-log.md, "Edges of the ops"). None passes through."""
    if t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def expect_same_device(**tensors) -> None:
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devs}")


def expect_int(name: str, v, lo=None, hi=None) -> None:
    if isinstance(v, torch.SymInt):      # symbolic size while tracing with dynamic shapes
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) or t.device.type == "meta"


def value_checks_enabled(*tensors) -> bool:
    # ordered cheapest-first for the usual GPU call (switch off): per-call host time
    # (lab/perf-history.md, "HF attention call")
    present = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" for t in present) and \
            os.environ.get("SPARSE_MLA_CHECK_VALUES", "") in ("", "0"):
        return False
    if any(is_fake(t) for t in present):
        return False
    if all(t.device.type == "cpu" for t in present):
        return True
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


# Value checks. Each reads the device (call them only where ``value_checks_enabled``) and
# names the argument, what was expected and the first entry that is not.

def _first(bad: torch.Tensor) -> int | None:
    """Flat index of the first True of ``bad``, or None."""
    flat = bad.reshape(-1)
    return int(flat.nonzero()[0, 0]) if flat.numel() and bool(flat.any()) else None


def expect_values_in(name: str, t: torch.Tensor, lo: int, hi: int | None = None,
                     note: str = "", entry: str = "entry") -> None:
    """Every value of ``t`` in [lo, hi] (``hi`` None: >= lo), or an error naming the first
    one outside."""
    flat = t.reshape(-1)
    i = _first((flat < lo) if hi is None else (flat < lo) | (flat > hi))
    if i is not None:
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {want}{note}; {entry} {i} has {int(flat[i])}")


def expect_indices(name: str, t: torch.Tensor, end: int, note: str = "",
                   entry: str = "entry") -> None:
    """Every value of ``t`` an index in [0, end) (``note`` names what it indexes)."""
    flat = t.reshape(-1)
    i = _first((flat < 0) | (flat >= end))
    if i is not None:
        raise ValueError(f"{name} must be in [0, {end}){note}; {entry} {i} has {int(flat[i])}")


def expect_query_starts(name: str, starts: torch.Tensor, length: str = "query_len",
                        lo: int | None = None, hi: int | None = None,
                        note: str = "") -> torch.Tensor:
    """``starts`` (a request's first query token, batch size + 1 entries: vLLM's
    ``query_start_loc``, FlashInfer's ``cum_seq_lens_q``) non-decreasing, and where given its
    first entry >= ``lo`` and its last <= ``hi`` (``note`` says what they index). Returns the
    requests' query lengths (int64; ``length`` names them in the message)."""
    s = starts.long()
    if lo is not None and s.numel() and int(s[0]) < lo:
        raise ValueError(f"{name}[0] must be >= {lo}{note}, got {int(s[0])}")
    if hi is not None and s.numel() and int(s[-1]) > hi:
        raise ValueError(f"{name}[-1] must be <= {hi}{note}, got {int(s[-1])}")
    lens = s[1:] - s[:-1]
    r = _first(lens < 0)
    if r is not None:
        raise ValueError(f"{name} must be non-decreasing; request {r} has {length} "
                         f"{int(lens[r])}")
    return lens


def expect_seq_lens_cover(seq_lens: torch.Tensor, query_lens: torch.Tensor,
                          length: str = "query_len", note: str = "") -> None:
    """Every request's ``seq_lens`` entry (its tokens so far, this step's included) at least
    its query length (``length`` names it; ``note`` says why it matters)."""
    sl = seq_lens.long()
    r = _first(sl < query_lens)
    if r is not None:
        raise ValueError(f"seq_lens must be >= the request's {length}{note}: request {r} has "
                         f"seq_len {int(sl[r])} < {length} {int(query_lens[r])}")


def expect_active_slots(name: str, idx: torch.Tensor, ncols: torch.Tensor, capacity: int,
                        what: str = "a slot in [0, {capacity})") -> None:
    """Rows of index list ``idx`` [T, K]: every non-negative entry in a row's first
    ``ncols[t]`` columns addresses one of ``capacity`` cache rows (``what`` says what one is,
    with ``{capacity}`` filled in); negative entries mean "skip"."""
    if idx.numel() == 0:
        return
    cols = torch.arange(idx.shape[1], device=idx.device)
    active = (cols.unsqueeze(0) < ncols.long().unsqueeze(1)) & (idx >= 0)
    bad = (active & (idx.long() >= capacity)).nonzero()
    if bad.numel():
        t, j = int(bad[0, 0]), int(bad[0, 1])
        raise ValueError(f"{name}[{t}, {j}] = {int(idx[t, j])} is not "
                         f"{what.format(capacity=capacity)}")


def expect_request_ids(name: str, tokens: torch.Tensor, req: torch.Tensor, R: int) -> None:
    """``req[i]``, the request of token ``tokens[i]``, a row of the block table (``R`` rows)."""
    i = _first((req < 0) | (req >= R))
    if i is not None:
        raise ValueError(f"{name}[{int(tokens[i])}] = {int(req[i])} is not a request id in "
                         f"[0, {R}) (block_table rows)")


def expect_tokens_in_requests(name: str, tokens: torch.Tensor, req: torch.Tensor,
                              query_start_loc: torch.Tensor, R: int) -> None:
    """Every token ``tokens[i]`` belongs to request ``req[i]``: 0 <= req < R and
    query_start_loc[req] <= token < query_start_loc[req + 1]."""
    if tokens.numel() == 0:
        return
    expect_request_ids(name, tokens, req, R)
    qsl = query_start_loc.long()
    i = _first((tokens < qsl[req]) | (tokens >= qsl[req + 1]))
    if i is not None:
        r = int(req[i])
        raise ValueError(f"token {int(tokens[i])} is mapped by {name} to request {r}, whose "
                         f"tokens are [{int(qsl[r])}, {int(qsl[r + 1])})")


def expect_table_covers(name: str, block_table: torch.Tensor, req: torch.Tensor,
                        last_local: torch.Tensor, block_size: int, what: str) -> None:
    """Request-local entry ``last_local[i]`` (entries >= 0 only) of request ``req[i]`` lies
    inside the block table ``name``."""
    need = torch.where(last_local >= 0, last_local // block_size, -1)
    i = _first(need >= block_table.shape[1])
    if i is not None:
        raise ValueError(f"{name} has {block_table.shape[1]} blocks per request, too few for "
                         f"{what} {int(last_local[i])} of request {int(req[i])} (block "
                         f"{int(need[i])}, block_size {block_size})")


def expect_slots_in_range(name: str, slots: torch.Tensor, capacity: int) -> None:
    """Negative slots mean "skip"; any other slot must address a row of the cache."""
    if slots.numel() == 0:
        return
    hi = int(slots.max())
    if hi >= capacity:
        raise ValueError(f"{name} holds slot {hi}, but the cache has only {capacity} slots "
                         f"(num_blocks * block_size)")


def paged_cache_block_size(name: str, cache: torch.Tensor, fmt: formats.PagedFormat,
                           block_size: int | None) -> int:
    """Validate a paged cache view and return its block size.

    Accepted views: ``[num_blocks, bytes]`` (block size from ``block_size``),
    ``[num_blocks, block_size, B]`` or FlashMLA's ``[num_blocks, block_size, 1, B]`` with
    ``B = fmt.bytes_per_token``. Each block's first ``block_size * B`` bytes must be contiguous;
    blocks are ``stride(0)`` bytes apart (>= block_size * B).
    """
    expect_dtype(name, cache, BYTE_DTYPES)
    B = fmt.bytes_per_token
    if cache.dim() == 2:
        if block_size is None:
            raise ValueError(f"{name} is a 2-D [num_blocks, bytes] view: pass block_size")
        bs = block_size
        if cache.stride(1) != 1:
            raise ValueError(f"{name} must have stride(1) == 1, got {cache.stride()}")
        if cache.shape[1] < bs * B:
            raise ValueError(f"{name} has {cache.shape[1]} bytes per block, fewer than "
                             f"block_size * {B} = {bs * B} for format {fmt.name}")
    elif cache.dim() in (3, 4):
        if cache.shape[-1] != B:
            raise ValueError(f"{name} last dimension must be {B} bytes per token for format "
                             f"{fmt.name}, got {cache.shape[-1]}")
        if cache.dim() == 4 and cache.shape[2] != 1:
            raise ValueError(f"{name} 4-D view must be [num_blocks, block_size, 1, {B}], "
                             f"got {list(cache.shape)}")
        bs = cache.shape[1]
        if block_size is not None and block_size != bs:
            raise ValueError(f"block_size={block_size} does not match {name}.shape[1]={bs}")
        if cache.stride(-1) != 1 or (bs > 1 and cache.stride(1) != B):
            raise ValueError(f"{name} tokens must be packed {B} bytes apart inside a block "
                             f"(stride(1) == {B}, stride(-1) == 1), got strides {cache.stride()}")
    else:
        raise ValueError(f"{name} must be 2-D [num_blocks, bytes], 3-D [num_blocks, block_size, "
                         f"{B}] or 4-D [num_blocks, block_size, 1, {B}], got {list(cache.shape)}")
    expect_int("block_size", bs, 1)
    if cache.shape[0] > 1 and cache.stride(0) < bs * B:
        raise ValueError(f"{name}.stride(0) = {cache.stride(0)} bytes is smaller than a block "
                         f"(block_size * {B} = {bs * B})")
    if cache.shape[0] > 1 and cache.stride(0) % 4:
        raise ValueError(f"{name}.stride(0) must be a multiple of 4 bytes (bf16 / fp32 fields), "
                         f"got {cache.stride(0)}")
    if not is_fake(cache) and cache.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address")
    return bs


def block_stride(cache: torch.Tensor, fmt: formats.PagedFormat, block_size: int) -> int:
    """Bytes between block bases (irrelevant, and then reported as minimal, for one block)."""
    return cache.stride(0) if cache.shape[0] > 1 else block_size * fmt.bytes_per_token


def block_bytes_view(cache: torch.Tensor, fmt: formats.PagedFormat, block_size: int):
    """``[num_blocks, block_size * B]`` uint8 view of the addressable bytes of each block."""
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    nb = cache.shape[0]
    stride0 = block_stride(cache, fmt, block_size)
    return raw.as_strided((nb, block_size * fmt.bytes_per_token), (stride0, 1),
                          raw.storage_offset())
