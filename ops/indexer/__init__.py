"""Lightning-indexer op family (docs/semantics.md §11): indexer-K insert, scores + top-k for
prefill (chunked, ragged) and decode (paged, MTP)."""
from sparse_mla.ops.indexer.format import alloc_cache  # noqa: F401
from sparse_mla.ops.indexer.ops import (  # noqa: F401
    indexer_k_insert,
    indexer_topk_decode,
    indexer_topk_prefill,
    lightning_indexer_decode,
    lightning_indexer_prefill,
)
