"""A GLM-5.3 DSA layer step that runs its own pooled-key (kpool) indexer (docs/semantics.md
§13): kpool insert -> top-k (prefill / decode) -> the MLA record -> attention, in one call.

The order follows vLLM 0.33.0 (``V`` = ``vllm/models/glm5next/``):

1. the indexer keys go in first: prefill pools and the tail ring
   (``V/nvidia/sparse_indexer.py``:215-253), decode pools completed from the ring "before
   reading logits" (:443-560). ``kpool_k_insert`` does both in one call, so a token's own
   pool, completed in this step, is a candidate of the same step;
2. the top-k buffer's rows are reset to -1 (:266); prefill tokens are selected over their
   requests' pooled keys gathered densely (:268-435), decode tokens over the paged pooled
   cache, MTP rows at ``seq_len - next_n + i`` (:562-705); both append the incomplete pool's
   tail tokens (``index_kpool_always_select_tail``), which the attention reads from the MLA
   cache this step writes;
3. the MLA record and the attention (``Glm5FlashMLABackend``) read the buffer
   ``[T, round_up(index_topk + kpool - 1, 128)]`` (``V/common/model.py``:108-112).

Short context (:273-299 prefill, :562-569 decode via ``V/common/sparse_indexer.py``:109-129):
prefill rows are filled with 0..p, nothing scored, when the batch's longest prefill sequence
is <= ``index_topk`` tokens; decode rows likewise when the batch's longest sequence is. The
set equals the scored one (every pool fits); only the order differs. Not while a CUDA graph is
captured: the graph must hold the scoring path (as the V4.1 step does).

The top-k buffer is persistent (CUDA-graph safe, like the backend's planner buffers), and
everything is validated before the first byte is written.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.glm5.config import INDEX_TOPK, KPOOL, Glm5Config, topk_width
from sparse_mla.backends.glm5.flashmla import Glm5FlashMLABackend
from sparse_mla.backends.v4.indexer_step import (check_prefill_blocks, decode_grid,
                                                 prefill_args, topk_buffer)
from sparse_mla.ops.common import checks, dispatch
from sparse_mla.ops.common.dispatch import canonical_device
from sparse_mla.ops.indexer_kpool import format as kfmt
from sparse_mla.ops.indexer_kpool import kpool_k_insert, kpool_topk_decode, kpool_topk_prefill
from sparse_mla.ops.indexer_kpool import ops as kpool_ops



def _ue8m0_scales(raw: Tensor) -> Tensor:
    """A pooled entry's ue8m0 scale byte (the first of its four) as the fp32 power of two it
    encodes."""
    return (raw[:, 0].to(torch.int32) << 23).view(torch.float32)


@dataclasses.dataclass(frozen=True)
class Glm5IndexerConfig:
    """The indexer's static shape (GLM-5.3-Flash defaults): ``num_heads`` x 128 query heads,
    ``index_topk`` tokens selected as ``index_topk // kpool`` pools, the pooled cache's scale
    bytes ``scale_fmt`` (``"ue8m0"``: vLLM on sm_100)."""

    num_heads: int = 32
    head_dim: int = kfmt.DIM
    index_topk: int = INDEX_TOPK
    kpool: int = KPOOL
    scale_fmt: str = "fp32"

    def __post_init__(self):
        if self.head_dim != kfmt.DIM:
            raise ValueError(f"head_dim must be {kfmt.DIM}, got {self.head_dim}")
        if not 1 <= self.num_heads <= kfmt.MAX_HEADS:
            raise ValueError(f"num_heads must be in 1..{kfmt.MAX_HEADS}, got {self.num_heads}")
        if self.kpool < 2:
            raise ValueError(f"kpool must be >= 2, got {self.kpool}")
        if self.index_topk < self.kpool or self.index_topk % self.kpool:
            raise ValueError(f"index_topk must be a positive multiple of kpool={self.kpool}, "
                             f"got {self.index_topk}")
        if self.scale_fmt not in kfmt.SCALE_FMTS:
            raise ValueError(f"scale_fmt must be one of {kfmt.SCALE_FMTS}, got "
                             f"{self.scale_fmt!r}")

    @property
    def width(self) -> int:
        """Columns the selection ops write: ``index_topk + kpool - 1``."""
        return self.index_topk + self.kpool - 1


@dataclasses.dataclass
class Glm5IndexerInputs:
    """One step's indexer tensors (the backend's device).

    - ``q`` ``[T, num_heads, 128]`` bf16 or e4m3, Hadamard-rotated; ``weights`` ``[T,
      num_heads]`` fp32 / bf16 with every scale folded in (§13.2). One row per row of the
      attention q (graph-padding rows select nothing).
    - ``k``, ``gate`` ``[N, 128]`` bf16: this step's raw indexer keys and gate scores, row i
      at ``positions[i]``; ``ape`` ``[kpool, 128]`` fp32 (the layer's pool bias).
    - ``k_cache``: the pooled cache (``ops.indexer_kpool.alloc_cache``, uint8 ``[blocks, bs,
      132]``); ``block_table`` ``[R, *]`` its blocks per request, ``slot_mapping`` its
      pool-granular slots (>= 0 on a pool's last token only); defaults
      ``batch.compressed_block_table`` / ``batch.compressed_slot_mapping``.
    - ``tail_cache`` (``alloc_tail_cache``) and ``tail_slot_mapping`` (token-granular
      ``block * ring + pos % ring``, -1 none).
    """

    q: Tensor
    weights: Tensor
    k: Tensor
    gate: Tensor
    ape: Tensor
    k_cache: Tensor
    tail_cache: Tensor
    tail_slot_mapping: Tensor
    slot_mapping: Optional[Tensor] = None
    block_table: Optional[Tensor] = None


class Glm5IndexerStep:
    """A :class:`Glm5FlashMLABackend` layer plus GLM-5.3's kpool indexer (module docstring).
    ``impl`` forces the indexer ops' and the backend's implementation; ``config.topk`` must be
    ``round_up(index.index_topk + index.kpool - 1, 128)``. ``topk``: the persistent ``[max_num_
    tokens, config.topk]`` int32 buffer to write (default: a new one; a model's layers may
    share one, as vLLM's do)."""

    OPS = ("kpool_k_insert", "kpool_topk_decode", "kpool_topk_prefill")

    def __init__(self, config: Glm5Config, device="cpu", impl: str = "auto",
                 index: Optional[Glm5IndexerConfig] = None, attention_impl=None,
                 fp8_mode: str = "auto", topk: Optional[Tensor] = None):
        index = Glm5IndexerConfig() if index is None else index
        if not isinstance(index, Glm5IndexerConfig):
            raise TypeError(f"index must be a Glm5IndexerConfig, got {type(index).__name__}")
        want = topk_width(index.index_topk, index.kpool)
        if config.topk != want:
            raise ValueError(f"config.topk must be round_up(index_topk + kpool - 1, 128) = "
                             f"{want} for index_topk={index.index_topk}, kpool={index.kpool}; "
                             f"got {config.topk}")
        self.backend = Glm5FlashMLABackend(config, device, impl, attention_impl,
                                           fp8_mode=fp8_mode)
        self.config, self.index, self.impl = config, index, impl
        self.topk = topk_buffer(topk, config, self.backend.device)
        self._choices = {}

    def explain(self):
        """What each op of the last step ran: the indexer's, then the backend's."""
        return {**self._choices, **self.backend.explain()}

    # -- the step ---------------------------------------------------------------------------
    def forward(self, q: Tensor, kv: Tensor, caches, batch: BatchDescription,
                indexer: Glm5IndexerInputs, out: Optional[Tensor] = None,
                planned: bool = False) -> Tensor:
        """Indexer insert, top-k into the persistent buffer, then the backend's ``forward``
        with ``batch.topk_indices`` = a view of it. ``batch.topk_indices`` must be None."""
        if batch.topk_indices is not None:
            raise ValueError("batch.topk_indices must be None: Glm5IndexerStep computes the "
                             "top-k (use the backend's own forward to pass one)")
        T = q.shape[0]
        self.backend.validate(q, caches, batch, kv, attention=False)
        self.backend._check_out(out, None, T)
        slots, table, bs = self.validate(indexer, batch, T)
        topk = self.select(indexer, batch, T, slots, table, bs)
        return self.backend.forward(q, kv, caches, dataclasses.replace(batch, topk_indices=topk),
                                    out=out, planned=planned)

    def select(self, ix: Glm5IndexerInputs, batch: BatchDescription, rows: int, slots: Tensor,
               table: Tensor, block_size: int) -> Tensor:
        """Insert this step's keys, then every row's top-k: a view ``[rows, config.topk]`` of
        the persistent buffer (decode tokens, prefill tokens, then -1 rows)."""
        idx, out = self.index, self.topk[:rows]
        nt, ndt = batch.num_tokens, batch.num_decode_tokens
        with dispatch.recording(self.OPS) as ran:
            kpool_k_insert(ix.k, ix.gate, ix.ape, batch.positions, slots, ix.tail_slot_mapping,
                           ix.k_cache, ix.tail_cache, idx.kpool, block_size, idx.scale_fmt,
                           impl=self.impl)
            out.fill_(-1)
            if ndt:
                if self._short(batch.seq_lens_cpu, batch.seq_lens, 0, batch.num_reqs):
                    self._causal(out[:ndt], batch.positions[:ndt])
                else:
                    self._decode(ix, batch, table, block_size, out[:ndt, :idx.width])
            if batch.num_prefill_tokens:
                nd = batch.num_decodes
                if self._short(batch.seq_lens_cpu, batch.seq_lens, nd, batch.num_reqs):
                    self._causal(out[ndt:nt], batch.positions[ndt:nt])
                else:
                    self._prefill(ix, batch, table, block_size, out[ndt:nt, :idx.width])
        self._choices = ran
        return out

    # -- short context ----------------------------------------------------------------------
    def _short(self, seq_cpu, seq, lo, hi) -> bool:
        """The longest sequence of requests lo..hi-1 has <= index_topk tokens (vLLM: prefill
        rows look at the prefills, decode rows at the whole batch), outside graph capture."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        s = (seq_cpu if seq_cpu is not None else seq)[lo:hi]
        return not s.numel() or int(s.max()) <= self.index.index_topk

    @staticmethod
    def _causal(rows: Tensor, positions: Tensor) -> None:
        ar = torch.arange(rows.shape[1], device=rows.device, dtype=torch.int32)
        rows.copy_(torch.where(ar <= positions[:, None].to(torch.int32), ar, -1))

    # -- decode and prefill: V4's grid and dense gather with the pool as the entry ------
    def _decode(self, ix, batch, table, bs, out):
        """The paged op over V4's uniform ``[requests + 1, next_n]`` grid (no host sync for
        MTP drafts of unequal length or graph padding)."""
        g = decode_grid(ix.q, ix.weights, batch, table)
        grid = out.new_empty((g.q.shape[0], out.shape[1]))
        kpool_topk_decode(g.q, g.weights, ix.k_cache, g.seq_lens, g.block_table, grid,
                          self.index.kpool, g.next_n, bs, None, self.index.scale_fmt,
                          impl=self.impl)
        out.copy_(grid[g.dst])

    def _prefill(self, ix, batch, table, bs, out):
        a = prefill_args(ix.q, ix.weights, ix.k_cache, batch, table, self.index.kpool, bs,
                         _ue8m0_scales if self.index.scale_fmt == "ue8m0" else None)
        kpool_topk_prefill(*a[:7], out, self.index.kpool, 0, a.max_seqlen_k, impl=self.impl)

    # -- validation -------------------------------------------------------------------------
    def validate(self, ix: Glm5IndexerInputs, batch: BatchDescription, rows: int):
        """Raises on a bad indexer input; returns (slot mapping, block table, pooled block
        size)."""
        if not isinstance(ix, Glm5IndexerInputs):
            raise TypeError(f"indexer must be Glm5IndexerInputs, got {type(ix).__name__}")
        idx = self.index
        checks.expect_dtype("indexer.q", ix.q, (torch.bfloat16, torch.float8_e4m3fn))
        if ix.q.dim() != 3 or tuple(ix.q.shape) != (rows, idx.num_heads, kfmt.DIM):
            raise ValueError(f"indexer.q must have shape [{rows}, {idx.num_heads}, {kfmt.DIM}] "
                             f"(one row per row of q), got {list(ix.q.shape)}")
        checks.expect_tensor("indexer.weights", ix.weights, (torch.float32, torch.bfloat16),
                             (rows, idx.num_heads))
        slots = batch.compressed_slot_mapping if ix.slot_mapping is None else ix.slot_mapping
        table = batch.compressed_block_table if ix.block_table is None else ix.block_table
        if slots is None or table is None:
            raise ValueError("the pooled cache needs a slot mapping and a block table: "
                             "indexer.slot_mapping / indexer.block_table or batch."
                             "compressed_slot_mapping / batch.compressed_block_table")
        checks.expect_block_table("indexer.block_table", table, min_rows=batch.num_reqs)
        bs = self._pool_block_size(ix)
        try:
            kpool_ops._validate_insert(ix.k, ix.gate, ix.ape, batch.positions, slots,
                                       ix.tail_slot_mapping, ix.k_cache, ix.tail_cache,
                                       idx.kpool, bs, idx.scale_fmt)
        except (TypeError, ValueError) as e:
            raise type(e)(f"indexer: {e}") from None
        checks.expect_same_device(q=ix.q, weights=ix.weights, k_cache=ix.k_cache,
                                  block_table=table)
        if canonical_device(ix.q.device) != canonical_device(self.backend.device):
            raise ValueError(f"the indexer inputs must be on the backend's device "
                             f"{self.backend.device}, got {ix.q.device}")
        if checks.value_checks_enabled(table):
            check_prefill_blocks(batch, table, ix.k_cache.shape[0], bs, self.index.kpool,
                                 "pools")
        return slots, table, bs

    @staticmethod
    def _pool_block_size(ix):
        if ix.k_cache.dim() == 2:
            raise ValueError(f"indexer.k_cache must be the pooled cache's [num_blocks, "
                             f"block_size, {kfmt.DIM + 4}] view, got {list(ix.k_cache.shape)}")
        return checks.paged_cache_block_size("indexer.k_cache", ix.k_cache, kfmt.FP8, None)
