"""A DeepSeek-V4 layer's kind and static shape: what its backends are constructed with
(capacities fix buffer sizes)."""
from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar, Optional

from sparse_mla.ops.common import formats
from sparse_mla.ops.index_combine import c128a_width

MAX_HEADS = 128


class LayerKind(enum.Enum):
    """The three DeepSeek-V4 attention layers; the value is the compress ratio."""

    SWA_ONLY = 1      # sliding window only (compress_ratio 0/1)
    C4A = 4           # window + indexer-selected compressed entries (ratio 4)
    C128A = 128       # window + every completed compressed entry (ratio 128)

    @property
    def ratio(self) -> int:
        return self.value

    @property
    def compressed(self) -> bool:
        return self is not LayerKind.SWA_ONLY

    @property
    def uses_topk(self) -> bool:
        """Its compressed list is the indexer's top-k (DeepSeek-V4.1's kinds: V41Kind)."""
        return self is LayerKind.C4A

    @classmethod
    def from_ratio(cls, ratio: int) -> "LayerKind":
        if ratio in (0, 1):
            return cls.SWA_ONLY
        for kind in cls:
            if kind.value == ratio:
                return kind
        raise ValueError(f"compress_ratio must be 0/1 (SWA only), 4 (C4A) or 128 (C128A), "
                         f"got {ratio}")


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """``num_heads``: local (per tensor-parallel rank) query heads, 1..128. ``topk``: the
    indexer's top-k (C4A). Capacities: ``max_num_tokens`` per step, ``max_num_reqs`` per step,
    ``max_model_len`` (the C128A list width). ``prefill_workspace_rows``: bf16 rows the prefill
    gathers into (default: one request of ``max_model_len`` and ``max_num_tokens`` fits).
    ``apply_q_norm``: the write applies the model's weightless q RMS-norm before RoPE (False:
    q arrives normed)."""

    num_heads: int
    kind: LayerKind
    max_num_tokens: int
    max_num_reqs: int
    max_model_len: int
    topk: int = 512
    window: int = 128
    swa_block_size: int = 64
    compressed_block_size: Optional[int] = None     # default: 256 // ratio (vLLM)
    softmax_scale: float = formats.HEAD_DIM ** -0.5
    eps: float = 1e-6
    prefill_workspace_rows: Optional[int] = None
    apply_q_norm: bool = True

    KINDS: ClassVar[type] = LayerKind     # the model's layer kinds (V4.1: backends/v41)

    def __post_init__(self):
        if not isinstance(self.kind, self.KINDS):
            raise TypeError(f"kind must be a {self.KINDS.__name__}, got {self.kind!r}")
        for name in ("num_heads", "max_num_tokens", "max_num_reqs", "max_model_len", "window",
                     "swa_block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_heads > MAX_HEADS:
            raise ValueError(f"num_heads must be 1..{MAX_HEADS}, got {self.num_heads}")
        if self.kind.uses_topk and (not isinstance(self.topk, int) or self.topk < 1):
            raise ValueError(f"topk must be a positive int for a {self.kind.name} layer, got "
                             f"{self.topk!r}")
        if self.compressed_block_size is None and self.kind.compressed:
            object.__setattr__(self, "compressed_block_size", self.default_compressed_block())
        if self.prefill_workspace_rows is None:
            object.__setattr__(self, "prefill_workspace_rows", self.request_rows(
                self.max_model_len, self.max_num_tokens))
        if self.prefill_workspace_rows < self.window:
            raise ValueError(f"prefill_workspace_rows must be >= window ({self.window}), got "
                             f"{self.prefill_workspace_rows}")

    def default_compressed_block(self) -> int:
        """Compressed entries per block when not given: vLLM's 256 // ratio."""
        return max(256 // self.kind.ratio, 1)

    @property
    def compressed_width(self) -> int:
        """Columns of a token's compressed list: top-k (C4A), every entry (C128A), none."""
        if self.kind.uses_topk:
            return self.topk
        if self.kind is LayerKind.C128A:
            return c128a_width(self.max_model_len, self.kind.ratio)
        return 0

    def request_rows(self, seq_len: int, query_len: int) -> int:
        """Workspace rows one prefill request needs: its compressed entries, then its window
        context and new tokens (docs/semantics.md §4.4)."""
        n = seq_len // self.kind.ratio if self.kind.compressed else 0
        return n + query_len + min(seq_len - query_len, self.window - 1)
