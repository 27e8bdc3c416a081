"""The V3.2 step plan: token → request once per step, the indexer's request-local top-k →
cache slots (or prefill workspace rows) per layer, through ``convert_req_index_to_global``
(docs/semantics.md §4.1), into buffers sized at construction (stable addresses: a uniform
decode step can be captured in a CUDA graph)."""
from __future__ import annotations

from typing import List

import torch

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.common.planner import PrefillChunk
from sparse_mla.backends.v32.config import V32Config
from sparse_mla.ops import index_combine as ic

I32 = torch.int32


def host_lengths(batch: BatchDescription):
    """Host copies of query_start_loc and seq_lens (the batch's, else one copy: prefill only)."""
    qsl = batch.query_start_loc_cpu
    seq = batch.seq_lens_cpu
    qsl = batch.query_start_loc.cpu() if qsl is None else qsl
    seq = batch.seq_lens.cpu() if seq is None else seq
    return qsl.long(), seq.long()


class V32Planner:
    """``plan`` (once per step, shared by the layers of a model): ``token_to_req``.
    ``global_slots`` / ``workspace_rows`` (per layer: each layer has its own indexer)."""

    def __init__(self, cfg: V32Config, device, impl: str = "auto"):
        self.cfg, self.impl = cfg, impl
        T, R, K = cfg.max_num_tokens, cfg.max_num_reqs, cfg.topk
        kw = dict(dtype=I32, device=device)
        self.token_ids = torch.arange(max(T, R), **kw)
        self.token_to_req = torch.zeros(T, **kw)
        self.slots = torch.full((T, K), -1, **kw)      # cache slots or workspace rows
        self.counts = torch.zeros(T, **kw)             # entries that are not -1, per row
        self.ws_req = torch.zeros(T, **kw)             # prefill rows: request within chunk
        self.ws_starts = torch.zeros(R, **kw)          # a chunk's requests' first rows

    def compatible(self, cfg: V32Config) -> bool:
        mine = self.cfg
        return all(getattr(cfg, f) == getattr(mine, f) for f in (
            "block_size", "max_num_tokens", "max_num_reqs", "max_model_len", "topk"))

    def plan(self, batch: BatchDescription, T: int) -> None:
        """token_to_req for ``T`` rows of q (``R`` for padding rows past the last request)."""
        R = batch.num_reqs
        torch.searchsorted(batch.query_start_loc[1:R + 1], self.token_ids[:T], right=True,
                           out_int32=True, out=self.token_to_req[:T])

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

    def prefill_chunks(self, batch: BatchDescription) -> List[PrefillChunk]:
        """Prefill requests packed into chunks of ``c`` requests with ``c * M`` workspace rows
        at most ``prefill_workspace_rows``, ``M`` = the chunk's longest seq_len (the whole
        context is gathered: the indexer may pick any earlier token)."""
        Rd, Rp = batch.num_decodes, batch.num_prefills
        qsl, seq = host_lengths(batch)
        seq = seq[Rd:Rd + Rp]
        chunks, r0 = [], 0
        while r0 < Rp:
            r1, M = r0 + 1, int(seq[r0])
            while r1 < Rp and (r1 + 1 - r0) * max(M, int(seq[r1])) <= \
                    self.cfg.prefill_workspace_rows:
                M, r1 = max(M, int(seq[r1])), r1 + 1
            t0 = int(qsl[Rd + r0]) - int(qsl[Rd]) + batch.num_decode_tokens
            t1 = int(qsl[Rd + r1]) - int(qsl[Rd]) + batch.num_decode_tokens
            chunks.append(PrefillChunk(r0, r1, t0, t1, 0, M))
            r0 = r1
        return chunks
