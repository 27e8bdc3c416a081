"""What the two DeepSeek-V3.2 backends share: construction, the step's inputs and checks,
the cache insert of this step's rows.

A V3.2 step: the model hands over q ``[T, H, 576]`` (q_nope already absorbed into the 512
latent dims, RoPE applied to the last 64), this step's latent rows ``kv_c`` ``[T, 512]``
(normed) and ``k_pe`` ``[T, 64]`` (rotated), and the indexer's request-local top-k
(``batch.topk_indices``); the backend writes the rows into its one token cache
(``batch.block_table`` / ``batch.slot_mapping``), converts the top-k to cache slots and
attends: ``out[T, H, 512]`` in place. V3.2 has no attention sink and no sliding window.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.backends.common.base import Backend, _ops_run
from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.common.validate import (check_request_values, check_slots,
                                                 check_topk, table_covers,
                                                 validate_requests)
from sparse_mla.backends.v32.config import D_QK, D_V, V32Config
from sparse_mla.backends.v32.planner import V32Planner
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops.common import checks

BF16 = torch.bfloat16


class V32Backend(Backend):
    """Subclasses implement ``cache_specs`` and ``_attend``; ``forward`` / ``write`` /
    ``attend`` take V3.2's inputs (no RoPE table, no sink)."""

    PLANNER = V32Planner

    def __init__(self, config: V32Config, device="cpu", impl: str = "auto",
                 attention_impl: Optional[str] = None, planner: Optional[V32Planner] = None):
        if not isinstance(config, V32Config):
            raise TypeError(f"config must be a V32Config, got {type(config).__name__}")
        super().__init__(config, device, impl, attention_impl, planner)

    # -- checks ----------------------------------------------------------------------------
    def validate(self, q: Tensor, caches, batch: BatchDescription,
                 kv_c: Optional[Tensor] = None, k_pe: Optional[Tensor] = None) -> None:
        """Shapes always; values (positions, slots, block tables, top-k ids) on CPU tensors
        or with ``SPARSE_MLA_CHECK_VALUES=1``. Raises before any cache byte is written."""
        cfg = self.config
        self._check_caches(caches)
        checks.expect_dtype("q", q, BF16)
        if q.dim() != 3 or q.shape[1] != cfg.num_heads or q.shape[2] != D_QK:
            raise ValueError(f"q must have shape [num_tokens, {cfg.num_heads}, {D_QK}] (the "
                             f"layer's local heads; 512 latent + 64 RoPE), got {list(q.shape)}")
        checks.expect_last_dim_contiguous("q", q)
        T = q.shape[0]
        Rd, Td, Rp, Tp, R = validate_requests(cfg, batch, T)
        if (kv_c is None) != (k_pe is None):
            raise ValueError("kv_c and k_pe come together")
        if kv_c is not None:
            for name, t, w in (("kv_c", kv_c, D_V), ("k_pe", k_pe, D_QK - D_V)):
                checks.expect_dtype(name, t, BF16)
                checks.expect_shape(name, t, (T, w))
                checks.expect_last_dim_contiguous(name, t)
        tk = check_topk(batch, cfg.topk, Td + Tp, "a V3.2 layer")
        checks.expect_same_device(q=q, kv_c=kv_c, k_pe=k_pe, topk_indices=tk,
                                  query_start_loc=batch.query_start_loc,
                                  seq_lens=batch.seq_lens, positions=batch.positions,
                                  block_table=batch.block_table,
                                  slot_mapping=batch.slot_mapping)
        self._validate_values(q, caches, batch)
        self._validate_batch(batch)

    def _validate_values(self, q, caches, batch):
        if not checks.value_checks_enabled(q, batch.seq_lens):
            return
        cfg = self.config
        nb = caches["kv"].shape[0]
        qsl, seq, ql, tok, want = check_request_values(batch)
        check_slots("batch.slot_mapping", batch.slot_mapping, nb * cfg.block_size)
        table_covers("batch.block_table", batch.block_table, nb, torch.zeros_like(seq),
                     seq - 1, cfg.block_size, "position")
        if tok.numel():
            tk = batch.topk_indices.long().cpu()[tok]
            bad = ((tk < -1) | (tk > want.unsqueeze(1))).nonzero()
            if bad.numel():
                i, j = int(bad[0, 0]), int(bad[0, 1])
                raise ValueError(f"batch.topk_indices[{int(tok[i])}, {j}] = {int(tk[i, j])}: "
                                 f"a token at position {int(want[i])} may select positions "
                                 f"0..{int(want[i])} (-1 pads)")

    def _check_out(self, out: Tensor, attn_sink, T: int) -> None:
        H = self.config.num_heads
        if attn_sink is not None:
            raise ValueError("DeepSeek-V3.2 has no attention sink; attn_sink must be None")
        checks.expect_dtype("out", out, BF16)
        checks.expect_shape("out", out, (T, H, D_V))
        checks.expect_last_dim_contiguous("out", out)

    # -- the step ---------------------------------------------------------------------------
    def forward(self, q: Tensor, kv_c: Tensor, k_pe: Tensor, caches, batch: BatchDescription,
                out: Tensor, planned: bool = False) -> Tensor:
        """Validate, write this step's rows, attend. Returns ``out`` (padding rows zero)."""
        self.validate(q, caches, batch, kv_c, k_pe)
        self._check_out(out, None, q.shape[0])
        with _ops_run(self.OPS) as ran:
            self._write(kv_c, k_pe, caches, batch)
        self._choices = ran
        if not planned:
            self.plan(batch, q.shape[0])
        self._run_attention(q, caches, batch, None, out)
        return out

    def write(self, q: Tensor, kv_c: Tensor, k_pe: Tensor, caches,
              batch: BatchDescription) -> None:
        """This step's rows into the cache only (``q`` is only checked: V3.2's q arrives
        rotated from the model)."""
        self.validate(q, caches, batch, kv_c, k_pe)
        with _ops_run(self.OPS) as ran:
            self._write(kv_c, k_pe, caches, batch)
        self._choices = ran

    def attend(self, q: Tensor, caches, batch: BatchDescription, out: Tensor,
               planned: bool = False) -> Tensor:
        """Attention over the cache as it stands."""
        self.validate(q, caches, batch)
        self._check_out(out, None, q.shape[0])
        self._choices = {}
        if not planned:
            self.plan(batch, q.shape[0])
        self._run_attention(q, caches, batch, None, out)
        return out

    def _write(self, kv_c, k_pe, caches, batch):
        cache, bs = caches["kv"], self.config.block_size
        if cache.dtype == torch.uint8:
            ci.quantize_insert_v32(kv_c, k_pe, cache, batch.slot_mapping, bs, "fp32", self.impl)
            return
        # A 576-wide bf16 row through the plain insert op (512 wide): dims 0..511, then dims
        # 64..575 (the overlap is written twice with the same values). Slots < 0 skipped.
        T = kv_c.shape[0]
        rows = self.rows[:T]
        torch.cat([kv_c, k_pe], dim=1, out=rows)
        ci.insert_plain(rows[:, :D_V], cache[..., :D_V], batch.slot_mapping, None, self.impl)
        ci.insert_plain(rows[:, D_QK - D_V:], cache[..., D_QK - D_V:], batch.slot_mapping, None,
                        self.impl)

    def _bf16_rows_buffer(self):
        self.rows = torch.empty(self.config.max_num_tokens, D_QK, dtype=BF16,
                                device=self.device)
