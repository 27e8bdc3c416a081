"""A DeepSeek-V4.1 layer step that runs its own two-level Lightning indexer (docs/design.md
"The indexer in a step", docs/semantics.md §11.6).

Each compressed layer has a role (:class:`~sparse_mla.backends.v41.indexer_config.
V41IndexerConfig`, built from the HF config by ``indexer_roles``):

* ``source``: V4's single-level indexer (:class:`IndexerStep` as it is);
* ``candidate_source``: level 1, its own top-k plus the top candidate blocks;
* ``candidate_user``: level 2, its own q / weights over a source layer's index K, top-k inside
  the candidate source's blocks;
* ``reuse``: no indexer: the top-k the latest index source wrote.

Scoring layers whose ``k_source_layer_id`` is themselves insert this step's index K first; the
others read that layer's index K cache (``IndexerInputs.k`` None). The top-k and the candidates
live in one :class:`V41IndexerState` per model, as vLLM keeps one ``topk_indices_buffer`` and
one ``candidate_block_buffer``: the same memory every step, so a captured graph replays them.
The state also tracks, on the host, which layer wrote each buffer in the current forward, so a
reader whose writer did not run (or ran with another token count) raises instead of reading
stale rows; a forward begins where a layer id does not exceed the previous one.

Short context (vLLM ``attention.py``, the indexer's forward): when the batch's
``max_seq_len // ratio <= index_topk`` and no CUDA graph is being captured, no layer scores:
every token's top-k is ``arange((p + 1) // ratio)``, -1 padded, and the candidates are not
written (the index K still is).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.v4.indexer_step import (IndexerInputs, IndexerStep, decode_grid,
                                                 prefill_args)
from sparse_mla.backends.v41.flashmla import V41FlashMLABackend
from sparse_mla.backends.v41.indexer_config import V41IndexerConfig
from sparse_mla.ops.common.dispatch import canonical_device
from sparse_mla.ops.indexer_v41 import (indexer_v41_candidates_decode,
                                        indexer_v41_candidates_prefill,
                                        indexer_v41_topk_in_candidates_decode,
                                        indexer_v41_topk_in_candidates_prefill)


class V41IndexerState:
    """The buffers a V4.1 model's layers share: ``topk`` ``[max_num_tokens, index_topk]`` and
    ``candidates`` ``[max_num_tokens, candidate_topk_blocks]`` int32 (no columns without a
    candidate source), -1 where nothing is selected."""

    def __init__(self, max_num_tokens: int, index_topk: int, candidate_topk_blocks: int = 0,
                 device="cpu"):
        if max_num_tokens < 1 or index_topk < 1 or candidate_topk_blocks < 0:
            raise ValueError(f"max_num_tokens and index_topk must be >= 1 and "
                             f"candidate_topk_blocks >= 0, got {max_num_tokens}, "
                             f"{index_topk}, {candidate_topk_blocks}")
        self.topk = torch.full((max_num_tokens, index_topk), -1, dtype=torch.int32,
                               device=device)
        self.candidates = torch.full((max_num_tokens, candidate_topk_blocks), -1,
                                     dtype=torch.int32, device=device)
        self._forward = 0
        self._last_layer: Optional[int] = None
        self._written = {}          # buffer -> (forward, layer, rows)

    def enter(self, layer_id: int) -> None:
        """A layer's step begins; layer ids restart (or repeat) at the next forward."""
        if self._last_layer is not None and layer_id <= self._last_layer:
            self._forward += 1
        self._last_layer = layer_id

    def wrote(self, buffer: str, layer_id: int, rows: int) -> None:
        self._written[buffer] = (self._forward, layer_id, rows)

    def expect(self, buffer: str, layer_id: int, rows: int, reader: int) -> None:
        """Raises unless ``layer_id`` wrote ``buffer`` for ``rows`` tokens in this forward."""
        got = self._written.get(buffer)
        if got != (self._forward, layer_id, rows):
            seen = "nothing" if got is None or got[0] != self._forward else \
                f"layer {got[1]} for {got[2]} tokens"
            raise ValueError(f"layer {reader} reads the {buffer} of layer {layer_id} for "
                             f"{rows} tokens, but this forward {buffer} holds {seen}: run "
                             f"layer {layer_id}'s step first, on the same batch")


class V41IndexerStep(IndexerStep):
    """A :class:`V41FlashMLABackend` layer plus its part of the V4.1 indexer (module
    docstring). ``impl`` forces the indexer ops' implementation (default: the backend's)."""

    OPS = IndexerStep.OPS + (
        "indexer_v41_candidates_decode", "indexer_v41_candidates_prefill",
        "indexer_v41_topk_in_candidates_decode", "indexer_v41_topk_in_candidates_prefill")

    def __init__(self, backend: V41FlashMLABackend, index: V41IndexerConfig,
                 state: V41IndexerState, impl: Optional[str] = None):
        if not isinstance(index, V41IndexerConfig):
            raise TypeError(f"index must be a V41IndexerConfig, got {type(index).__name__}")
        if not isinstance(state, V41IndexerState):
            raise TypeError(f"state must be a V41IndexerState, got {type(state).__name__}")
        cfg = backend.config
        if cfg.topk != index.index_topk:
            raise ValueError(f"the backend's topk ({cfg.topk}) must be index.index_topk "
                             f"({index.index_topk})")
        if index.index_role != "reuse" and cfg.owns_compressed != index.owns_index_k:
            raise ValueError(f"layer {index.layer_id}: owns_compressed ({cfg.owns_compressed}) "
                             f"must match whether it owns its index K (k_source_layer_id "
                             f"{index.k_source_layer_id}): both live on kv-source layers")
        nb = index.candidate_topk_blocks if index.uses_candidates else None
        if nb is not None and state.candidates.shape[1] != nb:
            raise ValueError(f"state.candidates must have candidate_topk_blocks = {nb} "
                             f"columns, got {state.candidates.shape[1]}")
        if canonical_device(state.candidates.device) != canonical_device(backend.device):
            raise ValueError(f"state must be on the backend's device {backend.device}, got "
                             f"{state.candidates.device}")
        super().__init__(backend, impl, topk=state.topk)
        self.index, self.state = index, state
        self._short = False

    # -- the step ---------------------------------------------------------------------------
    def forward(self, q: Tensor, kv: Tensor, caches, batch: BatchDescription,
                indexer: Optional[IndexerInputs], cos_sin_cache: Optional[Tensor] = None,
                attn_sink: Optional[Tensor] = None, out: Optional[Tensor] = None,
                compressed_kv: Optional[Tensor] = None, planned: bool = False) -> Tensor:
        """This layer's indexer part, then the backend's ``forward`` with the top-k (a view of
        ``state.topk``). ``indexer``: None for a ``reuse`` layer; ``indexer.k`` None for a
        layer scoring another layer's index K."""
        idx, T = self.index, q.shape[0]
        if batch.topk_indices is not None:
            raise ValueError("batch.topk_indices must be None: V41IndexerStep computes the "
                             "top-k (use the backend's own forward to pass one)")
        self.state.enter(idx.layer_id)
        self.backend.validate(q, caches, batch, kv, cos_sin_cache, compressed_kv,
                              attention=False)
        self.backend._check_out(out, attn_sink, q.shape[0])
        if idx.index_role == "reuse":
            if indexer is not None:
                raise ValueError(f"indexer must be None: layer {idx.layer_id} has no indexer "
                                 f"(it reuses layer {idx.topk_source_layer_id}'s top-k)")
            self.state.expect("topk", idx.topk_source_layer_id, T, idx.layer_id)
            topk = self.topk[:T]
        else:
            slots, table = self._validate_role(indexer, batch, T)
            topk = self.select(indexer, batch, T, slots, table)
            self.state.wrote("topk", idx.layer_id, T)
            if idx.index_role == "candidate_source" and not self._short:
                self.state.wrote("candidates", idx.layer_id, T)
        return self.backend.forward(q, kv, caches, dataclasses.replace(batch, topk_indices=topk),
                                    cos_sin_cache, attn_sink, out, compressed_kv, planned)

    def _validate_role(self, ix, batch, T) -> Tuple[Optional[Tensor], Tensor]:
        idx = self.index
        if ix is None:
            raise ValueError(f"indexer is required: layer {idx.layer_id} is an index "
                             f"{idx.index_role}")
        if isinstance(ix, IndexerInputs) and (ix.k is not None) != idx.owns_index_k:
            raise ValueError(
                f"indexer.k must be {'given' if idx.owns_index_k else 'None'}: layer "
                f"{idx.layer_id} " + ("owns its index K" if idx.owns_index_k else
                                      f"scores layer {idx.k_source_layer_id}'s index K"))
        slots, table = self.validate(ix, batch, T)
        self._short = self.short_context(batch)
        if idx.index_role == "candidate_user" and not self._short:
            self.state.expect("candidates", idx.candidate_source_layer_id, T, idx.layer_id)
        return slots, table

    def short_context(self, batch: BatchDescription) -> bool:
        """vLLM's rule: no scoring where every candidate fits in the top-k, except while a
        CUDA graph is captured (the graph must hold the scoring path)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        seq = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        max_seq = int(seq.max()) if seq.numel() else 0
        return max_seq // self.config.kind.ratio <= self.index.index_topk

    # -- scoring ----------------------------------------------------------------------------
    def _score(self, ix, batch, table, out):
        nt, ndt = batch.num_tokens, batch.num_decode_tokens
        if self._short:
            n = (batch.positions[:nt] + 1) // self.config.kind.ratio
            ar = torch.arange(out.shape[1], device=out.device)
            out[:nt] = torch.where(ar < n[:, None], ar, -1)
            return
        if self.index.index_role == "source":
            return super()._score(ix, batch, table, out)
        cands = self.state.candidates[:out.shape[0]]
        if self.index.index_role == "candidate_source":
            cands[nt:].fill_(-1)
        if ndt:
            self._decode_v41(ix, batch, table[:batch.num_decodes], out[:ndt], cands[:ndt])
        if batch.num_prefill_tokens:
            self._prefill_v41(ix, batch, table, out[ndt:nt], cands[ndt:nt])

    def _decode_v41(self, ix, batch, table, out, cands):
        idx, g = self.index, decode_grid(ix.q, ix.weights, batch, table)
        grid = out.new_empty((g.q.shape[0], out.shape[1]))
        common = dict(ratio=self.ratio, next_n=g.next_n, block_size=self.block_size,
                      candidate_block=idx.candidate_block_size, impl=self.impl)
        if idx.index_role == "candidate_source":
            cgrid = cands.new_empty((g.q.shape[0], cands.shape[1]))
            indexer_v41_candidates_decode(g.q, g.weights, ix.k_cache, g.seq_lens,
                                          g.block_table, grid, cgrid, **common)
            cands.copy_(cgrid[g.dst])
        else:
            indexer_v41_topk_in_candidates_decode(
                g.q, g.weights, ix.k_cache, g.seq_lens, g.block_table, g.scatter(cands, -1),
                grid, **common)
        out.copy_(grid[g.dst])

    def _prefill_v41(self, ix, batch, table, out, cands):
        idx, a = self.index, prefill_args(ix.q, ix.weights, ix.k_cache, batch, table,
                                          self.ratio, self.block_size)
        common = dict(ratio=self.ratio, candidate_block=idx.candidate_block_size,
                      impl=self.impl)
        if idx.index_role == "candidate_source":
            indexer_v41_candidates_prefill(*a[:7], out, cands, max_seqlen_k=a.max_seqlen_k,
                                           **common)
        else:
            indexer_v41_topk_in_candidates_prefill(*a[:7], cands, out, **common)

