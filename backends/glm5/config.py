"""A GLM-5.3 DSA layer's static shape: V3.2's, with the no-RoPE head and the kpool top-k width.

The attention reads the indexer's expanded output (docs/semantics.md §13.4): ``index_topk``
pooled tokens plus the ``kpool - 1`` always-selected tail, -1 padded to vLLM's buffer width
``round_up(index_topk + kpool - 1, 128)`` (glm5next model.py:112): 2176. The softmax scale is
(qk_nope + qk_rope)^-0.5 with qk_rope 0 (§13.5).
"""
from __future__ import annotations

import dataclasses

from sparse_mla.backends.v32.config import V32Config

D_Q = 512           # kv_lora_rank: what the model hands over (no RoPE dims)
KPOOL = 4
INDEX_TOPK = 2048


def topk_width(index_topk: int, kpool: int) -> int:
    return -(-(index_topk + kpool - 1) // 128) * 128


@dataclasses.dataclass(frozen=True)
class Glm5Config(V32Config):
    topk: int = topk_width(INDEX_TOPK, KPOOL)
    softmax_scale: float = 256 ** -0.5
