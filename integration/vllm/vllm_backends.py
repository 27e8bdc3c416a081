"""The classes behind vLLM's ``AttentionBackendEnum.SPARSE_MLA`` / ``SPARSE_MLA_TRTLLM``.

DeepSeek-V4's layers never look their backend up through this enum (the model module picks
the layer class, which the plugin patches), so these only give the names a valid class:
vLLM's DeepSeek-V4 sparse-MLA backend (metadata builder included) under our name. A
DeepSeek-V3.2 model does look its backend up here; vLLM's validation refuses these (head size
576 is not V4's 512) and the reason names the V3.2 backend (``v32.py``); a GLM-5.3 model
(head size 512 too, told apart by its ``index_kpool``) is refused naming ``glm5.py``'s.
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
        if _is_glm5():
            # GLM-5.3's MLA head is 512 wide too: V4's validation alone would take it
            return (f"{cls.get_name()} is for DeepSeek-V4; for GLM-5.3 use "
                    f"--attention-backend {names.GLM5}")
        return super().supports_combination(head_size, *args, **kwargs)


def _is_glm5() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    model = getattr(get_current_vllm_config_or_none(), "model_config", None)
    return model is not None and getattr(model.hf_text_config, "index_kpool", None) is not None


class SparseMLABackend(_V4Backend):
    @staticmethod
    def get_name() -> str:
        return "SPARSE_MLA"


class SparseMLATrtllmBackend(_V4Backend):
    @staticmethod
    def get_name() -> str:
        return "SPARSE_MLA_TRTLLM"
