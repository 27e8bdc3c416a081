"""GLM-5.3-Flash pooled-key (kpool) Lightning-indexer op family (docs/semantics.md §13):
pool + Hadamard + e4m3 insert with the tail ring, scores + top pools expanded to tokens for
prefill (ragged) and decode (paged, MTP)."""
from sparse_mla.ops.indexer_kpool.format import alloc_cache, alloc_tail_cache, ring_size  # noqa: F401
from sparse_mla.ops.indexer_kpool.ops import (  # noqa: F401
    kpool_indexer_decode,
    kpool_indexer_prefill,
    kpool_k_insert,
    kpool_topk_decode,
    kpool_topk_prefill,
)
