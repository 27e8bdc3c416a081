"""TRTLLM-gen-semantics sparse decode (docs/semantics.md §6): DeepSeek-V4 over plain bf16 /
per-tensor-fp8 SWA + compressed pools, and the V3.2 sparse MLA decode over a plain 576-wide
cache."""
from sparse_mla.ops.trtllm_decode.ops import (  # noqa: F401
    trtllm_batch_decode_sparse_mla_dsv4,
    trtllm_batch_decode_with_kv_cache_mla,
    trtllm_decode_dsv4,
    trtllm_decode_v32,
)
from sparse_mla.ops.trtllm_decode.vendor import (  # noqa: F401
    dsv4_vendor_arguments,
    v32_vendor_arguments,
)
