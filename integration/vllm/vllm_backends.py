"""The classes behind vLLM's ``AttentionBackendEnum.SPARSE_MLA`` / ``SPARSE_MLA_TRTLLM``.

DeepSeek-V4's layers never look their backend up through this enum (the model module picks
the layer class, which the plugin patches), so these only give the names a valid class:
vLLM's DeepSeek-V4 sparse-MLA backend (metadata builder included) under our name. A
DeepSeek-V3.2 model does look its backend up here; vLLM's validation refuses these (head size
576 is not V4's 512) and the reason names the V3.2 backend (``v32.py``).
"""
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend

from sparse_mla.integration.vllm import names

V32_HEAD_SIZE = 576


class _V4Backend(DeepseekV4SparseMLABackend):
    @classmethod
    def supports_combination(cls, head_size, *args, **kwargs):
        if head_size == V32_HEAD_SIZE:
            return (f"{cls.get_name()} is for DeepSeek-V4; for DeepSeek-V3.2 use "
                    f"--attention-backend {names.V32}")
        return super().supports_combination(head_size, *args, **kwargs)


class SparseMLABackend(_V4Backend):
    @staticmethod
    def get_name() -> str:
        return "SPARSE_MLA"


class SparseMLATrtllmBackend(_V4Backend):
    @staticmethod
    def get_name() -> str:
        return "SPARSE_MLA_TRTLLM"
