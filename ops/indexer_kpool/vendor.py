"""The kpool indexer family's vendor implementation: none is wired (vLLM's kernels are Triton
and DeepGEMM's MQA logits, which leave pooling, selection and expansion to the caller)."""
from sparse_mla.ops.common.dispatch import no_vendor_route

REASON = "no vendor route wired (vLLM's kpool kernels are Triton; DeepGEMM: not tested here)"
ROUTE = no_vendor_route(REASON)
