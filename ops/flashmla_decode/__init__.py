"""FlashMLA-semantics sparse decode / prefill (docs/semantics.md §5): the ops, and the same
split into a plan made once per kind of call and a run per call (planned.py)."""
from sparse_mla.ops.flashmla_decode.ops import (  # noqa: F401
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    flashmla_sparse_decode,
    flashmla_sparse_prefill,
)
from sparse_mla.ops.flashmla_decode.planned import (  # noqa: F401
    DecodePlan,
    PrefillPlan,
    decode_with_plans,
    plan_decode,
    plan_prefill,
    run_decode,
    run_prefill,
)
