"""Checks of one step's inputs that every model's backends share (the request layout, the
indexer's top-k, slots and block tables), run before any cache byte is written; each model adds
its own (``backends/v4/validate.py``, ``backends/v32/base.py``).

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
from sparse_mla.ops.common import checks

I32 = torch.int32


def _count(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"batch.{name} must be a non-negative Python int, got {v!r}")
    return v


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
