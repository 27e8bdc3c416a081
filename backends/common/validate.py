"""Checks of one step's inputs, run before any cache byte is written.

Shape, dtype and capacity checks always run (no device reads). Checks that read tensor values
(positions against the RoPE table, block tables against positions, top-k ids against the
entries that exist, ``seq_len >= query_len``) run where ``checks.value_checks_enabled`` says
(CPU tensors, or ``SPARSE_MLA_CHECK_VALUES=1``): on CUDA they would stall the stream. Without
them the ops still never write outside the slots they are given (see each op's docstring).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.common.config import LayerConfig
from sparse_mla.ops.common import checks, formats

I32 = torch.int32


def _count(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"batch.{name} must be a non-negative Python int, got {v!r}")
    return v


def validate_shapes(cfg: LayerConfig, batch: BatchDescription, q: Tensor,
                    kv: Optional[Tensor] = None, compressed_kv: Optional[Tensor] = None,
                    attention: bool = True) -> None:
    """Everything that needs no device read. ``attention=False``: only what a cache write
    reads (an engine may fill the indexer's top-k after the write, as vLLM does)."""
    if q.dim() != 3 or q.shape[1] != cfg.num_heads or q.shape[2] != formats.HEAD_DIM:
        raise ValueError(f"q must have shape [num_tokens, {cfg.num_heads}, 512] (the layer's "
                         f"local heads), got {list(q.shape)}")
    T = q.shape[0]
    Rd, Td, Rp, Tp, R = validate_requests(cfg, batch, T)
    if kv is not None:
        checks.expect_shape("kv", kv, (T, formats.HEAD_DIM))
    _validate_v4_fields(cfg, batch, q, kv, compressed_kv, R, Td, Tp, attention)


def validate_requests(cfg, batch: BatchDescription, T: int):
    """The request layout every backend shares (counts, query_start_loc, seq_lens, positions,
    the token cache's block table and slot mapping) against ``T`` rows of q and ``cfg``'s
    capacities (``max_num_tokens``, ``max_num_reqs``). Returns ``(Rd, Td, Rp, Tp, R)``."""
    if T > cfg.max_num_tokens:
        raise ValueError(f"q has {T} tokens, more than the planner's capacity max_num_tokens="
                         f"{cfg.max_num_tokens}")
    Rd, Td = _count("num_decodes", batch.num_decodes), _count("num_decode_tokens",
                                                              batch.num_decode_tokens)
    Rp, Tp = _count("num_prefills", batch.num_prefills), _count("num_prefill_tokens",
                                                               batch.num_prefill_tokens)
    _count("max_decode_query_len", batch.max_decode_query_len)
    _count("max_prefill_query_len", batch.max_prefill_query_len)
    if Td + Tp > T:
        raise ValueError(f"num_decode_tokens + num_prefill_tokens = {Td + Tp} exceeds q's "
                         f"{T} tokens")
    if (Rd == 0) != (Td == 0) or (Rp == 0) != (Tp == 0):
        raise ValueError(f"requests and tokens disagree: {Rd} decodes with {Td} tokens, "
                         f"{Rp} prefills with {Tp} tokens")
    if Td and batch.max_decode_query_len < 1:
        raise ValueError("max_decode_query_len must be >= 1 when there are decode tokens")
    if Tp and batch.max_prefill_query_len < 1:
        raise ValueError("max_prefill_query_len must be >= 1 when there are prefill tokens")
    R = Rd + Rp
    if R > cfg.max_num_reqs:
        raise ValueError(f"{R} requests exceed the planner's capacity max_num_reqs="
                         f"{cfg.max_num_reqs}")
    checks.expect_dtype("batch.query_start_loc", batch.query_start_loc, I32)
    checks.expect_shape("batch.query_start_loc", batch.query_start_loc, (R + 1,))
    checks.expect_dtype("batch.seq_lens", batch.seq_lens, I32)
    checks.expect_shape("batch.seq_lens", batch.seq_lens, (R,))
    checks.expect_dtype("batch.positions", batch.positions, checks.INDEX_DTYPES)
    checks.expect_shape("batch.positions", batch.positions, (T,))
    checks.expect_dtype("batch.swa_block_table", batch.swa_block_table, I32)
    checks.expect_shape("batch.swa_block_table", batch.swa_block_table, (R, None))
    checks.expect_last_dim_contiguous("batch.swa_block_table", batch.swa_block_table)
    checks.expect_dtype("batch.swa_slot_mapping", batch.swa_slot_mapping, checks.INDEX_DTYPES)
    checks.expect_shape("batch.swa_slot_mapping", batch.swa_slot_mapping, (T,))
    return Rd, Td, Rp, Tp, R


def _validate_v4_fields(cfg, batch, q, kv, compressed_kv, R, Td, Tp, attention):
    kind = cfg.kind
    if kind.compressed:
        if batch.compressed_block_table is None:
            raise ValueError(f"batch.compressed_block_table is required for a {kind.name} layer")
        checks.expect_dtype("batch.compressed_block_table", batch.compressed_block_table, I32)
        checks.expect_shape("batch.compressed_block_table", batch.compressed_block_table,
                            (R, None))
        checks.expect_last_dim_contiguous("batch.compressed_block_table",
                                          batch.compressed_block_table)
    writing = kv is not None
    if writing and (compressed_kv is None) != (batch.compressed_slot_mapping is None):
        raise ValueError("compressed_kv and batch.compressed_slot_mapping come together")
    if compressed_kv is not None:
        if not kind.compressed:
            raise ValueError("compressed_kv given for an SWA-only layer (it has no "
                             "compressed cache)")
        if compressed_kv.dim() != 2 or compressed_kv.shape[1] != formats.HEAD_DIM:
            raise ValueError(f"compressed_kv must have shape [rows, 512], got "
                             f"{list(compressed_kv.shape)}")
        checks.expect_dtype("batch.compressed_slot_mapping", batch.compressed_slot_mapping,
                            checks.INDEX_DTYPES)
        checks.expect_shape("batch.compressed_slot_mapping", batch.compressed_slot_mapping,
                            (compressed_kv.shape[0],))
    if kind.uses_topk and attention:
        check_topk(batch, cfg.topk, Td + Tp, f"a {kind.name} layer")
    checks.expect_same_device(
        q=q, kv=kv, compressed_kv=compressed_kv, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, positions=batch.positions, swa_block_table=batch.swa_block_table,
        swa_slot_mapping=batch.swa_slot_mapping,
        compressed_block_table=batch.compressed_block_table,
        compressed_slot_mapping=batch.compressed_slot_mapping, topk_indices=batch.topk_indices)


def check_topk(batch: BatchDescription, topk: int, rows: int, layer: str) -> Tensor:
    """The indexer's top-k rows are there, int32 ``[>= rows, topk]`` with a unit last stride."""
    tk = batch.topk_indices
    if tk is None:
        raise ValueError(f"batch.topk_indices (the indexer's request-local top-k) is "
                         f"required for {layer}")
    checks.expect_dtype("batch.topk_indices", tk, I32)
    if tk.dim() != 2 or tk.shape[1] != topk or tk.shape[0] < rows:
        raise ValueError(f"batch.topk_indices must have shape [>= {rows}, {topk}] "
                         f"(the layer's topk), got {list(tk.shape)}")
    checks.expect_last_dim_contiguous("batch.topk_indices", tk)
    return tk


def _table_covers(name, table, num_blocks, req, first, last, block_size, what):
    """Blocks of positions ``first..last`` (per request, inclusive; empty when last < first)
    exist in ``table`` and name blocks of the cache."""
    for r, a, b in zip(req.tolist(), first.tolist(), last.tolist()):
        if b < a:
            continue
        lo, hi = a // block_size, b // block_size
        if hi >= table.shape[1]:
            raise ValueError(f"{name} row {r} has {table.shape[1]} blocks; {what} {b} needs "
                             f"block {hi} (block size {block_size})")
        ids = table[r, lo:hi + 1]
        bad = ((ids < 0) | (ids >= num_blocks)).nonzero()
        if bad.numel():
            j = lo + int(bad[0])
            raise ValueError(f"{name}[{r}, {j}] = {int(table[r, j])} is not a block of the "
                             f"cache (it has {num_blocks}); {what}s up to {b} need it")


def validate_values(cfg: LayerConfig, batch: BatchDescription, q: Tensor,
                    cos_sin_cache: Optional[Tensor], swa_blocks: int,
                    compressed_blocks: Optional[int], attention: bool = True) -> None:
    """The checks that read values; only where ``checks.value_checks_enabled``."""
    if not checks.value_checks_enabled(q, batch.seq_lens):
        return
    qsl, seq, ql, tok, want = check_request_values(batch, cos_sin_cache)
    R = batch.num_reqs
    check_slots("batch.swa_slot_mapping", batch.swa_slot_mapping, swa_blocks * cfg.swa_block_size)
    rr = torch.arange(R)
    first = torch.clamp(seq - ql - (cfg.window - 1), min=0)
    _table_covers("batch.swa_block_table", batch.swa_block_table.cpu(), swa_blocks, rr, first,
                  seq - 1, cfg.swa_block_size, "position")
    if not cfg.kind.compressed:
        return
    n_entries = seq // cfg.kind.ratio
    _table_covers("batch.compressed_block_table", batch.compressed_block_table.cpu(),
                  compressed_blocks, rr, torch.zeros_like(seq), n_entries - 1,
                  cfg.compressed_block_size, "compressed entry")
    if batch.compressed_slot_mapping is not None:
        check_slots("batch.compressed_slot_mapping", batch.compressed_slot_mapping,
                    compressed_blocks * cfg.compressed_block_size)
    if cfg.kind.uses_topk and attention and tok.numel():
        tk = batch.topk_indices.long().cpu()[tok]
        avail = ((want + 1) // cfg.kind.ratio).unsqueeze(1)
        bad = ((tk < -1) | (tk >= avail)).nonzero()
        if bad.numel():
            i, j = int(bad[0, 0]), int(bad[0, 1])
            raise ValueError(f"batch.topk_indices[{int(tok[i])}, {j}] = {int(tk[i, j])}: a "
                             f"token at position {int(want[i])} has compressed entries "
                             f"0..{int(avail[i]) - 1} (-1 pads)")


def check_slots(name: str, slots: Tensor, cap: int) -> None:
    """Every slot -1 (no write) or in [0, cap) (host read: value checks only)."""
    s = slots.long().cpu()
    if s.numel() and (int(s.min()) < -1 or int(s.max()) >= cap):
        raise ValueError(f"{name} must be -1 or a slot in [0, {cap}), got "
                         f"[{int(s.min())}, {int(s.max())}]")


def table_covers(name, table, num_blocks, first, last, block_size, what):
    """Per request r, the blocks of positions ``first[r]..last[r]`` exist in ``table`` and name
    blocks of a cache of ``num_blocks`` (host read: value checks only)."""
    _table_covers(name, table.cpu(), num_blocks, torch.arange(table.shape[0]), first, last,
                  block_size, what)


def check_request_values(batch: BatchDescription, cos_sin_cache: Optional[Tensor] = None):
    """The value checks every backend shares (query_start_loc, seq_len >= query_len, the
    query-length maxima, each token's position, positions within the RoPE table when given).
    Returns host tensors ``(qsl, seq, ql, tok, want)``: rows of the real tokens and their
    positions."""
    Rd, Td, Tp = batch.num_decodes, batch.num_decode_tokens, batch.num_prefill_tokens
    R = batch.num_reqs
    qsl = batch.query_start_loc.long().cpu()
    seq = batch.seq_lens.long().cpu()
    ql = qsl[1:] - qsl[:-1]
    if R and (int(qsl[0]) != 0 or bool((ql < 0).any())):
        raise ValueError(f"batch.query_start_loc must start at 0 and not decrease, got "
                         f"{qsl.tolist()}")
    if Tp and int(qsl[Rd]) != Td:
        raise ValueError(f"prefill tokens start at row num_decode_tokens={Td}, but "
                         f"query_start_loc[num_decodes] = {int(qsl[Rd])}")
    if int(qsl[Rd]) > Td:
        raise ValueError(f"decode requests hold {int(qsl[Rd])} tokens, more than "
                         f"num_decode_tokens={Td}")
    if int(qsl[R]) - int(qsl[Rd]) != Tp:
        raise ValueError(f"prefill requests hold {int(qsl[R]) - int(qsl[Rd])} tokens, not "
                         f"num_prefill_tokens={Tp}")
    bad = (ql > seq).nonzero()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(f"request {r}: query_len {int(ql[r])} > seq_lens[{r}] = {int(seq[r])}")
    if Rd and int(ql[:Rd].max()) > batch.max_decode_query_len:
        raise ValueError(f"a decode request has {int(ql[:Rd].max())} tokens, more than "
                         f"max_decode_query_len={batch.max_decode_query_len}")
    if R > Rd and int(ql[Rd:].max()) > batch.max_prefill_query_len:
        raise ValueError(f"a prefill request has {int(ql[Rd:].max())} tokens, more than "
                         f"max_prefill_query_len={batch.max_prefill_query_len}")
    # Every real token's position is what its request says.
    req = torch.repeat_interleave(torch.arange(R), ql)
    tok = torch.arange(int(qsl[R]))      # rows: decode tokens, then prefill tokens at Td
    want = seq[req] - ql[req] + (tok - qsl[req])
    pos = batch.positions.long().cpu()
    wrong = (pos[tok] != want).nonzero()
    if wrong.numel():
        i = int(wrong[0])
        raise ValueError(f"batch.positions[{int(tok[i])}] = {int(pos[tok[i]])}, but request "
                         f"{int(req[i])} puts that token at {int(want[i])} "
                         f"(seq_len - query_len + j)")
    if cos_sin_cache is not None and pos.numel() and (
            int(pos.min()) < 0 or int(pos.max()) >= cos_sin_cache.shape[0]):
        raise ValueError(f"batch.positions must be in [0, {cos_sin_cache.shape[0]}) (rows of "
                         f"cos_sin_cache), got [{int(pos.min())}, {int(pos.max())}]")
    return qsl, seq, ql, tok, want
