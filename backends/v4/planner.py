"""DeepSeek-V4's step plan (docs/semantics.md §4): the SWA window, C4A and C128A index lists
of one step, into buffers sized at construction (stable addresses: a uniform decode step can be
captured in a CUDA graph), over the shared chunked-prefill plan (``backends/common/planner.py``).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.common.planner import StepPlanner
from sparse_mla.backends.v4.config import LayerConfig, LayerKind
from sparse_mla.ops import index_combine as ic

I32 = torch.int32


class IndexPlanner(StepPlanner):
    """DeepSeek-V4's per-token metadata and index lists. :meth:`plan` builds what depends only
    on the batch (token → request, validity, decode windows, C128A lists, request lengths):
    once per step, shared by every layer of one kind (as vLLM's metadata builders do). What
    depends on a layer's own indexer (C4A top-k) is converted per layer (:meth:`c4a_decode`)."""

    PLAN_FIELDS = ("kind", "window", "swa_block_size", "compressed_block_size",
                   "max_num_tokens", "max_num_reqs", "max_model_len", "topk")

    def __init__(self, cfg: LayerConfig, device, impl: str = "auto"):
        super().__init__(cfg, device, impl)
        T, R, W = cfg.max_num_tokens, cfg.max_num_reqs, cfg.window
        kw = dict(dtype=I32, device=device)
        self.is_valid = torch.zeros(T, dtype=torch.bool, device=device)
        self.swa_indices = torch.full((T, W), -1, **kw)
        self.swa_lens = torch.zeros(T, **kw)
        K = cfg.compressed_width
        self.compressed_indices = torch.full((T, K), -1, **kw)
        self.compressed_lens = torch.zeros(T, **kw)
        # C128A prefill rows: request-local ids 0..n-1 (converted by the backend's combine).
        self.c128a_prefill = torch.full((T, K if cfg.kind is LayerKind.C128A else 0), -1, **kw)
        self.no_topk = torch.empty(T, 0, **kw)      # SWA-only layers have no compressed list
        self.query_lens = torch.zeros(R, **kw)
        self.gather_lens = torch.zeros(R, **kw)
        self.entries = torch.zeros(R, **kw)          # seq_len // ratio

    def decode_window(self, batch: BatchDescription) -> None:
        Td = batch.num_decode_tokens
        ic.swa_indices_and_lens(batch.query_start_loc, batch.seq_lens, self.token_to_req,
                                self.is_valid, batch.swa_block_table, self.swa_indices[:Td],
                                self.swa_lens[:Td], self.cfg.swa_block_size, self.cfg.window,
                                impl=self.impl)

    def plan(self, batch: BatchDescription, T: int) -> None:
        """Everything a step's layers of this kind share; ``T``: rows of q (padding included)."""
        Td, Tp = batch.num_decode_tokens, batch.num_prefill_tokens
        self.op_plans.clear()
        self.token_requests(batch, T)
        torch.ge(batch.swa_slot_mapping, 0, out=self.is_valid[:T])
        if Td:
            self.decode_window(batch)
        self.c128a_lists(batch, Tp)
        if Tp:
            self.request_lengths(batch)

    def c4a_decode(self, batch: BatchDescription) -> None:
        """C4A decode rows: this layer's indexer top-k as global slots (per layer)."""
        cfg, Td = self.cfg, batch.num_decode_tokens
        if cfg.kind.uses_topk and Td:
            ic.global_topk_indices_and_lens(
                batch.topk_indices[:Td], self.token_to_req, batch.compressed_block_table,
                self.is_valid[:Td], self.compressed_indices[:Td], self.compressed_lens[:Td],
                cfg.compressed_block_size, self.impl)

    def c128a_lists(self, batch: BatchDescription, Tp: int) -> None:
        """C128A: every completed entry (decode rows global, prefill rows request-local)."""
        cfg, Td = self.cfg, batch.num_decode_tokens
        if cfg.kind is LayerKind.C128A and Td + Tp:
            ic.c128a_indices_and_lens(
                batch.positions, batch.swa_slot_mapping, self.token_to_req,
                batch.compressed_block_table, self.compressed_indices[:Td],
                self.compressed_lens[:Td], self.c128a_prefill[:Tp],
                cfg.compressed_block_size, cfg.kind.ratio, self.impl)

    def prefill_topk(self, batch: BatchDescription, t0: int, t1: int) -> Tensor:
        """Request-local compressed ids of prefill rows ``[t0, t1)`` (batch rows)."""
        kind, Td = self.cfg.kind, batch.num_decode_tokens
        if kind.uses_topk:
            return batch.topk_indices[t0:t1]
        if kind is LayerKind.C128A:
            return self.c128a_prefill[t0 - Td:t1 - Td]
        return self.no_topk[t0:t1]

    @property
    def prefill_topk_width(self) -> int:
        """The ``topk`` the combine ops take: top-k, the C128A list width, or 0."""
        return self.cfg.compressed_width

    def request_lengths(self, batch: BatchDescription) -> None:
        """Device: query_lens, gather_lens = q + min(prefix, W - 1), entries = seq // ratio."""
        R, W = batch.num_reqs, self.cfg.window
        qsl, seq = batch.query_start_loc, batch.seq_lens
        ql, gl = self.query_lens[:R], self.gather_lens[:R]
        torch.sub(qsl[1:R + 1], qsl[:R], out=ql)
        torch.sub(seq, ql, out=gl)
        torch.clamp(gl, max=W - 1, out=gl)
        gl.add_(ql)
        if self.cfg.kind.compressed:
            torch.div(seq, self.cfg.kind.ratio, rounding_mode="floor", out=self.entries[:R])

    def prefill_rows(self, seq: Tensor, ql: Tensor) -> Tuple[Tensor, Tensor]:
        """The request's compressed entries, then its window context and new tokens
        (docs/semantics.md §4.4)."""
        cfg = self.cfg
        n = seq // cfg.kind.ratio if cfg.kind.compressed else torch.zeros_like(seq)
        return n, ql + torch.clamp(seq - ql, max=cfg.window - 1)
