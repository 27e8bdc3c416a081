"""The Lightning indexer's key cache (docs/semantics.md §11.1), as data.

fp8: vLLM's DeepSeek-V4 indexer page, per block ``[bs x 128 e4m3][bs x fp32 scale]`` (values
of every entry first, then one power-of-two fp32 scale per entry). bf16: plain
``[num_blocks, bs, 128]`` rows. Everything addresses blocks through the cache's ``stride(0)``.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common import formats

DIM = 128                  # index_head_dim of every DeepSeek-V4 model
MAX_HEADS = 128            # index_n_heads is 64; tensor parallelism only lowers it

# One scale per entry in the tail of the block, as the 584 B format keeps its UE8M0 bytes.
# vLLM rounds an indexer page up to 576 bytes (fp8_ds_mla) like the attention cache's.
FP8 = formats.PagedFormat(
    name="indexer_fp8", bytes_per_token=DIM + 4, token_data_bytes=DIM, data_bytes=DIM,
    rope_offset=DIM, rope_dims=0, scale_dtype="fp32", num_scales=1, tile=DIM,
    scale_in_tail=True, scale_offset=4, block_alignment=576, out_dim=DIM)


def alloc_cache(num_blocks: int, block_size: int, *, fp8: bool = True, device="cpu",
                fill: int | None = None):
    """An indexer cache: fp8 as vLLM's ``[num_blocks, block_size, 132]`` uint8 view over
    576-byte-aligned pages, bf16 as ``[num_blocks, block_size, 128]``. ``fill`` sets every
    byte (0xFF decodes to NaN in both formats: tests poison with it)."""
    if fp8:
        return formats.alloc_paged_cache(FP8, num_blocks, block_size, device=device,
                                         fill=fill)
    raw = torch.empty(num_blocks * block_size * DIM * 2, dtype=torch.uint8, device=device)
    if fill is not None:
        raw.fill_(fill)
    return raw.view(torch.bfloat16).view(num_blocks, block_size, DIM)


def decode_width(block_table, block_size: int, max_candidates) -> int:
    """Columns a decode step scores: every entry the block table can address, or
    ``max_candidates`` where the caller bounds it (a static number: no sync)."""
    width = block_table.shape[1] * block_size
    return width if max_candidates is None else min(width, max_candidates)


# A prefill chunk's share of memory by default: its [chunk, candidates] int64 selection keys
CHUNK_KEY_BYTES = 1 << 30


def auto_chunk(width: int, key_bytes: int = CHUNK_KEY_BYTES) -> int:
    """Tokens per prefill chunk (``chunk=0``) whose selection keys over ``width`` candidates
    take at most ``key_bytes``."""
    return max(64, key_bytes // (8 * max(width, 1)))
