"""DeepSeek-V4 attention for vLLM 0.32.0 / 0.33.0 on CUDA on a sparse_mla backend.

``SPARSE_MLA``: vLLM's FlashMLA layer class (584 B ``fp8_ds_mla`` caches, vLLM's FlashMLA
metadata builders) with its cache insert and attention replaced by
``backends/v4/flashmla.py``. ``SPARSE_MLA_TRTLLM``: vLLM's FlashInfer TRTLLM-gen layer class
(plain bf16 / per-tensor fp8 caches) with ``backends/v4/trtllm.py``. Both take the local head
count as it is: unlike the vendor kernels, the backends need no padding of q to 64/128 heads.

Not run end to end here (vLLM's CUDA stack cannot be installed on the GPU machine; the
classes and signatures it relies on are checked per release by test_vllm_contract.py);
the metadata mapping it shares with the CPU route is unit-tested (tests/integration/vllm).
"""
from __future__ import annotations

from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import DeepseekV4FlashInferMLAAttention
from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

from sparse_mla.integration.vllm import names
from sparse_mla.integration.vllm.layer import make_layer_class


def _unpadded_heads(cls, num_heads: int) -> int:
    return num_heads


def _make(base):
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self._sparse_mla_init()

    def _sparse_cache_dtype(self):
        # The TRTLLM backend's caches and q buffer take the SWA cache's element type.
        if self.sparse_mla_name.fp8_ds_mla_layout:
            return None
        return self.kv_cache_torch_dtype      # set by DeepseekV4Attention.__init__

    return dict(__init__=__init__, _sparse_cache_dtype=_sparse_cache_dtype,
                get_padded_num_q_heads=classmethod(_unpadded_heads))


_BASES = {"SPARSE_MLA": DeepseekV4FlashMLAAttention,
          "SPARSE_MLA_TRTLLM": DeepseekV4FlashInferMLAAttention}


def layer_class(which: names.BackendName) -> type:
    base = _BASES[which.name]
    return make_layer_class(base, which, **_make(base))
