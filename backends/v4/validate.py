"""DeepSeek-V4's checks of one step's inputs (layer kind, window, compressed cache, top-k of
compressed entries) over the checks every model shares (``backends/common/validate.py``).

Shape, dtype and capacity checks always run (no device reads); the ones that read values run
where ``checks.value_checks_enabled`` says (CPU tensors, or ``SPARSE_MLA_CHECK_VALUES=1``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.common.validate import (check_request_values, check_slots,
                                                 check_topk, table_covers,
                                                 validate_requests)
from sparse_mla.backends.v4.config import LayerConfig
from sparse_mla.ops.common import checks, formats

I32 = torch.int32


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


def validate_values(cfg: LayerConfig, batch: BatchDescription, q: Tensor,
                    cos_sin_cache: Optional[Tensor], swa_blocks: int,
                    compressed_blocks: Optional[int], attention: bool = True) -> None:
    """The checks that read values; only where ``checks.value_checks_enabled``."""
    if not checks.value_checks_enabled(q, batch.seq_lens):
        return
    qsl, seq, ql, tok, want = check_request_values(batch, cos_sin_cache)
    R = batch.num_reqs
    check_slots("batch.swa_slot_mapping", batch.swa_slot_mapping, swa_blocks * cfg.swa_block_size)
    first = torch.clamp(seq - ql - (cfg.window - 1), min=0)
    table_covers("batch.swa_block_table", batch.swa_block_table[:R], swa_blocks, first, seq - 1,
                 cfg.swa_block_size, "position")
    if not cfg.kind.compressed:
        return
    n_entries = seq // cfg.kind.ratio
    table_covers("batch.compressed_block_table", batch.compressed_block_table[:R],
                 compressed_blocks, torch.zeros_like(seq), n_entries - 1,
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
