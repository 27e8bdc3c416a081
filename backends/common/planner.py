"""The step planners: docs/semantics.md §4's index tensors for one step, into buffers sized once.

Every buffer is allocated at construction from the layer config's capacities, and a step
writes slices of them: stable addresses, no allocation and no host sync on the decode path,
so a uniform decode step can be captured in a CUDA graph and replayed with the batch tensors
updated in place. Prefill planning reads host copies of the request lengths (prefill runs
eagerly, as in vLLM).

:class:`StepPlanner` is what every model's planner shares (token → request, sharing between
layers, the chunked-prefill plan); :class:`IndexPlanner` is DeepSeek-V4's, ``backends/v32``'s
``V32Planner`` DeepSeek-V3.2's.
"""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription, LayerKind
from sparse_mla.backends.common.config import LayerConfig
from sparse_mla.ops import index_combine as ic

I32 = torch.int32


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Prefill requests ``[r0, r1)`` (indices among the prefills) and their tokens
    ``[t0, t1)`` (batch rows), gathered together: request b owns workspace rows
    ``[b*M, b*M + M)``, compressed entries first (``N`` rows), then its gathered context."""

    r0: int
    r1: int
    t0: int
    t1: int
    N: int
    M: int


def host_lengths(batch: BatchDescription) -> Tuple[Tensor, Tensor]:
    """Host copies of query_start_loc and seq_lens (the batch's, else one copy: a sync, so
    prefill only)."""
    qsl = batch.query_start_loc_cpu
    seq = batch.seq_lens_cpu
    if qsl is None:
        qsl = batch.query_start_loc.cpu()
    if seq is None:
        seq = batch.seq_lens.cpu()
    return qsl.long(), seq.long()


class StepPlanner:
    """What a step's layers of one shape share. :meth:`plan` (once per step) maps every row of
    q to its request; :meth:`prefill_chunks` packs the prefill requests into chunks whose
    gathered rows fit the layer's ``prefill_workspace_rows``. A model's planner adds its index
    lists and says, in :meth:`prefill_rows`, how many workspace rows a request gathers.

    ``PLAN_FIELDS``: the config fields a step plan depends on; layers whose configs agree on
    them may share one planner (:meth:`compatible`, :meth:`plan_key`)."""

    PLAN_FIELDS: Tuple[str, ...] = ("max_num_tokens", "max_num_reqs", "max_model_len")

    def __init__(self, cfg, device, impl: str = "auto"):
        self.cfg = cfg
        self.impl = impl
        T, R = cfg.max_num_tokens, cfg.max_num_reqs
        # row ids of q, and request ids of a chunk (V3.2's workspace starts)
        self.token_ids = torch.arange(max(T, R), dtype=I32, device=device)
        self.token_to_req = torch.zeros(T, dtype=I32, device=device)

    @classmethod
    def plan_key(cls, cfg) -> tuple:
        """Equal for exactly the configs whose layers may share one planner of this class."""
        return (cls, type(cfg)) + tuple(getattr(cfg, f) for f in cls.PLAN_FIELDS)

    def compatible(self, cfg) -> bool:
        """Whether a layer of ``cfg`` may share this planner's step plan."""
        return self.plan_key(cfg) == self.plan_key(self.cfg)

    def plan(self, batch: BatchDescription, T: int) -> None:
        """Everything a step's layers share; ``T``: rows of q (padding included)."""
        self.token_requests(batch, T)

    def token_requests(self, batch: BatchDescription, T: int) -> None:
        """token_to_req for ``T`` rows of q (``R`` for padding rows past the last request)."""
        R = batch.num_reqs
        torch.searchsorted(batch.query_start_loc[1:R + 1], self.token_ids[:T], right=True,
                           out_int32=True, out=self.token_to_req[:T])

    # -- the chunked prefill ------------------------------------------------------------------
    def prefill_rows(self, seq: Tensor, ql: Tensor) -> Tuple[Tensor, Tensor]:
        """Per prefill request (host int64 ``seq_len``, ``query_len``): the workspace rows it
        gathers, as ``(N, G)``: ``N`` compressed entries (gathered first), then ``G`` rows of
        token context."""
        raise NotImplementedError

    def _prefill_requests(self, batch: BatchDescription):
        Rd, R = batch.num_decodes, batch.num_reqs
        qsl, seq = host_lengths(batch)
        seq, ql = seq[Rd:R], qsl[Rd + 1:R + 1] - qsl[Rd:R]
        n, g = self.prefill_rows(seq, ql)
        return qsl, seq, ql, n, g

    def prefill_chunks(self, batch: BatchDescription) -> List[PrefillChunk]:
        """Prefill requests packed in order into chunks whose gathered rows fit the workspace:
        a chunk of ``c`` requests takes ``c * M`` rows, ``M = max N + max G`` over it."""
        Rd, Rp = batch.num_decodes, batch.num_prefills
        rows = self.cfg.prefill_workspace_rows
        qsl, _, _, n, g = self._prefill_requests(batch)
        chunks, r0 = [], 0
        while r0 < Rp:
            r1, N, G = r0 + 1, int(n[r0]), int(g[r0])
            while r1 < Rp:
                N2, G2 = max(N, int(n[r1])), max(G, int(g[r1]))
                if (r1 + 1 - r0) * (N2 + G2) > rows:
                    break
                N, G, r1 = N2, G2, r1 + 1
            t0 = int(qsl[Rd + r0]) - int(qsl[Rd]) + batch.num_decode_tokens
            t1 = int(qsl[Rd + r1]) - int(qsl[Rd]) + batch.num_decode_tokens
            chunks.append(PrefillChunk(r0, r1, t0, t1, N, N + G))
            r0 = r1
        return chunks

    def check_prefill_fits(self, batch: BatchDescription) -> None:
        """Every prefill request fits the workspace on its own (host ints; prefill only)."""
        if not batch.num_prefills:
            return
        rows = self.cfg.prefill_workspace_rows
        _, seq, ql, n, g = self._prefill_requests(batch)
        need = n + g
        over = (need > rows).nonzero().flatten()
        if over.numel():
            r = int(over[0])
            raise ValueError(f"prefill request {r} (seq_len {int(seq[r])}, query_len "
                             f"{int(ql[r])}) needs {int(need[r])} workspace rows, more than "
                             f"prefill_workspace_rows={rows}; split its chunk or raise the "
                             f"capacity")


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
