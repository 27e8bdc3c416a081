"""A cache's description (what a backend allocates, what an engine sizes its pool by)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from sparse_mla.ops.common import formats


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """``format``: a ``formats`` name ("v4", "v32", "plain_bf16", "plain_fp8"). ``page_bytes``:
    bytes per block as allocated (the 584 B layout rounds up to a multiple of 576,
    docs/semantics.md §2.2)."""

    name: str
    format: str
    block_size: int
    dtype: torch.dtype
    bytes_per_token: int
    page_bytes: int
    alignment: int
    width: int = formats.HEAD_DIM     # values per row of a plain cache (576: V3.2's bf16 cache)

    @classmethod
    def paged_v4(cls, name: str, block_size: int) -> "CacheSpec":
        return cls.paged_format(name, formats.V4, block_size)

    @classmethod
    def paged_format(cls, name: str, fmt: formats.PagedFormat, block_size: int) -> "CacheSpec":
        """A cache of any ``formats`` paged record (DeepSeek-V4.1: 584, 528 or 288 B)."""
        return cls(name, fmt.name, block_size, torch.uint8, fmt.bytes_per_token,
                   fmt.page_bytes(block_size), fmt.block_alignment)

    @classmethod
    def paged_v32(cls, name: str, block_size: int) -> "CacheSpec":
        """DeepSeek-V3.2's 656 B fp8_ds_mla layout (docs/semantics.md §2.1)."""
        fmt = formats.V32
        return cls(name, fmt.name, block_size, torch.uint8, fmt.bytes_per_token,
                   fmt.page_bytes(block_size), fmt.block_alignment)

    @classmethod
    def plain(cls, name: str, block_size: int, dtype: torch.dtype,
              width: int = formats.HEAD_DIM) -> "CacheSpec":
        """Rows of ``width`` values: 512 (DeepSeek-V4), 576 (V3.2's bf16 cache: 512 latent +
        64 RoPE)."""
        fmt = formats.PLAIN_BF16 if dtype == torch.bfloat16 else formats.PLAIN_FP8
        if dtype != fmt.dtype:
            raise ValueError(f"a plain cache is bfloat16 or float8_e4m3fn, got {dtype}")
        row = width * dtype.itemsize
        return cls(name, fmt.name, block_size, dtype, row, block_size * row, row, width)

    @property
    def paged(self) -> bool:
        return self.format in formats.PAGED_FORMATS

    @property
    def shape_per_block(self):
        if self.paged:
            return (self.block_size, self.bytes_per_token)
        return (self.block_size, self.width)

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.page_bytes

    def allocate(self, num_blocks: int, device="cpu", fill: Optional[int] = None):
        """``[num_blocks, block_size, bytes_per_token]`` uint8 (584 / 656 B layouts, pages
        padded as vLLM pads them) or ``[num_blocks, block_size, width]`` bf16 / e4m3.
        ``fill`` sets every byte (0xFF: NaN rows, as tests poison caches)."""
        if self.paged:
            return formats.alloc_paged_cache(self.format, num_blocks, self.block_size,
                                             device=device, page_bytes=self.page_bytes,
                                             fill=fill)
        cache = torch.empty(num_blocks, self.block_size, self.width, dtype=self.dtype,
                            device=device)
        if fill is not None:
            cache.view(torch.uint8).fill_(fill)
        return cache

    def bytes_for(self, num_blocks: int) -> int:
        return num_blocks * self.page_bytes

    def __str__(self):
        per_tok = math.ceil(self.page_bytes / self.block_size)
        return (f"{self.name}: {self.format}, block {self.block_size} tokens, "
                f"{self.page_bytes} B/page (~{per_tok} B/token)")
