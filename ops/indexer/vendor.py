"""The indexer family's vendor implementation: none is wired yet.

DeepGEMM's ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits`` compute the same logits (fp8 q, fp8
keys with one fp32 scale per row, weights folded with q's scale; docs/semantics.md §11.5) on
sm_90 / sm_100 only, and leave the top-k to the caller. Routing through them needs a machine
with DeepGEMM to test on; until then every op of the family says so here.
"""
from sparse_mla.ops.common.dispatch import no_vendor_route

REASON = "no vendor route wired (DeepGEMM's fp8 MQA-logits kernels: not tested here)"
ROUTE = no_vendor_route(REASON)
