"""A GLM-5.3 DSA layer's static shape: V3.2's, with the no-RoPE head and the kpool top-k width.

The attention reads the indexer's expanded output (docs/semantics.md §13.4): ``index_topk``
pooled tokens plus the ``kpool - 1`` always-selected tail, so ``topk`` defaults to
2048 + 3. The softmax scale is (qk_nope + qk_rope)^-0.5 with qk_rope 0 (§13.5).
"""
from __future__ import annotations

import dataclasses

from sparse_mla.backends.v32.config import V32Config

D_Q = 512           # kv_lora_rank: what the model hands over (no RoPE dims)
KPOOL = 4
INDEX_TOPK = 2048


@dataclasses.dataclass(frozen=True)
class Glm5Config(V32Config):
    topk: int = INDEX_TOPK + KPOOL - 1
    softmax_scale: float = 256 ** -0.5
