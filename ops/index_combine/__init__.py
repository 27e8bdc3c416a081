"""Index-combine op family (docs/semantics.md §4): local→global slots, SWA window indices, C128A
indices, FlashMLA prefill combine, TRTLLM-gen mixed decode + prefill indices."""
from sparse_mla.ops.index_combine.ops import (  # noqa: F401
    build_flashinfer_mixed_sparse_indices,
    c128a_indices_and_lens,
    c128a_width,
    combine_topk_swa_indices,
    combined_width,
    compute_global_topk_indices_and_lens,
    convert_req_index_to_global,
    flashinfer_mixed_sparse_indices,
    global_topk_indices_and_lens,
    mixed_width,
    swa_indices_and_lens,
    triton_convert_req_index_to_global_index,
)
