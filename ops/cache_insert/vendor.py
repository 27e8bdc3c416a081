"""The cache-insert family's vendor implementation: there is none to call.

vLLM's own insert kernels (``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` and the
full-cache variants, docs/semantics.md §3) live in vLLM's compiled ``_C`` extension, which is
not a wheel this project can depend on, and no vendor wheel (FlashMLA, FlashInfer) ships
them. Every op of the family registers this route, so ``explain`` and the main job say why.
"""
from sparse_mla.ops.common.dispatch import no_vendor_route

REASON = "no vendor wheel ships this op (vLLM's are in its own _C)"
ROUTE = no_vendor_route(REASON)
