"""The index-combine family's vendor implementation: there is none to call.

vLLM's index builders (docs/semantics.md §4) are Triton kernels inside vLLM itself; no
vendor package ships them. Every op of the family registers this route, so ``explain`` and the main
job say why.
"""
from sparse_mla.ops.common.dispatch import no_vendor_route

REASON = "no vendor package ships this index-metadata kernel"
ROUTE = no_vendor_route(REASON)
