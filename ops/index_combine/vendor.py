"""The index-combine family's vendor implementation: there is none to call.

vLLM's index builders (docs/semantics.md §4) are Triton kernels inside vLLM itself; no
vendor package ships them. The dispatcher registers this reason, so ``explain`` and the main
job say why.
"""
from sparse_mla.ops.common.dispatch import no_vendor

REASON = "no vendor package ships this index-metadata kernel"
CHECK = no_vendor(REASON)
