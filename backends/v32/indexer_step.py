"""A DeepSeek-V3.2 / GLM-5.2 layer step that runs its own Lightning indexer.

V4's :class:`~sparse_mla.backends.v4.indexer_step.IndexerStep` with V3.2's geometry: the
indexer scores every token (ratio 1: token ``p`` may select positions ``0..p``), and its key
cache shares the attention cache's addressing (vLLM's V3.2 indexer cache has the MLA cache's
block size and slot mapping: the batch's ``block_table`` / ``slot_mapping``).

GLM-5.2's "shared" layers (:mod:`~sparse_mla.backends.v32.cadence`) have no indexer: they
call their backend's ``forward`` with the top-k the latest "full" layer wrote, a view of the
persistent buffer the full layers' steps share (``topk=``), as vLLM keeps one
``topk_indices_buffer`` per model.
"""
from __future__ import annotations

from sparse_mla.backends.v32.base import V32Backend
from sparse_mla.backends.v4.indexer_step import IndexerInputs, IndexerStep

__all__ = ["IndexerInputs", "V32IndexerStep"]


class V32IndexerStep(IndexerStep):
    """A V3.2 backend (either layout) plus the Lightning indexer over its tokens."""

    TABLE, SLOTS = "swa_block_table", "swa_slot_mapping"

    @staticmethod
    def _geometry(cfg):
        return 1, cfg.block_size

    def __init__(self, backend: V32Backend, impl=None, topk=None):
        if not isinstance(backend, V32Backend):
            raise TypeError(f"backend must be a V3.2 backend, got {type(backend).__name__}")
        super().__init__(backend, impl, topk)
