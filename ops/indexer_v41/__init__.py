"""DeepSeek-V4.1's two-level Lightning indexer (docs/semantics.md §11.6): candidate blocks from
the candidate source layer, then each candidate user's top-k inside them; prefill and decode."""
from sparse_mla.ops.indexer_v41.ops import (  # noqa: F401
    indexer_v41_candidates_decode,
    indexer_v41_candidates_prefill,
    indexer_v41_topk_in_candidates_decode,
    indexer_v41_topk_in_candidates_prefill,
    lightning_indexer_v41_candidates_decode,
    lightning_indexer_v41_candidates_prefill,
    lightning_indexer_v41_decode,
    lightning_indexer_v41_prefill,
)
