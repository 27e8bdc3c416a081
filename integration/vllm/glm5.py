"""GLM-5.3 (vLLM's ``glm5next``) DSA attention on ``backends/glm5`` through vLLM's registry.

vLLM's glm5next MLA layer (``Glm5NextMLAAttention`` -> ``MultiHeadLatentAttentionWrapper`` ->
``MLAAttention``) asks the registry for a sparse MLA backend of head size 512 (kv_lora_rank
512, no RoPE dims), so ``--attention-backend SPARSE_MLA_GLM5`` selects the classes here with
no patch, as ``SPARSE_MLA_V32`` does for DeepSeek-V3.2 (``v32.py``; the builder, planner and
metadata are V3.2's, the top-k width is the kpool indexer's ``round_up(topk + kpool - 1,
128)``):

- :class:`SparseMLAGlm5Backend`: head size 512, MLA, sparse; only the ``fp8_ds_mla`` cache
  (656 B records, zero RoPE bytes): vLLM's bf16 cache for this model is 512 wide, which
  FlashMLA's 576-wide prefill kernel does not read.
- :class:`SparseMLAGlm5Impl`: the cache write is ours (``quantize_insert_v32_nope``: vLLM's
  ``concat_and_cache_mla`` is a CUDA op), ``forward_mqa`` runs every token through a
  ``Glm5FlashMLABackend``.

The indexer that fills the shared top-k buffer is vLLM's, or ours where DeepGEMM cannot run
(``indexer_kpool.py``).
"""
from __future__ import annotations

from typing import Tuple

import torch
from vllm.config import VllmConfig

from sparse_mla.backends.glm5 import Glm5Config, Glm5FlashMLABackend
from sparse_mla.backends.glm5.config import D_Q, topk_width
from sparse_mla.integration.vllm import names, shared, v32
from sparse_mla.ops import cache_insert as ci

NAME = names.GLM5
BLOCK_SIZE = v32.BLOCK_SIZE
CACHE_DTYPE = "fp8_ds_mla"
# vLLM rewrites "fp8" to "fp8_ds_mla" only for its own FLASHMLA_SPARSE, so say what to pass.
_CACHE_HINT = f"{NAME} reads only the fp8_ds_mla cache: pass --kv-cache-dtype fp8_ds_mla"


def layer_config(vllm_config: VllmConfig, num_heads: int,
                 softmax_scale: float = Glm5Config.softmax_scale) -> Glm5Config:
    """A glm5next DSA layer's static shape: V3.2's capacities, the top-k width of vLLM's
    shared buffer (``index_topk`` pooled tokens + the ``index_kpool - 1`` tail, 128-aligned)."""
    model, sched = vllm_config.model_config, vllm_config.scheduler_config
    if model is None:
        raise ValueError("vllm_config.model_config is required (index_topk, index_kpool)")
    text = model.hf_text_config
    topk, kpool = getattr(text, "index_topk", None), getattr(text, "index_kpool", None)
    if topk is None or kpool is None:
        raise ValueError(f"{NAME} is for GLM-5.3 (glm5next) DSA models: the model config has "
                         f"index_topk={topk}, index_kpool={kpool}")
    return Glm5Config(num_heads=int(num_heads), max_num_tokens=int(sched.max_num_batched_tokens),
                      max_num_reqs=int(sched.max_num_seqs),
                      max_model_len=int(model.max_model_len),
                      topk=topk_width(int(topk), int(kpool)), block_size=BLOCK_SIZE,
                      softmax_scale=float(softmax_scale))


def shared_backend(cfg: Glm5Config, device, cache_dtype: str) -> Glm5FlashMLABackend:
    if cache_dtype != CACHE_DTYPE:
        raise ValueError(f"kv_cache_dtype {cache_dtype!r}: {_CACHE_HINT}")
    return shared.backend(Glm5FlashMLABackend, cfg, device, share_plan=True,
                          cache_dtype=CACHE_DTYPE)


class SparseMLAGlm5Backend(v32.SparseMLAV32Backend):
    supported_kv_cache_dtypes = [CACHE_DTYPE]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type:
        return SparseMLAGlm5Impl

    @staticmethod
    def get_builder_cls() -> type:
        return SparseMLAGlm5MetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int = 1,
                           head_size: int = D_Q, cache_dtype_str: str = CACHE_DTYPE
                           ) -> Tuple[int, int, int]:
        """vLLM's ``MLAAttentionSpec`` page for this layer: 656 B records (the spec's
        ``state_content_bytes``), whatever the 512 head size would suggest."""
        if num_kv_heads != 1 or head_size != D_Q:
            raise ValueError(f"{NAME} caches have one {D_Q}-wide latent head, got "
                             f"num_kv_heads={num_kv_heads}, head_size={head_size}")
        if cache_dtype_str != CACHE_DTYPE:
            raise ValueError(f"cache_dtype_str {cache_dtype_str!r}: {_CACHE_HINT}")
        return (num_blocks, block_size, v32.FP8_DS_MLA_BYTES)

    @classmethod
    def get_supported_head_sizes(cls) -> list:
        return [D_Q]

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # the point of this route: the backend's ops have a Triton route on every CUDA GPU
        # (sm_8x decodes e4m3 in integer arithmetic), where vLLM's FLASHMLA_SPARSE is sm_90 only
        return capability.major >= 8

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):
        if kv_cache_dtype is not None and kv_cache_dtype != CACHE_DTYPE:
            return _CACHE_HINT
        # a RoPE-carrying 512-wide model would lose its RoPE product in the zero tail
        from vllm.config import get_current_vllm_config_or_none

        vc = get_current_vllm_config_or_none()
        model = getattr(vc, "model_config", None)
        if model is not None and getattr(model.hf_text_config, "qk_rope_head_dim", 0) != 0:
            return f"{NAME} is for no-RoPE (qk_rope_head_dim 0) GLM-5.3 models"
        return None


class SparseMLAGlm5MetadataBuilder(v32.SparseMLAV32MetadataBuilder):
    """V3.2's builder (request split, positions, one plan per step) on the GLM-5.3 layer's
    configuration, so on the planner its layers' backends share."""

    LAYER_CONFIG = staticmethod(layer_config)


class SparseMLAGlm5Impl(v32.SparseMLAV32Impl):
    supports_quant_query_input = False    # q arrives bf16 (ql_nope, an empty q_pe)

    NAME = NAME
    LAYER_CONFIG = staticmethod(layer_config)
    SHARED_BACKEND = staticmethod(shared_backend)

    def _check_layer(self, head_size, kv_lora_rank, qk_rope_head_dim, kv_cache_dtype):
        if head_size != D_Q or kv_lora_rank != D_Q or qk_rope_head_dim != 0:
            raise ValueError(f"{NAME} is for GLM-5.3's no-RoPE 512 latent: head_size "
                             f"{head_size}, kv_lora_rank {kv_lora_rank}, qk_rope_head_dim "
                             f"{qk_rope_head_dim}")
        if kv_cache_dtype != CACHE_DTYPE:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: {_CACHE_HINT}")

    def _check_config(self):
        width = self.topk_indices_buffer.shape[1]
        if width != self.config.topk:
            raise ValueError(f"topk_indices_buffer has {width} columns, the model's "
                             f"round_up(index_topk + index_kpool - 1, 128) is "
                             f"{self.config.topk}")

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping,
                           kv_cache_dtype: str, k_scale, skip_scale: bool = False) -> None:
        """The 656 B record from ``kv_c_normed`` alone, RoPE bytes +0.0 (``k_pe`` is the
        empty RoPE slice); ours, so the write runs wherever the attention does. ``k_scale``
        never applies (the record carries its own tile scales)."""
        if kv_cache_dtype != CACHE_DTYPE or skip_scale:
            raise ValueError(f"{NAME}: vLLM asked for a {kv_cache_dtype!r} cache write "
                             f"(skip_scale={skip_scale}); {_CACHE_HINT}")
        if k_pe is not None and k_pe.numel():
            raise ValueError(f"{NAME}: k_pe must be empty (no RoPE dims), got shape "
                             f"{tuple(k_pe.shape)}")
        n = slot_mapping.shape[0]
        ci.quantize_insert_v32_nope(kv_c_normed[:n], kv_cache, slot_mapping, BLOCK_SIZE,
                                    "fp32", self.backend.impl)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata,
                    layer) -> Tuple[torch.Tensor, None]:
        """Attention of every row of ``q`` (``(ql_nope [T, H, 512], q_pe [T, H, 0])`` or one
        ``[T, H, 512]`` tensor) over the cache, with this layer's indexer top-k. q goes into
        the backend's zero-tailed 576-wide buffer (the record's RoPE bytes are zeros)."""
        if isinstance(q, tuple):
            ql_nope, q_pe = q
            if q_pe.shape[-1]:
                raise ValueError(f"{NAME}: q_pe must be empty (no RoPE dims), got shape "
                                 f"{tuple(q_pe.shape)}")
            q = ql_nope
        if q.dim() != 3 or q.shape[1:] != (self.num_heads, D_Q):
            raise ValueError(f"q must have shape [num_tokens, {self.num_heads}, {D_Q}], got "
                             f"{list(q.shape)}")
        T = q.shape[0]
        if T > self.config.max_num_tokens:
            raise ValueError(f"q has {T} tokens, more than max_num_tokens="
                             f"{self.config.max_num_tokens}")
        self.backend.q_pad[:T, :, :D_Q].copy_(q)
        return super().forward_mqa(self.backend.q_pad[:T], kv_c_and_k_pe_cache,
                                   attn_metadata, layer)
