"""KV-cache byte layouts as data (docs/semantics.md §2).

A format descriptor says where each byte of a token lives inside its block; the reference and
the Triton kernels both address caches only through these numbers, so a layout fact is written
down once. Block base addresses always come from the cache tensor's ``stride(0)`` (vLLM may pad
or interleave pages), never from ``block_size * bytes_per_token``.
"""
from __future__ import annotations

import dataclasses
import math

import torch

E4M3_MAX = 448.0
HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64


@dataclasses.dataclass(frozen=True)
class PagedFormat:
    """A quantized paged cache: uint8 bytes, one record per token inside each block."""

    name: str
    bytes_per_token: int      # logical last-dim size of the [num_blocks, block_size, B] view
    token_data_bytes: int     # stride between token data records inside a block
    data_bytes: int           # e4m3 NoPE bytes at the start of each data record
    rope_offset: int          # byte offset of the bf16 RoPE part inside the data record
    rope_dims: int
    scale_dtype: str          # "ue8m0" (1 byte, power of two) or "fp32"
    num_scales: int           # NoPE tiles per token
    tile: int                 # NoPE values per scale
    scale_in_tail: bool       # scales in a per-block tail (V4) or inside the token record (V3.2)
    scale_offset: int         # tail: bytes per token in the tail; record: offset inside record
    block_alignment: int      # vLLM rounds a page up to a multiple of this many bytes
    out_dim: int              # width of a dequantized row
    value_dtype: str = "e4m3"  # the data bytes' element type: "e4m3", or "e2m1" (two per byte)
    record: str = ""          # the quantized record's encoding (quant.py); "" means ``name``:
    #                           two layouts of one record share it (v41 / v41_inline)

    @property
    def codec(self) -> str:
        """The record encoding this layout stores (the key of quant.quantize_record)."""
        return self.record or self.name

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per token."""
        return self.num_scales * (4 if self.scale_dtype == "fp32" else 1)

    def token_data_addr(self, block_size: int, offset):
        """Byte offset of a token's data record from its block base."""
        return offset * self.token_data_bytes

    def token_scale_addr(self, block_size: int, offset):
        """Byte offset of a token's first scale byte from its block base."""
        if self.scale_in_tail:
            return block_size * self.token_data_bytes + offset * self.scale_offset
        return offset * self.token_data_bytes + self.scale_offset

    def min_block_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def page_bytes(self, block_size: int) -> int:
        """vLLM's page size: block bytes rounded up to the format's alignment."""
        raw = self.min_block_bytes(block_size)
        return math.ceil(raw / self.block_alignment) * self.block_alignment


# DeepSeek-V4 / FlashMLA "MODEL1": per block [bs x 576 data][bs x 8 scales][pad]
# (docs/semantics.md §2.2).
V4 = PagedFormat(
    name="v4", bytes_per_token=584, token_data_bytes=576, data_bytes=448, rope_offset=448,
    rope_dims=64, scale_dtype="ue8m0", num_scales=7, tile=64, scale_in_tail=True,
    scale_offset=8, block_alignment=576, out_dim=512)

# DeepSeek-V3.2 fp8_ds_mla: per token [512 e4m3][4 x fp32 scale][64 x bf16 rope]
# (docs/semantics.md §2.1).
V32 = PagedFormat(
    name="v32", bytes_per_token=656, token_data_bytes=656, data_bytes=512, rope_offset=528,
    rope_dims=64, scale_dtype="fp32", num_scales=4, tile=128, scale_in_tail=False,
    scale_offset=512, block_alignment=656, out_dim=576)

# DeepSeek-V4.1 MXFP8 (FlashMLA's ModelType::V41): per block [bs x 512 e4m3][bs x 16 UE8M0][pad];
# all 512 dims (RoPE included, rotated first) quantized, one power-of-two scale per 32 dims
# (docs/semantics.md §12).
V41 = PagedFormat(
    name="v41", bytes_per_token=528, token_data_bytes=512, data_bytes=512, rope_offset=512,
    rope_dims=0, scale_dtype="ue8m0", num_scales=16, tile=32, scale_in_tail=True,
    scale_offset=16, block_alignment=512, out_dim=512)

# DeepSeek-V4.1 NVFP4, compressed caches only (ModelType::V41_FP4): per block
# [bs x 256 B of e2m1 pairs][bs x 32 e4m3 scales][pad]; byte i holds dim 2i in its low nibble
# and dim 2i+1 in its high nibble, one e4m3 scale per 16 dims (docs/semantics.md §12).
V41_FP4 = PagedFormat(
    name="v41_fp4", bytes_per_token=288, token_data_bytes=256, data_bytes=256, rope_offset=256,
    rope_dims=0, scale_dtype="e4m3", num_scales=32, tile=16, scale_in_tail=True,
    scale_offset=32, block_alignment=512, out_dim=512, value_dtype="e2m1")

# The same two records token-inline, as vLLM 0.33.0 and FlashMLA main write them: per token
# [512 e4m3 | 16 UE8M0] (528 B stride) and [256 B e2m1 pairs | 32 e4m3] (288 B stride), no page
# footer (docs/semantics.md §12). vLLM 0.33 keeps the 512 B page alignment and pads the SWA
# block stride to lcm(528, 288 or 528); caches here are addressed through stride(0), so pass
# that stride as alloc_paged_cache's page_bytes.
V41_INLINE = PagedFormat(
    name="v41_inline", record="v41", bytes_per_token=528, token_data_bytes=528, data_bytes=512,
    rope_offset=512, rope_dims=0, scale_dtype="ue8m0", num_scales=16, tile=32,
    scale_in_tail=False, scale_offset=512, block_alignment=512, out_dim=512)
V41_FP4_INLINE = PagedFormat(
    name="v41_fp4_inline", record="v41_fp4", bytes_per_token=288, token_data_bytes=288,
    data_bytes=256, rope_offset=256, rope_dims=0, scale_dtype="e4m3", num_scales=32, tile=16,
    scale_in_tail=False, scale_offset=256, block_alignment=512, out_dim=512, value_dtype="e2m1")

PAGED_FORMATS = {f.name: f for f in (V4, V32, V41, V41_FP4, V41_INLINE, V41_FP4_INLINE)}
# The records DeepSeek-V4.1 layers may use: 528 B or 584 B SWA pages, and for compressed
# entries also 288 B (vLLM writes 528 / 288 only on SM100, 584 B elsewhere), each V4.1 record
# page-footer (vLLM 0.32.0) or token-inline (vLLM 0.33.0)
V41_SWA_FORMATS = ("v41", "v41_inline", "v4")
V41_COMPRESSED_FORMATS = ("v41", "v41_fp4", "v41_inline", "v41_fp4_inline", "v4")
# layout name -> the record it stores, for the V4.1 records only
V41_RECORD_OF = {f.name: f.codec for f in (V41, V41_FP4, V41_INLINE, V41_FP4_INLINE)}


@dataclasses.dataclass(frozen=True)
class PlainFormat:
    """TRTLLM-gen "full cache" rows: [num_blocks, block_size, 512] of one dtype
    (docs/semantics.md §2.3)."""

    name: str
    dtype: torch.dtype
    head_dim: int = HEAD_DIM


PLAIN_BF16 = PlainFormat("plain_bf16", torch.bfloat16)
PLAIN_FP8 = PlainFormat("plain_fp8", torch.float8_e4m3fn)
PLAIN_FORMATS = {f.name: f for f in (PLAIN_BF16, PLAIN_FP8)}

ALL_FORMATS = {**PAGED_FORMATS, **PLAIN_FORMATS}


def get_format(name: str):
    try:
        return ALL_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown cache format {name!r}; expected one of {sorted(ALL_FORMATS)}") from None


def alloc_paged_cache(fmt: PagedFormat | str, num_blocks: int, block_size: int, *,
                      device="cpu", page_bytes: int | None = None, fill: int | None = None):
    """A [num_blocks, block_size, bytes_per_token] uint8 view over pages of ``page_bytes``.

    ``page_bytes`` defaults to vLLM's aligned page; pass more to model hybrid-allocator padding.
    ``fill`` initializes every byte (tests poison with 0xFF, which decodes to NaN).
    """
    if isinstance(fmt, str):
        fmt = get_format(fmt)
    page = fmt.page_bytes(block_size) if page_bytes is None else page_bytes
    if page < fmt.min_block_bytes(block_size):
        raise ValueError(f"page_bytes={page} < block_size*{fmt.bytes_per_token}")
    raw = torch.empty(num_blocks, page, dtype=torch.uint8, device=device)
    if fill is not None:
        raw.fill_(fill)
    return raw.as_strided((num_blocks, block_size, fmt.bytes_per_token),
                          (page, fmt.bytes_per_token, 1))
