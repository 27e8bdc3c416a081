"""The V4.1 indexer family's vendor implementation: there is none to wire.

vLLM runs level 1 and 2 as DeepGEMM's dense ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits``
(ops/indexer/vendor.py: not wired either) followed by its own Triton block-score / mask
kernels (``candidate_blocks.py``); the candidate-only scorer (``indexer_sparse_logits``) is an
SM100 MXFP4-cache opt-in, not the 132-byte fp8 cache these ops read. No vendor package ships
these two levels over this cache.
"""
from sparse_mla.ops.common.dispatch import no_vendor_route

REASON = ("no vendor kernel: vLLM's two-level selection is DeepGEMM's dense logits plus its own "
          "Triton masks (docs/semantics.md §11.6)")
ROUTE = no_vendor_route(REASON)
