"""What the two DeepSeek-V3.2 backends share: the model's hooks on the backend contract
(``backends/common/base.py``) and the cache insert of this step's rows.

A V3.2 step: the model hands over q ``[T, H, 576]`` (q_nope already absorbed into the 512
latent dims, RoPE applied to the last 64), this step's cache rows ``kv`` ``[T, 576]`` (the
normed latent ``kv_c``, then the rotated ``k_pe``), and the indexer's request-local top-k
(``batch.topk_indices``); the backend writes the rows into its one token cache
(``batch.block_table`` / ``batch.slot_mapping``), converts the top-k to cache slots and
attends: ``out[T, H, 512]`` in place. V3.2 has no attention sink, no sliding window, no
compressed cache and no RoPE in the write: ``cos_sin_cache``, ``attn_sink`` and
``compressed_kv`` stay None, and ``write`` returns q as it came.
"""
from __future__ import annotations

import torch

from sparse_mla.backends.common.base import Backend
from sparse_mla.backends.common.validate import (check_request_values, check_slots,
                                                 check_topk, table_covers,
                                                 validate_requests)
from sparse_mla.backends.v32.config import D_QK, D_V, V32Config
from sparse_mla.backends.v32.planner import V32Planner
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops.common import checks

BF16 = torch.bfloat16


class V32Backend(Backend):
    """Backends implement ``cache_specs`` (one cache, "kv") and ``_attend``."""

    CONFIG = V32Config
    PLANNER = V32Planner

    # -- checks ----------------------------------------------------------------------------
    def _validate_inputs(self, q, caches, batch, kv, cos_sin_cache, compressed_kv, attention):
        cfg = self.config
        if cos_sin_cache is not None:
            raise ValueError("cos_sin_cache must be None for DeepSeek-V3.2: q and the rows' "
                             "RoPE dims arrive rotated from the model")
        if compressed_kv is not None:
            raise ValueError("compressed_kv must be None: DeepSeek-V3.2 has no compressed "
                             "cache")
        checks.expect_dtype("q", q, BF16)
        if q.dim() != 3 or q.shape[1] != cfg.num_heads or q.shape[2] != D_QK:
            raise ValueError(f"q must have shape [num_tokens, {cfg.num_heads}, {D_QK}] (the "
                             f"layer's local heads; 512 latent + 64 RoPE), got {list(q.shape)}")
        checks.expect_last_dim_contiguous("q", q)
        T = q.shape[0]
        Rd, Td, Rp, Tp, R = validate_requests(cfg, batch, T)
        if kv is not None:
            checks.expect_dtype("kv", kv, BF16)
            if kv.dim() != 2 or kv.shape[0] != T or kv.shape[1] != D_QK:
                raise ValueError(f"kv must have shape [{T}, {D_QK}] (a row per token: 512 "
                                 f"latent, then 64 rotated RoPE dims), got {list(kv.shape)}")
            checks.expect_last_dim_contiguous("kv", kv)
        tk = check_topk(batch, cfg.topk, Td + Tp, "a V3.2 layer") if attention else None
        checks.expect_same_device(q=q, kv=kv, topk_indices=tk,
                                  query_start_loc=batch.query_start_loc,
                                  seq_lens=batch.seq_lens, positions=batch.positions,
                                  block_table=batch.block_table,
                                  slot_mapping=batch.slot_mapping)
        self._validate_values(q, caches, batch, attention)

    def _validate_values(self, q, caches, batch, attention):
        if not checks.value_checks_enabled(q, batch.seq_lens):
            return
        cfg = self.config
        nb = caches["kv"].shape[0]
        qsl, seq, ql, tok, want = check_request_values(batch)
        check_slots("batch.slot_mapping", batch.slot_mapping, nb * cfg.block_size)
        table_covers("batch.block_table", batch.block_table, nb, torch.zeros_like(seq),
                     seq - 1, cfg.block_size, "position")
        if attention and tok.numel():
            tk = batch.topk_indices.long().cpu()[tok]
            bad = ((tk < -1) | (tk > want.unsqueeze(1))).nonzero()
            if bad.numel():
                i, j = int(bad[0, 0]), int(bad[0, 1])
                raise ValueError(f"batch.topk_indices[{int(tok[i])}, {j}] = {int(tk[i, j])}: "
                                 f"a token at position {int(want[i])} may select positions "
                                 f"0..{int(want[i])} (-1 pads)")

    def _check_sink(self, attn_sink) -> None:
        if attn_sink is not None:
            raise ValueError("DeepSeek-V3.2 has no attention sink; attn_sink must be None")

    # -- the write --------------------------------------------------------------------------
    def _write(self, q, kv, caches, batch, cos_sin_cache, compressed_kv):
        cache, bs = caches["kv"], self.config.block_size
        if cache.dtype == torch.uint8:
            ci.quantize_insert_v32(kv[:, :D_V], kv[:, D_V:], cache, batch.slot_mapping, bs,
                                   "fp32", self.impl)
            return q
        # A 576-wide bf16 row through the plain insert op (512 wide): dims 0..511, then dims
        # 64..575 (the overlap is written twice with the same values). Slots < 0 skipped.
        tail = D_QK - D_V
        ci.insert_plain(kv[:, :D_V], cache[..., :D_V], batch.slot_mapping, None, self.impl)
        ci.insert_plain(kv[:, tail:], cache[..., tail:], batch.slot_mapping, None, self.impl)
        return q
