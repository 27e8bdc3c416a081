"""Per-query index lists of the visible key columns of an additive attention mask.

HF's eager mask for DeepSeek-V4 is additive: 0 where a key is visible, ``finfo(dtype).min``
(sliding-window / padding part) or ``-inf`` (the compressor's ``block_bias``) where it is
not. Sparse attention needs, per query, the list of visible columns. The lists are built on
the mask's device with a width fixed by shapes alone, so nothing waits for the GPU.

Only 0 and "masked" are representable: a finite nonzero bias cannot be applied by a sparse
kernel. Rows holding one, or holding more visible columns than the width, are reported in
``bad`` so the caller can refuse them (CPU) or poison them with NaN (GPU, no sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_mla.ops.common.dispatch import triton_interpreting
from sparse_mla.ops.common.triton_utils import launch_compiled

# Rows per compaction chunk: bounds the temporaries (int64 scatter indices are 8 bytes per
# mask element) at about 256 MiB whatever the prompt length.
_CHUNK_ELEMENTS = 1 << 25


def is_masked(mask: torch.Tensor) -> torch.Tensor:
    """True where an additive mask hides a key: -inf or at most the dtype's minimum.

    (eager's ``finfo.min`` plus a score can round back to ``finfo.min`` but never above
    ``finfo.min / 2``, so the threshold separates the two kinds of entries.)"""
    return mask <= torch.finfo(mask.dtype).min / 2


def visible_index_lists(mask: torch.Tensor, width: int, flat: bool = False,
                        reuse: bool = False):
    """``(indices, lengths, bad)`` for an additive mask ``[B, S_q, N]``.

    indices: ``[B, S_q, width]`` int32, row r's visible columns in increasing order, then -1;
        with ``flat``, batch b's columns are offset by ``b * N`` (indices into the batch's
        keys flattened to ``[B * N]``).
    lengths: ``[B, S_q]`` int32, visible columns per row, clamped to ``width``.
    bad: ``[B, S_q]`` bool, rows with more than ``width`` visible columns or a finite
        nonzero bias (what sparse attention cannot reproduce exactly).

    On a GPU one Triton launch builds all three (the torch form below is a dozen launches
    per call, which HF's per-layer decode steps pay in host time); elsewhere torch ops.
    ``reuse``: on a GPU, small lists (decode steps) are written into buffers kept per
    device, stream and shape, overwritten by the next such call: for a caller that is done
    with them (in stream order) before it calls again, as the attention function is.
    """
    if mask.dim() != 3:
        raise ValueError(f"mask must have shape [batch, queries, keys], got {list(mask.shape)}")
    if not mask.is_floating_point():
        raise TypeError(f"mask must be an additive float mask, got {mask.dtype}")
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    if mask.is_cuda:
        return _lists_triton(mask, width, flat, reuse)
    indices, lengths, bad = _lists_torch(mask, width)
    if flat:
        offset = torch.arange(mask.shape[0], dtype=torch.int32).view(-1, 1, 1) * mask.shape[2]
        indices = torch.where(indices >= 0, indices + offset, -1)
    return indices, lengths, bad


def _lists_torch(mask, width):
    b, s, n = mask.shape
    indices = torch.full((b, s, width + 1), -1, dtype=torch.int32, device=mask.device)
    lengths = torch.empty((b, s), dtype=torch.int32, device=mask.device)
    bad = torch.empty((b, s), dtype=torch.bool, device=mask.device)
    cols = torch.arange(n, dtype=torch.int32, device=mask.device)
    rows = max(1, _CHUNK_ELEMENTS // max(1, b * n))
    for r0 in range(0, s, rows):
        m = mask[:, r0:r0 + rows]
        visible = m == 0
        count = visible.sum(-1, dtype=torch.int32)
        # slot of each visible column in its row's list; hidden columns (and overflow) go to
        # the spare last slot, which is dropped
        slot = torch.cumsum(visible, -1, dtype=torch.int32) - 1
        slot = torch.where(visible & (slot < width), slot, width).long()
        chunk = indices[:, r0:r0 + rows]
        chunk.scatter_(-1, slot, cols.expand_as(slot))   # the spare slot's value is arbitrary
        lengths[:, r0:r0 + rows] = count.clamp(max=width)
        bad[:, r0:r0 + rows] = (count > width) | (~visible & ~is_masked(m)).any(-1)
    return indices[..., :width], lengths, bad


def _lists_body(mask_ptr, idx_ptr, len_ptr, bad_ptr, S, N, W, stride_b, stride_s, stride_n,
                  col_offset, hidden_at_most, BLOCK: tl.constexpr):
    """One (batch, query) row per program: its visible columns compacted in order."""
    row = tl.program_id(0)
    b = row // S
    src = mask_ptr + b.to(tl.int64) * stride_b + (row % S).to(tl.int64) * stride_s
    dst = idx_ptr + row.to(tl.int64) * W
    count = 0
    biased = 0
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        inside = cols < N
        m = tl.load(src + cols * stride_n, mask=inside, other=float("-inf")).to(tl.float32)
        visible = (m == 0.0) & inside
        slot = count + tl.cumsum(visible.to(tl.int32), 0) - 1
        tl.store(dst + slot, cols + b * col_offset, mask=visible & (slot < W))
        count += tl.sum(visible.to(tl.int32), 0)
        biased += tl.sum((~visible & ~(m <= hidden_at_most) & inside).to(tl.int32), 0)
    for w0 in range(0, W, BLOCK):
        slots = w0 + tl.arange(0, BLOCK)
        tl.store(dst + slots, -1, mask=(slots >= count) & (slots < W))
    tl.store(len_ptr + row, tl.minimum(count, W))
    tl.store(bad_ptr + row, ((count > W) | (biased > 0)).to(tl.int8))


_lists_kernel = triton.jit(_lists_body)
# The same kernel for decode-sized lists, specialized on nothing that changes between decode
# steps (the key count grows by one a step, which moves Triton's divisibility-by-16 key, and
# buffer alignment), bar a unit key stride, the calls it takes: compiled once per device and
# mask dtype, it is launched without Triton's argument binding and cache lookup, which cost
# more host time than the rest of a decode call's lists (lab/perf-history.md, "HF attention call").
_INT_ARGS = ("S", "N", "W", "stride_b", "stride_s", "col_offset")
_lists_kernel_steady = triton.jit(
    _lists_body, do_not_specialize=_INT_ARGS,
    do_not_specialize_on_alignment=("mask_ptr", "idx_ptr", "len_ptr", "bad_ptr"))
_STEADY: dict = {}
_INT32 = 2 ** 31


# Largest list (elements) kept for reuse, and how many shapes are kept: decode steps' lists
# are a few thousand entries; a long prefill's would pin tens of MiB.
_REUSE_ELEMENTS = 1 << 20
_REUSE_SHAPES = 16
_BUFFERS: dict = {}


def _buffers(device, b, s, width, reuse):
    if reuse and b * s * width <= _REUSE_ELEMENTS:
        key = (device, triton.runtime.driver.active.get_current_stream(device.index), b, s,
               width)
        bufs = _BUFFERS.get(key)
        if bufs is None:
            if len(_BUFFERS) >= _REUSE_SHAPES:
                _BUFFERS.pop(next(iter(_BUFFERS)))
            bufs = _BUFFERS[key] = _buffers(device, b, s, width, False)
        return bufs
    return (torch.empty((b, s, width), dtype=torch.int32, device=device),
            torch.empty((b, s), dtype=torch.int32, device=device),
            torch.empty((b, s), dtype=torch.int8, device=device))


def _lists_triton(mask, width, flat, reuse=False):
    b, s, n = mask.shape
    indices, lengths, bad = _buffers(mask.device, b, s, width, reuse)
    if b * s:
        # is_masked's threshold, as a float the kernel compares the fp32-widened mask with
        hidden_at_most = float(torch.finfo(mask.dtype).min) / 2
        args = (mask, indices, lengths, bad, s, n, width, *mask.stride(), n if flat else 0,
                hidden_at_most)
        if reuse and _steady_fits(args) and not triton_interpreting():
            _launch_steady(mask, args, (b * s,))
        else:
            _lists_kernel[(b * s,)](*args, BLOCK=1024, num_warps=4)
    return indices, lengths, bad.view(torch.bool)


def _steady_fits(args) -> bool:
    """Whether the unspecialized kernel takes these arguments as compiled: a unit key stride
    (specialized, for its loads) and every integer within int32 (Triton types larger ones
    i64, another signature)."""
    return args[9] == 1 and all(-_INT32 <= v < _INT32 for v in args[4:11])


def _launch_steady(mask, args, grid):
    key = (mask.device, mask.dtype)
    kernel = _STEADY.get(key)
    if kernel is None:
        kernel = _lists_kernel_steady.warmup(*args, BLOCK=1024, num_warps=4, grid=grid)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        _STEADY[key] = kernel
    launch_compiled(kernel, _lists_kernel_steady, grid, args, {"BLOCK": 1024})


def refuse_rows(bad, width: int, layer, takes: str) -> None:
    """Raises, naming the first query row in ``bad`` ``[B, S_q]`` whose mask the lists cannot
    reproduce: more than ``width`` visible keys or a finite nonzero bias. ``takes``: the
    masks the caller's route takes."""
    if bool(bad.any()):
        row = bad.nonzero()[0].tolist()
        raise ValueError(
            f"attention_mask row (batch {row[0]}, query {row[1]}) of layer {layer} has more "
            f"than {width} visible keys or a finite nonzero bias; sparse_mla attention takes "
            f"{takes} only")
