"""A C4A step that computes its own top-k: indexer insert -> top-k -> index combine ->
attention in one call (docs/design.md "The indexer in a step", docs/semantics.md §11).

:class:`IndexerStep` wraps a C4A backend. Its ``forward`` takes the backend's usual inputs plus
the indexer's (:class:`IndexerInputs`), writes this step's indexer keys into the paged indexer
cache, selects every token's top ``config.topk`` entries (decode tokens over the paged cache,
MTP included; prefill tokens over their requests' entries gathered densely, as vLLM gathers its
workspace), and hands the ids to the backend as ``BatchDescription.topk_indices``. The backend
and its existing path (top-k given by the caller) are unchanged.

Everything is validated before the first byte is written. The indexer cache shares the
compressed cache's addressing unless the inputs name their own block table and slot mapping
(vLLM gives both caches the same block size, 256 // ratio entries).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from sparse_mla.backends.common.base import Backend
from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.ops.common import checks, dispatch
from sparse_mla.ops.common.dispatch import canonical_device
from sparse_mla.ops.indexer import format as fmt
from sparse_mla.ops.indexer import indexer_k_insert, indexer_topk_decode, indexer_topk_prefill


@dataclasses.dataclass
class IndexerInputs:
    """One step's indexer tensors (device tensors, the backend's device).

    - ``q`` ``[T, H_idx, 128]`` bf16 or e4m3: the indexer query after RoPE, one row per row
      of the attention q (graph-padding rows included; they select nothing).
    - ``weights`` ``[T, H_idx]`` fp32 / bf16: every scale folded in (§11.2).
    - ``k`` ``[N, 128]``: this step's indexer compressor rows, row i written at
      ``slot_mapping[i]`` (-1: none); default ``batch.compressed_slot_mapping``. None (with
      no slot mapping) for a DeepSeek-V4.1 layer scoring another layer's keys.
    - ``k_cache``: the paged indexer cache (``ops.indexer.alloc_cache``: fp8 pages or bf16).
    - ``block_table`` ``[R, *]``: its blocks per request; default
      ``batch.compressed_block_table``.
    """

    q: Tensor
    weights: Tensor
    k: Optional[Tensor]
    k_cache: Tensor
    slot_mapping: Optional[Tensor] = None
    block_table: Optional[Tensor] = None


class DecodeGrid(NamedTuple):
    """Decode tokens laid out as the paged ops take them (:func:`decode_grid`):
    grid row ``dst[i]`` holds decode token i."""

    dst: Tensor
    q: Tensor
    weights: Tensor
    seq_lens: Tensor
    block_table: Tensor
    next_n: int

    def scatter(self, x: Tensor, fill) -> Tensor:
        """Per-token rows ``x`` (decode tokens first) -> grid rows, ``fill`` elsewhere."""
        g = x.new_full((self.q.shape[0],) + tuple(x.shape[1:]), fill)
        g[self.dst] = x[:self.dst.shape[0]]
        return g


class PrefillArgs(NamedTuple):
    """The prefill tokens and their requests' keys as the dense prefill ops take them."""

    q: Tensor
    weights: Tensor
    k: Tensor
    k_scale: Optional[Tensor]
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    positions: Tensor
    max_seqlen_k: int


class IndexerStep:
    """A C4A backend plus the Lightning indexer. ``impl`` forces the indexer ops'
    implementation ("reference", "triton", ...; default: the backend's ``impl``). ``topk``:
    the persistent ``[max_num_tokens, config.topk]`` int32 buffer to write (default: a new
    one; DeepSeek-V4.1's layers share one)."""

    OPS = ("indexer_k_insert", "indexer_topk_decode", "indexer_topk_prefill")

    # The batch fields that address the indexer cache by default (vLLM gives it the
    # addressing of the cache its entries index: the compressed one here).
    TABLE, SLOTS = "compressed_block_table", "compressed_slot_mapping"

    def __init__(self, backend: Backend, impl: Optional[str] = None,
                 topk: Optional[Tensor] = None):
        cfg = backend.config
        self.backend = backend
        self.config = cfg
        self.impl = impl or backend.impl
        self.ratio, self.block_size = self._geometry(cfg)
        self.topk = topk_buffer(topk, cfg, backend.device)
        self._choices = {}

    @staticmethod
    def _geometry(cfg):
        """(tokens per indexed entry, entries per indexer cache block) of the layer."""
        kind = getattr(cfg, "kind", None)
        if not getattr(kind, "uses_topk", False):
            raise ValueError(f"IndexerStep needs a C4A backend (or DeepSeek-V4.1's C1A / C2A: "
                             f"the layer kinds that select by top-k), got kind {kind}")
        return kind.ratio, cfg.compressed_block_size

    def allocate_cache(self, num_blocks: int, fp8: bool = True, fill: Optional[int] = None):
        """An indexer cache of ``num_blocks`` blocks of the indexed cache's block size."""
        return fmt.alloc_cache(num_blocks, self.block_size, fp8=fp8, device=self.backend.device,
                               fill=fill)

    # -- the step ---------------------------------------------------------------------------
    def forward(self, q: Tensor, kv: Tensor, caches, batch: BatchDescription,
                indexer: IndexerInputs, cos_sin_cache: Optional[Tensor] = None,
                attn_sink: Optional[Tensor] = None, out: Optional[Tensor] = None,
                compressed_kv: Optional[Tensor] = None, planned: bool = False) -> Tensor:
        """Indexer insert, top-k into ``batch.topk_indices`` (of a copy of ``batch``), then the
        backend's ``forward``. ``batch.topk_indices`` must be None (this step computes it)."""
        if batch.topk_indices is not None:
            raise ValueError("batch.topk_indices must be None: IndexerStep computes the top-k "
                             "(use the backend's own forward to pass one)")
        self.backend.validate(q, caches, batch, kv, cos_sin_cache, compressed_kv,
                              attention=False)
        self.backend._check_out(out, attn_sink, q.shape[0])
        slots, table = self.validate(indexer, batch, q.shape[0])
        topk = self.select(indexer, batch, q.shape[0], slots, table)
        return self.backend.forward(q, kv, caches, dataclasses.replace(batch, topk_indices=topk),
                                    cos_sin_cache, attn_sink, out, compressed_kv, planned)

    def select(self, ix: IndexerInputs, batch: BatchDescription, rows: int,
               slots: Tensor, table: Tensor) -> Tensor:
        """Insert this step's keys, then every row's top-k: a view ``[rows, topk]`` of the
        persistent buffer (decode tokens, prefill tokens, then -1 rows for graph padding)."""
        out = self.topk[:rows]
        with dispatch.recording(self.OPS) as ran:
            if ix.k is not None:
                indexer_k_insert(ix.k, ix.k_cache, slots, self.block_size, impl=self.impl)
            out[batch.num_tokens:].fill_(-1)
            self._score(ix, batch, table, out)
        self._choices = ran
        return out

    def _score(self, ix, batch, table, out):
        """Every real token's top-k into ``out`` (decode tokens, then prefill tokens)."""
        nd, ndt = batch.num_decodes, batch.num_decode_tokens
        if ndt:
            self._decode(ix, batch, table[:nd], out[:ndt])
        if batch.num_prefill_tokens:
            self._prefill(ix, batch, table, out[ndt:batch.num_tokens])

    def explain(self):
        """What each op of the last step ran: the indexer's, then the backend's."""
        return {**self._choices, **self.backend.explain()}

    # -- validation -------------------------------------------------------------------------
    def validate(self, ix: IndexerInputs, batch: BatchDescription, rows: int):
        """Raises on a bad indexer input; returns (slot mapping, block table) to use."""
        if not isinstance(ix, IndexerInputs):
            raise TypeError(f"indexer must be IndexerInputs, got {type(ix).__name__}")
        checks.expect_dtype("indexer.q", ix.q, (torch.bfloat16, torch.float8_e4m3fn))
        if ix.q.dim() != 3 or ix.q.shape[0] != rows or ix.q.shape[2] != fmt.DIM:
            raise ValueError(f"indexer.q must have shape [{rows}, num_index_heads, {fmt.DIM}] "
                             f"(one row per row of q), got {list(ix.q.shape)}")
        checks.expect_tensor("indexer.weights", ix.weights, (torch.float32, torch.bfloat16),
                             (rows, ix.q.shape[1]))
        table = getattr(batch, self.TABLE) if ix.block_table is None else ix.block_table
        slots = None
        if ix.k is not None:
            slots = getattr(batch, self.SLOTS) if ix.slot_mapping is None else ix.slot_mapping
            if slots is None:
                raise ValueError(f"the indexer keys need a slot mapping: indexer.slot_mapping "
                                 f"or batch.{self.SLOTS}")
            checks.expect_tensor("indexer.k", ix.k,
                                 (torch.bfloat16, torch.float16, torch.float32), (None, fmt.DIM))
            checks.expect_vector("indexer.slot_mapping", slots, checks.INDEX_DTYPES,
                                 at_most=ix.k.shape[0], note=" (one per row of indexer.k)")
        elif ix.slot_mapping is not None:
            raise ValueError("indexer.slot_mapping must be None without indexer.k")
        if table is None:
            raise ValueError(f"the indexer cache needs a block table: indexer.block_table or "
                             f"batch.{self.TABLE}")
        checks.expect_block_table("indexer.block_table", table, min_rows=batch.num_reqs)
        if ix.k_cache.dtype == torch.bfloat16:
            checks.expect_tensor("indexer.k_cache", ix.k_cache, torch.bfloat16,
                                 (None, self.block_size, fmt.DIM))
        else:
            checks.expect_dtype("indexer.k_cache", ix.k_cache, checks.BYTE_DTYPES)
            checks.paged_cache_block_size("indexer.k_cache", ix.k_cache, fmt.FP8,
                                          self.block_size)
        checks.expect_same_device(**{n: t for n, t in dict(
            q=ix.q, weights=ix.weights, k=ix.k, k_cache=ix.k_cache, slot_mapping=slots,
            block_table=table).items() if t is not None})
        # a backend made for "cuda" takes inputs on "cuda:0" (found on the H200)
        if canonical_device(ix.q.device) != canonical_device(self.backend.device):
            raise ValueError(f"the indexer inputs must be on the backend's device "
                             f"{self.backend.device}, got {ix.q.device}")
        if slots is not None and checks.value_checks_enabled(slots):
            checks.expect_slots_in_range("indexer.slot_mapping", slots,
                                         ix.k_cache.shape[0] * self.block_size)
        if checks.value_checks_enabled(table):
            check_prefill_blocks(batch, table, ix.k_cache.shape[0], self.block_size,
                                 self.ratio)
        return slots, table

    # -- decode: the paged op over a uniform [requests + 1, next_n] grid --------------------
    def _decode(self, ix, batch, table, out):
        """Decode requests may have fewer than ``max_decode_query_len`` tokens (MTP with
        varying drafts) and graph-padding tokens may follow them; neither is known without a
        sync. So every token is scattered into a grid of ``next_n`` rows per request, where
        the op puts row i at ``seq_len - next_n + i``, plus one group with no candidates
        (seq_len 0) that takes the padding tokens."""
        g = decode_grid(ix.q, ix.weights, batch, table)
        grid = out.new_empty((g.q.shape[0], out.shape[1]))
        indexer_topk_decode(g.q, g.weights, ix.k_cache, g.seq_lens, g.block_table, grid,
                            ratio=self.ratio, next_n=g.next_n,
                            block_size=self.block_size, impl=self.impl)
        out.copy_(grid[g.dst])

    # -- prefill: the requests' entries gathered densely, then the chunked op ---------------
    def _prefill(self, ix, batch, table, out):
        a = prefill_args(ix.q, ix.weights, ix.k_cache, batch, table, self.ratio,
                         self.block_size)
        indexer_topk_prefill(*a[:7], out, ratio=self.ratio,
                             max_seqlen_k=a.max_seqlen_k, impl=self.impl)


# -- shared with the other indexer steps (V4.1, V3.2, GLM-5.3) ------------------------------
def topk_buffer(topk: Optional[Tensor], cfg, device) -> Tensor:
    """The persistent ``[max_num_tokens, cfg.topk]`` int32 top-k buffer a step writes (a new
    one, -1 filled, when ``topk`` is None): persistent like the planner's buffers, so a
    graph-captured step reads the same memory."""
    if topk is None:
        topk = torch.full((cfg.max_num_tokens, cfg.topk), -1, dtype=torch.int32, device=device)
    checks.expect_tensor("topk", topk, torch.int32, (None, cfg.topk))
    if topk.shape[0] < cfg.max_num_tokens or \
            canonical_device(topk.device) != canonical_device(device):
        raise ValueError(f"topk must hold max_num_tokens = {cfg.max_num_tokens} rows on "
                         f"{device}, got {list(topk.shape)} on {topk.device}")
    return topk


def check_prefill_blocks(batch: BatchDescription, table: Tensor, num_blocks: int,
                         block_size: int, ratio: int, unit: str = "entries") -> None:
    """The indexer-cache blocks a prefill request's ``seq_len // ratio`` entries are gathered
    from exist (decode rows need no check: the paged ops skip entries on missing blocks)."""
    nd, npf = batch.num_decodes, batch.num_prefills
    if not npf:
        return
    entries = batch.seq_lens[nd:nd + npf].long().cpu() // ratio
    need = (entries + block_size - 1) // block_size
    rows = table[nd:nd + npf].long().cpu()
    for i in range(npf):
        n = int(need[i])
        if n > rows.shape[1]:
            raise ValueError(f"indexer.block_table row {nd + i} has {rows.shape[1]} blocks; "
                             f"the request's {int(entries[i])} {unit} need {n}")
        bad = ((rows[i, :n] < 0) | (rows[i, :n] >= num_blocks)).nonzero()
        if bad.numel():
            j = int(bad[0])
            raise ValueError(f"indexer.block_table[{nd + i}, {j}] = {int(rows[i, j])} is not a "
                             f"block of indexer.k_cache (0..{num_blocks - 1})")


def decode_rows(query_start_loc: Tensor, nd: int, ndt: int, next_n: int) -> Tensor:
    """Grid row of each decode token in the paged ops' uniform ``[nd + 1, next_n]`` grid:
    request b's j-th of n tokens goes to ``b * next_n + next_n - n + j`` (the op puts row i
    at ``seq_len - next_n + i``); a padding token (past the decode requests' tokens) to the
    first row of the extra group ``nd``, whose seq_len 0 selects nothing. No host sync."""
    qsl = query_start_loc[:nd + 1].long()
    t = torch.arange(ndt, device=qsl.device)
    b = torch.searchsorted(qsl, t, right=True) - 1
    real = b < nd
    b = b.clamp(max=nd - 1)
    n = qsl[b + 1] - qsl[b]
    row = b * next_n + next_n - n + (t - qsl[b])
    return torch.where(real, row, nd * next_n)


def decode_grid(q: Tensor, weights: Tensor, batch: BatchDescription, table: Tensor) -> DecodeGrid:
    """The decode tokens' q / weights scattered into the paged ops' ``[nd + 1, next_n]`` grid
    (:func:`decode_rows`), with the grid's seq_lens and block table."""
    nd, ndt, next_n = batch.num_decodes, batch.num_decode_tokens, batch.max_decode_query_len
    dst = decode_rows(batch.query_start_loc, nd, ndt, next_n)
    g = DecodeGrid(dst, q, weights, torch.cat([batch.seq_lens[:nd], batch.seq_lens.new_zeros(1)]),
                   torch.cat([table[:nd], table.new_full((1, table.shape[1]), -1)]), next_n)
    gq = q.new_zeros(((nd + 1) * next_n,) + tuple(q.shape[1:]))
    gq[dst] = q[:ndt]
    g = g._replace(q=gq)
    return g._replace(weights=g.scatter(weights, 0))


def prefill_args(q: Tensor, weights: Tensor, k_cache: Tensor, batch: BatchDescription,
                 table: Tensor, ratio: int, block_size: int, scales=None) -> PrefillArgs:
    """The prefill tokens and their requests' ``seq_len // ratio`` entries gathered densely
    (:func:`gather_entries`) as the dense prefill ops take them."""
    nd, npf = batch.num_decodes, batch.num_prefills
    qsl, seq = batch.query_start_loc_cpu, batch.seq_lens_cpu
    if qsl is None or seq is None:        # the planner copies these too (prefill only)
        qsl, seq = batch.query_start_loc.cpu(), batch.seq_lens.cpu()
    qsl = qsl[nd:nd + npf + 1].long()
    entries = (seq[nd:nd + npf].long() // ratio).tolist()
    dev = q.device
    cu_k = torch.zeros(npf + 1, dtype=torch.int32)
    cu_k[1:] = torch.tensor(entries, dtype=torch.int64).cumsum(0)
    k, k_scale = gather_entries(k_cache, table[nd:nd + npf], entries, block_size,
                                scales or _fp32_scales)
    lo, hi = int(qsl[0]), int(qsl[-1])
    return PrefillArgs(q[lo:hi], weights[lo:hi], k, k_scale,
                       (qsl - qsl[0]).to(torch.int32).to(dev), cu_k.to(dev),
                       batch.positions[lo:hi], max(entries, default=0))


def _fp32_scales(raw: Tensor) -> Tensor:
    return raw.contiguous().view(torch.float32).reshape(-1)


def gather_entries(k_cache: Tensor, table: Tensor, entries, block_size: int,
                   scales=_fp32_scales):
    """Entries ``0..entries[r]-1`` of each request, densely: (bf16 rows, None) or (e4m3 bytes
    [n, 128], fp32 scales [n]), as the cache holds them; ``scales`` decodes an fp8 entry's
    four scale bytes ``[n, 4]`` (default: one fp32)."""
    dev, bs = k_cache.device, block_size
    req = torch.repeat_interleave(torch.arange(len(entries)),
                                  torch.tensor(entries, dtype=torch.int64)).to(dev)
    j = torch.cat([torch.arange(n) for n in entries]).to(dev) if entries else \
        torch.zeros(0, dtype=torch.int64, device=dev)
    blk = table[req, j // bs].long()
    off = j % bs
    if k_cache.dtype == torch.bfloat16:
        return k_cache[blk, off], None
    page = checks.block_bytes_view(k_cache, fmt.FP8, bs)
    d = torch.arange(fmt.DIM, device=dev)
    values = page[blk.unsqueeze(1), (off * fmt.DIM).unsqueeze(1) + d]
    tail = (bs * fmt.DIM + off * 4).unsqueeze(1) + torch.arange(4, device=dev)
    return values, scales(page[blk.unsqueeze(1), tail])
