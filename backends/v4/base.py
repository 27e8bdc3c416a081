"""What the two DeepSeek-V4 backends share: the model's hooks on the backend contract.

A V4 step: the model hands over q ``[T, H, 512]`` (before its weightless q-norm and RoPE,
which the write applies when ``LayerConfig.apply_q_norm``), this step's kv rows ``kv``
``[T, 512]`` (RoPE applied by the write, from ``cos_sin_cache``), the compressor's rows
``compressed_kv`` (compressed layers) and the per-head sinks ``attn_sink`` (float32 ``[H]``);
the indexer's top-k (C4A) arrives in the batch.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.backends.common.base import Backend
from sparse_mla.backends.v4.config import LayerConfig
from sparse_mla.backends.v4.planner import IndexPlanner
from sparse_mla.backends.v4.validate import validate_shapes, validate_values
from sparse_mla.ops.common import checks


class V4Backend(Backend):
    """Backends implement ``cache_specs`` ("swa", and "compressed" on compressed layers),
    ``_write`` and ``_attend``."""

    CONFIG = LayerConfig
    PLANNER = IndexPlanner

    def _validate_inputs(self, q, caches, batch, kv, cos_sin_cache, compressed_kv, attention):
        if kv is not None and cos_sin_cache is None:
            raise ValueError("cos_sin_cache is required to write DeepSeek-V4 rows (the write "
                             "applies RoPE to q and kv)")
        validate_shapes(self.config, batch, q, kv, compressed_kv, attention)
        comp = caches.get("compressed")
        validate_values(self.config, batch, q, cos_sin_cache, caches["swa"].shape[0],
                        None if comp is None else comp.shape[0], attention)

    def _check_sink(self, attn_sink: Optional[Tensor]) -> None:
        H = self.config.num_heads
        if attn_sink is None:
            raise ValueError(f"attn_sink is required: DeepSeek-V4's per-head sinks, float32 "
                             f"[{H}]")
        checks.expect_dtype("attn_sink", attn_sink, torch.float32)
        checks.expect_shape("attn_sink", attn_sink, (H,))
