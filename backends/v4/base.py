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
from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.v4.config import LayerConfig
from sparse_mla.backends.v4.planner import IndexPlanner
from sparse_mla.backends.v4.validate import validate_shapes, validate_values
from sparse_mla.ops.common import checks


class V4Backend(Backend):
    """Backends implement ``cache_specs`` ("swa", and "compressed" on compressed layers),
    ``_write`` and ``_attend``.

    The q fold: a backend whose ``QFOLD`` is set (a class attribute; ``backend.QFOLD = False``
    turns it off for one instance, for A/B runs) runs a whole step (``forward``) with decode
    rows' q handed raw to the decode op, which norms and rotates it as its kernel loads it
    (``flashmla_sparse_decode``'s ``q_positions`` / ``cos_sin_cache``), and writes their kv
    rows with the kv-only insert: no separate pass over q. ``write`` + ``attend`` (and steps
    the fold cannot take: see ``_fold_step``) keep the unfused path, whose q ``write``
    returns rotated."""

    CONFIG = LayerConfig
    PLANNER = IndexPlanner
    QFOLD = False
    _in_forward = False
    _fold = None        # during a folded step: (raw q, cos_sin_cache) for the decode rows

    def forward(self, q: Tensor, kv: Tensor, caches, batch: BatchDescription,
                cos_sin_cache: Optional[Tensor] = None, attn_sink: Optional[Tensor] = None,
                out: Optional[Tensor] = None, compressed_kv: Optional[Tensor] = None,
                planned: bool = False) -> Tensor:
        self._in_forward = True
        try:
            return super().forward(q, kv, caches, batch, cos_sin_cache, attn_sink, out,
                                   compressed_kv, planned)
        finally:
            self._in_forward = False
            self._fold = None

    def _start_fold(self, q, batch, cos_sin_cache) -> bool:
        """Called by ``_write`` (inputs validated): whether this step folds, remembered for
        ``_decode_fold_args``."""
        fold = self._in_forward and self._fold_step(q, batch, cos_sin_cache)
        self._fold = (q, cos_sin_cache) if fold else None
        return fold

    def _fold_step(self, q, batch, cos_sin_cache) -> bool:
        """Whether this step folds: decode rows, the fold on (``QFOLD``), an
        attention route that folds in its kernel (not the vendor one, which would run the
        unfused reference first), and inputs the decode op's fold takes (a bf16 q, a
        contiguous RoPE table and positions: else its checks would raise after the write)."""
        return (self.QFOLD and batch.num_decode_tokens > 0
                and self.attention_impl != "vendor" and isinstance(q, torch.Tensor)
                and q.dtype == torch.bfloat16 and isinstance(cos_sin_cache, torch.Tensor)
                and cos_sin_cache.is_contiguous() and batch.positions.is_contiguous())

    def _decode_fold_args(self, batch) -> dict:
        """The decode op's fold arguments for the batch's decode rows (none without a fold):
        raw q, their positions, the table and the norm's eps (None: q arrives normed)."""
        if self._fold is None:
            return {}
        q, cos_sin_cache = self._fold
        Td = batch.num_decode_tokens
        return dict(q_raw=q[:Td], q_positions=batch.positions[:Td].view(Td, 1),
                    cos_sin_cache=cos_sin_cache,
                    q_norm_eps=self.config.eps if self.config.apply_q_norm else None)

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
