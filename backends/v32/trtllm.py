"""DeepSeek-V3.2 attention in FlashInfer's layout, composed as vLLM's FlashInfer MLA sparse
backend composes it (docs/semantics.md §4.1, §6): a bf16 cache ``[num_blocks, block_size,
576]``; the indexer's top-k → global slots with per-row valid counts
(``convert_req_index_to_global``), then one ``trtllm_decode_v32`` call for every row, decode
and prefill alike (``sparse_mla_top_k`` semantics: ``seq_lens`` = the row's valid count).
"""
from __future__ import annotations

from typing import Dict

from sparse_mla.backends.common.spec import CacheSpec
from sparse_mla.backends.v32.base import BF16, V32Backend
from sparse_mla.backends.v32.config import D_QK
from sparse_mla.ops import trtllm_decode as td
from sparse_mla.ops.trtllm_decode import vendor as td_vendor


class V32TrtllmBackend(V32Backend):
    name = "v32_trtllm"
    OPS = ("insert_plain", "convert_req_index_to_global", "trtllm_decode_v32")

    def __init__(self, config, device="cpu", impl="auto", attention_impl=None, planner=None):
        super().__init__(config, device, impl, attention_impl, planner)
        # FlashInfer's zeroed split-K workspace (one per device, as vLLM allocates it); always
        # a tensor: see ops.trtllm_decode.ops.workspace_arg
        self.fi_workspace = td_vendor.workspace(self.device)

    def cache_specs(self) -> Dict[str, CacheSpec]:
        return {"kv": CacheSpec.plain("kv", self.config.block_size, BF16, D_QK)}

    def _attend(self, q, caches, batch, attn_sink, out):
        p, n = self.planner, batch.num_tokens
        if not n:
            return
        p.global_slots(batch, 0, n)
        td.trtllm_decode_v32(q[:n], caches["kv"], p.slots[:n], p.counts[:n], out[:n],
                             bmm1_scale=self.config.softmax_scale,
                             workspace_buffer=self.fi_workspace, impl=self.attention_impl)
