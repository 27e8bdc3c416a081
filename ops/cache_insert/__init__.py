"""Cache-insert op family (docs/semantics.md §2, §3): quantize + RoPE + insert,
gather + dequantize."""
from sparse_mla.ops.cache_insert.ops import (  # noqa: F401
    compressed_insert_v41,
    fused_rope_insert_v41,
    fused_qnorm_rope_insert_plain,
    fused_qnorm_rope_insert_v4,
    gather_dequant,
    insert_plain,
    qnorm_rope_kv_insert_v4,
    quantize_insert_v32,
    quantize_insert_v32_nope,
    quantize_insert_v4,
    rope_kv_insert_v41,
)
