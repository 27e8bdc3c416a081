"""The step planner every model's planner builds on: docs/semantics.md §4's index tensors for
one step go into buffers sized once.

Every buffer is allocated at construction from the layer config's capacities, and a step
writes slices of them: stable addresses, no allocation and no host sync on the decode path,
so a uniform decode step can be captured in a CUDA graph and replayed with the batch tensors
updated in place. Prefill planning reads host copies of the request lengths (prefill runs
eagerly, as in vLLM).

:class:`StepPlanner` is what every model's planner shares (token → request, sharing between
layers, the chunked-prefill plan); ``backends/v4/planner.py``'s ``IndexPlanner`` is
DeepSeek-V4's, ``backends/v32/planner.py``'s ``V32Planner`` DeepSeek-V3.2's.
"""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription

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
        # this step's op plans (``flashmla_decode.decode_with_plans``), emptied by ``plan``
        self.op_plans: dict = {}

    @classmethod
    def plan_key(cls, cfg) -> tuple:
        """Equal for exactly the configs whose layers may share one planner of this class."""
        return (cls, type(cfg)) + tuple(getattr(cfg, f) for f in cls.PLAN_FIELDS)

    def compatible(self, cfg) -> bool:
        """Whether a layer of ``cfg`` may share this planner's step plan."""
        return self.plan_key(cfg) == self.plan_key(self.cfg)

    def plan(self, batch: BatchDescription, T: int) -> None:
        """Everything a step's layers share; ``T``: rows of q (padding included)."""
        self.op_plans.clear()
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
