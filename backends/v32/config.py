"""A DeepSeek-V3.2 layer's static shape (what its backends are constructed with).

Not ``backends.v4.LayerConfig``: that one describes DeepSeek-V4 layers (kind, window,
compressed pages, q-norm eps), none of which V3.2 has. The capacities mean the same here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

MAX_HEADS = 128
D_QK = 576          # 512 latent (kv_lora_rank) + 64 RoPE
D_V = 512


@dataclasses.dataclass(frozen=True)
class V32Config:
    """``num_heads``: local query heads, 1..128. ``topk``: the indexer's top-k (2048 in
    DeepSeek-V3.2). ``block_size``: tokens per cache page (vLLM: 64). ``softmax_scale``: the
    model's (V3.2 folds its YaRN mscale in; default 576^-0.5). Capacities: ``max_num_tokens``
    and ``max_num_reqs`` per step, ``max_model_len``. ``prefill_workspace_rows``: bf16 rows
    the fp8 cache's prefill gathers into (default ``max_model_len``: any one request fits;
    vLLM reserves 5x that)."""

    num_heads: int
    max_num_tokens: int
    max_num_reqs: int
    max_model_len: int
    topk: int = 2048
    block_size: int = 64
    softmax_scale: float = D_QK ** -0.5
    prefill_workspace_rows: Optional[int] = None

    def __post_init__(self):
        for name in ("num_heads", "max_num_tokens", "max_num_reqs", "max_model_len", "topk",
                     "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_heads > MAX_HEADS:
            raise ValueError(f"num_heads must be 1..{MAX_HEADS}, got {self.num_heads}")
        if self.prefill_workspace_rows is None:
            object.__setattr__(self, "prefill_workspace_rows", self.max_model_len)
        if not isinstance(self.prefill_workspace_rows, int) or self.prefill_workspace_rows < 1:
            raise ValueError(f"prefill_workspace_rows must be a positive int, got "
                             f"{self.prefill_workspace_rows!r}")
