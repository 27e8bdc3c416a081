"""A DeepSeek-V4.1 layer's static shape: V4's ``LayerConfig`` with V4.1's kinds and defaults.

What differs from V4.0 (vLLM 0.32.0, ``vllm/models/deepseek_v41/attention.py``): compress
ratios 0 / 1 / 2, both compressed kinds selecting entries with the indexer's top-k (512);
SWA pages of 32 tokens; compressed blocks of 64 tokens on SM90 (``64 // ratio`` entries; vLLM
divides its ``cache_config.block_size`` by the ratio); q arrives normed (no per-head q
RMSNorm, vLLM passes ``apply_q_norm=False``); compressed caches exist only on the
``kv_source_layer_ids`` layers, the others read the nearest source at or below them.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

from sparse_mla.backends.v4.config import LayerConfig

SM90_COMPRESSED_TOKENS = 64      # tokens per compressed block on SM90 (128 elsewhere)
SWA_RECORDS = (584, 528)         # bytes per token: V4.0's record, V4.1's MXFP8
COMPRESSED_RECORDS = (584, 528, 288)   # and V4.1's NVFP4 (compressed cache only)
# Where a V4.1 record (528 B / 288 B) keeps its scales: "footer" (a page's data rows, then its
# scale rows: vLLM 0.32.0) or "inline" (each token's scales after its data: vLLM 0.33.0); the
# 584 B record is page-footer in both (docs/semantics.md §12)
RECORD_LAYOUTS = ("footer", "inline")


class V41Kind(enum.Enum):
    """DeepSeek-V4.1's attention layers by compress ratio (``compress_ratios`` entries)."""

    SWA_ONLY = 0
    C1A = 1
    C2A = 2

    @property
    def ratio(self) -> int:
        """Tokens per compressed entry; 1 for SWA_ONLY, which the index ops need >= 1."""
        return max(self.value, 1)

    @property
    def compressed(self) -> bool:
        return self is not V41Kind.SWA_ONLY

    @property
    def uses_topk(self) -> bool:
        return self.compressed

    @classmethod
    def from_ratio(cls, ratio: int) -> "V41Kind":
        for kind in cls:
            if kind.value == ratio:
                return kind
        raise ValueError(f"compress_ratio must be 0 (SWA only), 1 (C1A) or 2 (C2A) for "
                         f"DeepSeek-V4.1, got {ratio!r}")


@dataclasses.dataclass(frozen=True)
class V41LayerConfig(LayerConfig):
    """``swa_record`` / ``compressed_record``: bytes per token of each cache's packed record
    (584: V4.0's, what vLLM writes for V4.1 on SM90 / SM120; 528: MXFP8; 288: NVFP4,
    compressed only). ``record_layout``: "footer" (vLLM 0.32.0) or "inline" (vLLM 0.33.0), how
    the 528 B / 288 B records lay out a page (``RECORD_LAYOUTS``). ``owns_compressed``: False
    for a layer that reads another layer's compressed cache (not a ``kv_source_layer_ids``
    layer): its step never writes it."""

    swa_block_size: int = 32
    apply_q_norm: bool = False
    swa_record: int = 584
    compressed_record: int = 584
    owns_compressed: bool = True
    record_layout: str = "footer"

    KINDS: ClassVar[type] = V41Kind

    def __post_init__(self):
        super().__post_init__()
        if self.apply_q_norm:
            raise ValueError("apply_q_norm must be False: DeepSeek-V4.1 has no per-head q "
                             "RMSNorm (q arrives normed)")
        if self.swa_record not in SWA_RECORDS:
            raise ValueError(f"swa_record must be one of {SWA_RECORDS} (bytes per token), got "
                             f"{self.swa_record!r}")
        if self.compressed_record not in COMPRESSED_RECORDS:
            raise ValueError(f"compressed_record must be one of {COMPRESSED_RECORDS} (bytes "
                             f"per token), got {self.compressed_record!r}")
        if self.record_layout not in RECORD_LAYOUTS:
            raise ValueError(f"record_layout must be one of {RECORD_LAYOUTS} (V4.1 records "
                             f"page-footer as vLLM 0.32.0 writes them, or token-inline as "
                             f"0.33.0 does), got {self.record_layout!r}")
        if not self.kind.compressed and not self.owns_compressed:
            raise ValueError("owns_compressed=False is for compressed layers reading a source "
                             "layer's cache; an SWA-only layer has no compressed cache")

    def default_compressed_block(self) -> int:
        return max(SM90_COMPRESSED_TOKENS // self.kind.ratio, 1)
