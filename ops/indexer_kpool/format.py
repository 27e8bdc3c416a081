"""GLM-5.3-Flash's kpool indexer caches (docs/semantics.md §13), as data.

Pooled-key cache: the DeepSeek-V3.2 indexer page (ops/indexer/format.py ``FP8``), one entry
per pool of ``kpool`` tokens: per block ``[bs x 128 e4m3][bs x 4-byte scale]``. The scale is
an fp32 power of two, or (``scale_fmt="ue8m0"``, vLLM on sm_100) its exponent byte repeated
four times. Tail ring: bf16 ``[num_blocks, 2, ring, 128]``, half 0 the raw key, half 1 the
gate score, slot ``pos % ring`` of the request's one block.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.indexer import format as indexer_format

DIM = indexer_format.DIM
MAX_HEADS = indexer_format.MAX_HEADS
FP8 = indexer_format.FP8
SCALE_FMTS = ("fp32", "ue8m0")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def ring_size(kpool: int, num_spec: int = 0) -> int:
    """Tokens per tail block: kpool * next_pow2(ceil((kpool + num_spec) / kpool))."""
    return kpool * next_pow2(-(-(kpool + num_spec) // kpool))


def alloc_cache(num_blocks: int, block_size: int, *, device="cpu", fill: int | None = None):
    """A pooled-key cache, vLLM's ``[num_blocks, block_size, 132]`` uint8 view."""
    return indexer_format.alloc_cache(num_blocks, block_size, fp8=True, device=device,
                                      fill=fill)


def alloc_tail_cache(num_blocks: int, ring: int, *, device="cpu", fill: int | None = None):
    """A tail ring cache bf16 ``[num_blocks, 2, ring, 128]`` (``fill``: every byte)."""
    raw = torch.empty(num_blocks * 2 * ring * DIM * 2, dtype=torch.uint8, device=device)
    if fill is not None:
        raw.fill_(fill)
    return raw.view(torch.bfloat16).view(num_blocks, 2, ring, DIM)
