"""FlashMLA-semantics sparse decode / prefill (docs/semantics.md §5)."""
from sparse_mla.ops.flashmla_decode.ops import (  # noqa: F401
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    flashmla_sparse_decode,
    flashmla_sparse_prefill,
)
