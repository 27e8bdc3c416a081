"""The classes behind vLLM's ``AttentionBackendEnum.SPARSE_MLA`` / ``SPARSE_MLA_TRTLLM``.

DeepSeek-V4's layers never look their backend up through this enum (the model module picks
the layer class, which the plugin patches), so these only give the names a valid class:
vLLM's DeepSeek-V4 sparse-MLA backend (metadata builder included) under our name.
"""
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend


class SparseMLABackend(DeepseekV4SparseMLABackend):
    @staticmethod
    def get_name() -> str:
        return "SPARSE_MLA"


class SparseMLATrtllmBackend(DeepseekV4SparseMLABackend):
    @staticmethod
    def get_name() -> str:
        return "SPARSE_MLA_TRTLLM"
