"""The V3.2 step plan: token → request once per step, the indexer's request-local top-k →
cache slots (or prefill workspace rows) per layer, through ``convert_req_index_to_global``
(docs/semantics.md §4.1), into buffers sized at construction (stable addresses: a uniform
decode step can be captured in a CUDA graph). Prefill chunks: the shared chunked-prefill plan
(``StepPlanner.prefill_chunks``), each request gathering its whole context."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.common.planner import PrefillChunk, StepPlanner
from sparse_mla.backends.v32.config import V32Config
from sparse_mla.ops import index_combine as ic

I32 = torch.int32


class V32Planner(StepPlanner):
    """``plan`` (once per step, shared by the layers of a model): ``token_to_req``.
    ``global_slots`` / ``workspace_rows`` (per layer: each layer has its own indexer)."""

    PLAN_FIELDS = ("block_size", "max_num_tokens", "max_num_reqs", "max_model_len", "topk")

    def __init__(self, cfg: V32Config, device, impl: str = "auto"):
        super().__init__(cfg, device, impl)
        T, R, K = cfg.max_num_tokens, cfg.max_num_reqs, cfg.topk
        kw = dict(dtype=I32, device=device)
        self.slots = torch.full((T, K), -1, **kw)      # cache slots or workspace rows
        self.counts = torch.zeros(T, **kw)             # entries that are not -1, per row
        self.ws_req = torch.zeros(T, **kw)             # prefill rows: request within chunk
        self.ws_starts = torch.zeros(R, **kw)          # a chunk's requests' first rows

    def global_slots(self, batch: BatchDescription, t0: int, t1: int) -> None:
        """Rows ``[t0, t1)``: top-k positions → cache slots via the block table (-1 kept)."""
        ic.convert_req_index_to_global(
            self.token_to_req[t0:t1], batch.block_table, batch.topk_indices[t0:t1],
            self.slots[t0:t1], self.counts[t0:t1], None, None, self.cfg.block_size,
            impl=self.impl)

    def workspace_rows(self, batch: BatchDescription, ch: PrefillChunk) -> None:
        """A prefill chunk's rows: top-k positions → rows of the gathered workspace, where
        request ``i`` of the chunk owns rows ``[i * M, i * M + seq_len)``."""
        Rd, c = batch.num_decodes, ch.r1 - ch.r0
        t = slice(ch.t0, ch.t1)
        torch.sub(self.token_to_req[t], Rd + ch.r0, out=self.ws_req[t])
        torch.mul(self.token_ids[:c], ch.M, out=self.ws_starts[:c])
        ic.convert_req_index_to_global(
            self.token_to_req[t], batch.block_table, batch.topk_indices[t], self.slots[t],
            self.counts[t], self.ws_req[t], self.ws_starts[:c], self.cfg.block_size,
            impl=self.impl)

    def prefill_rows(self, seq: Tensor, ql: Tensor) -> Tuple[Tensor, Tensor]:
        """No compressed entries; the whole context (the indexer may pick any earlier
        token), so ``M`` is the chunk's longest seq_len."""
        return torch.zeros_like(seq), seq
