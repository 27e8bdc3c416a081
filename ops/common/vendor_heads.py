"""Head padding for vendor kernels that accept only some head counts (FlashMLA 64/128,
TRTLLM-gen 8..128): zero q rows for the extra heads, -inf sinks (no effect), and a padded
output buffer whose real heads the caller copies back."""
from __future__ import annotations

from typing import Optional

import torch


def pad_heads(q: torch.Tensor, sink: Optional[torch.Tensor], padded: int, head_dim: int = -2,
              out_dim: Optional[int] = None):
    """Returns ``(q, sink, out)`` with ``padded`` heads along ``head_dim``; ``out`` is a fresh
    bf16 buffer shaped like q with last dim ``out_dim`` (None when ``out_dim`` is None). When
    no padding is needed, q and sink come back unchanged and ``out`` is None."""
    h = q.shape[head_dim]
    if padded == h:
        return q, sink, None
    shape = list(q.shape)
    shape[head_dim] = padded
    qp = torch.zeros(shape, dtype=q.dtype, device=q.device)
    qp.narrow(head_dim, 0, h).copy_(q)
    if sink is not None:
        sink = torch.cat([sink.float(), sink.new_full((padded - h,), float("-inf"),
                                                      dtype=torch.float32)])
    out = None
    if out_dim is not None:
        out = torch.empty(shape[:-1] + [out_dim], dtype=torch.bfloat16, device=q.device)
    return qp, sink, out
