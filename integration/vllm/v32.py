"""DeepSeek-V3.2 attention on ``backends/v32`` through vLLM's attention-backend registry.

Unlike DeepSeek-V4, vLLM's DeepSeek-V3.2 layer (``vllm.models.deepseek_v32.attention.
DeepseekV32Attention``, an ``MLAAttention``) takes its backend from the registry, so
``--attention-backend SPARSE_MLA_V32`` selects the classes here directly, with no patch:

- :class:`SparseMLAV32Backend`: what vLLM's selector validates (bf16 model, head size 576,
  MLA, sparse; caches ``fp8_ds_mla`` (656 B per token) or bf16 (576 wide), 64-token blocks).
- :class:`SparseMLAV32MetadataBuilder`: vLLM's ``CommonAttentionMetadata`` → the backends'
  ``BatchDescription`` (``mapping.v32_batch_description``) and the step's shared plan, once
  per step for all layers.
- :class:`SparseMLAV32Impl`: ``forward_mqa`` runs every token (decode and prefill) through a
  ``V32FlashMLABackend``; vLLM's layer then applies its own ``W_UV`` up-projection.

What stays vLLM's: the cache write (vLLM 0.32's V3.2 layer writes this step's rows inside its
fused norm + RoPE kernel, ``fused_norm_rope``; the generic ``MLAAttention.forward`` path uses
``impl.do_kv_cache_update``, left as vLLM's ``concat_and_cache_mla``: both write the layouts
the backend reads), the indexer (it fills the shared top-k buffer), q's absorption and RoPE.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Tuple

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SharedTopkIndicesBuffer, SparseMLACommonMetadata)
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport,
                                       AttentionMetadataBuilder, CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from sparse_mla.backends.common import BatchDescription
from sparse_mla.backends.v32 import V32Config, V32FlashMLABackend
from sparse_mla.backends.v32.config import D_QK, D_V
from sparse_mla.backends.v32.planner import V32Planner
from sparse_mla.integration.vllm import mapping, names, shared

NAME = names.V32
BLOCK_SIZE = 64                 # tokens per cache block the backend is built for (vLLM's)
FP8_DS_MLA_BYTES = 656          # 512 e4m3 + 4 fp32 scales + 64 bf16 RoPE dims
# "auto" is the model's dtype, which supported_dtypes pins to bf16. vLLM rewrites "fp8" to
# "fp8_ds_mla" only for its own FLASHMLA_SPARSE name, so a plain fp8 cache would reach us.
CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")


def layer_config(vllm_config: VllmConfig, num_heads: int,
                 softmax_scale: float = D_QK ** -0.5) -> V32Config:
    """A V3.2 layer's static shape from vLLM's config (local heads, the indexer's top-k, the
    scheduler's capacities). The prefill workspace holds ``max_model_len`` bf16 rows: any
    one request's whole context."""
    model, sched = vllm_config.model_config, vllm_config.scheduler_config
    if model is None:
        raise ValueError("vllm_config.model_config is required (index_topk, max_model_len)")
    topk = getattr(model.hf_text_config, "index_topk", None)
    if topk is None:
        raise ValueError(f"{NAME} is for DeepSeek-V3.2 models: the model config has no "
                         f"index_topk")
    return V32Config(num_heads=int(num_heads), max_num_tokens=int(sched.max_num_batched_tokens),
                     max_num_reqs=int(sched.max_num_seqs),
                     max_model_len=int(model.max_model_len), topk=int(topk),
                     block_size=BLOCK_SIZE, softmax_scale=float(softmax_scale))


def shared_planner(cfg: V32Config, device) -> V32Planner:
    """The step plan every V3.2 layer of these capacities reads: the builder plans it once
    per step (``shared.planner``)."""
    return shared.planner(V32Planner, cfg, device)


def shared_backend(cfg: V32Config, device, cache_dtype: str) -> V32FlashMLABackend:
    """The backend of a V3.2 layer of ``cfg`` with vLLM's ``kv_cache_dtype`` (``shared.backend``,
    on the shared planner)."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {CACHE_DTYPES} for {NAME}, got "
                         f"{cache_dtype!r}")
    ours = "fp8_ds_mla" if cache_dtype == "fp8_ds_mla" else "bfloat16"
    return shared.backend(V32FlashMLABackend, cfg, device, share_plan=True, cache_dtype=ours)


class SparseMLAV32Backend(AttentionBackend):
    supported_dtypes: ClassVar[list] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type:
        return SparseMLAV32Impl

    @staticmethod
    def get_builder_cls() -> type:
        return SparseMLAV32MetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # exactly 64: larger vLLM blocks are split into 64-token kernel blocks
        return [BLOCK_SIZE]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int = 1,
                           head_size: int = D_QK, cache_dtype_str: str = "auto"
                           ) -> Tuple[int, int, int]:
        """The per-layer cache the impl reads, as vLLM 0.32 shapes it from the layer's
        ``MLAAttentionSpec`` (bound squeezed to ``[blocks, block_size, C]``): C = 656 bytes
        (uint8) for ``fp8_ds_mla``, else 576 bf16 values. vLLM 0.32 itself never calls this;
        the spec decides the allocation."""
        if num_kv_heads != 1 or head_size != D_QK:
            raise ValueError(f"{NAME} caches have one 576-wide latent head, got "
                             f"num_kv_heads={num_kv_heads}, head_size={head_size}")
        if cache_dtype_str not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype_str must be one of {CACHE_DTYPES}, got "
                             f"{cache_dtype_str!r}")
        width = FP8_DS_MLA_BYTES if cache_dtype_str == "fp8_ds_mla" else D_QK
        return (num_blocks, block_size, width)

    @classmethod
    def get_supported_head_sizes(cls) -> list:
        # 512 latent + 64 RoPE; vLLM's FLASHMLA_SPARSE also takes 512 (NoPE GLM), we do not
        return [D_QK]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # what vLLM's FLASHMLA_SPARSE declares; the backends' GPU runs are on SM90
        return capability.major in (9, 10)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # the prefill workspace chunks are planned from the host query_start_loc
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):
        if kv_cache_dtype is not None and kv_cache_dtype.startswith("fp8") and \
                kv_cache_dtype != "fp8_ds_mla":
            return (f"{NAME} reads fp8 caches only in DeepSeek's fp8_ds_mla layout; pass "
                    f"--kv-cache-dtype fp8_ds_mla")
        return None


@dataclasses.dataclass(kw_only=True)
class SparseMLAV32Metadata(SparseMLACommonMetadata):
    """vLLM's sparse-MLA metadata (what vLLM's V3.2 layer reads: token counts, the request
    split, ``prefill=None`` so no dense-MHA prefill) plus the backends' batch."""

    batch: Optional[BatchDescription] = None
    planner: Optional[V32Planner] = None     # the plan the batch was planned into


class SparseMLAV32MetadataBuilder(AttentionMetadataBuilder[SparseMLAV32Metadata]):
    # The backends keep a uniform decode step's buffers at stable addresses, but nobody has
    # captured this builder's steps inside vLLM yet: vLLM runs the attention eagerly.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # the layer's static shape from vLLM's config (GLM-5.3's builder swaps in its own)
    LAYER_CONFIG = staticmethod(layer_config)

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if int(kv_cache_spec.block_size) != BLOCK_SIZE:
            raise ValueError(f"{NAME} needs {BLOCK_SIZE}-token kernel blocks, vLLM gives "
                             f"block_size={kv_cache_spec.block_size}")
        heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.config = self.LAYER_CONFIG(vllm_config, heads)
        self.device = shared.device_of(device)
        self.planner = shared_planner(self.config, self.device)
        self._positions = torch.zeros(self.config.max_num_tokens, dtype=torch.int64,
                                      device=self.device)
        self._token_ids = torch.arange(self.config.max_num_tokens, dtype=torch.int64,
                                       device=self.device)
        # MTP verification rows count as decodes: the decode path takes any query length
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SparseMLAV32Metadata:
        cm = common_attn_metadata
        Rd, Rp, Td, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold or 1)
        T = int(cm.num_actual_tokens)
        positions = self._positions if cm.positions is None else cm.positions
        batch = mapping.v32_batch_description(cm, Rd, Rp, positions)
        self.planner.plan(batch, T)
        if cm.positions is None:
            self._fill_positions(batch, T)
        return SparseMLAV32Metadata(
            num_reqs=cm.num_reqs, max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            num_actual_tokens=T, query_start_loc=cm.query_start_loc,
            slot_mapping=cm.slot_mapping, block_table=cm.block_table_tensor,
            req_id_per_token=self.planner.token_to_req[:T], seq_lens=cm.seq_lens,
            block_size=BLOCK_SIZE, topk_tokens=self.config.topk, num_decodes=Rd,
            num_prefills=Rp, num_decode_tokens=batch.num_decode_tokens,
            decode_max_query_len=batch.max_decode_query_len if Rd else 0, batch=batch,
            planner=self.planner)

    def _fill_positions(self, batch: BatchDescription, T: int) -> None:
        """Token t of request r sits at seq_lens[r] - query_start_loc[r + 1] + t; on the
        device, from the plan's token → request (padding rows get request 0's formula:
        nothing reads their position)."""
        R = batch.num_reqs
        if not T or not R:
            return
        req = self.planner.token_to_req[:T].long().clamp_(max=R - 1)
        pos = self._positions[:T]
        pos.copy_(batch.seq_lens.index_select(0, req))
        pos.sub_(batch.query_start_loc[1:R + 1].index_select(0, req)).add_(self._token_ids[:T])


class SparseMLAV32Impl(MLACommonBaseImpl[SparseMLAV32Metadata], SharedTopkIndicesBuffer):
    is_sparse = True
    # every row, prefill included, goes through the backend's top-k attention
    supports_dense_mha_prefill = False
    supports_pcp = False
    supports_dcp = False
    supports_quant_query_input = False    # q arrives bf16 (ql_nope, q_pe)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap,
                 attn_type: str, kv_sharing_target_layer_name, q_lora_rank,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 qk_head_dim: int, v_head_dim: int, kv_b_proj, indexer=None,
                 topk_indices_buffer: Optional[torch.Tensor] = None,
                 index_group_builder=None, q_pad_num_heads=None) -> None:
        MLACommonBaseImpl.__init__(self, num_heads, head_size, scale, num_kv_heads,
                                   kv_cache_dtype, kv_lora_rank, qk_nope_head_dim,
                                   qk_rope_head_dim, qk_head_dim, v_head_dim, kv_b_proj)
        self._check_layer(head_size, kv_lora_rank, qk_rope_head_dim, kv_cache_dtype)
        name = self.NAME
        for arg, v in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                       ("logits_soft_cap", logits_soft_cap)):
            if v is not None:
                raise ValueError(f"{name} does not support {arg} (got {v!r})")
        vcfg = get_current_vllm_config()
        if vcfg.attention_config.hisparse_config is not None:
            raise ValueError(f"{name} does not support HiSparse (host-backed KV)")
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)
        if self.topk_indices_buffer is None:
            raise ValueError(f"{name} needs the model's topk_indices_buffer (the indexer's "
                             f"top-k)")
        self.config = self.LAYER_CONFIG(vcfg, num_heads, scale)
        self._check_config()
        # Built here, not on the first step, which may run under CUDA-graph capture.
        self.backend = self.SHARED_BACKEND(self.config, self.topk_indices_buffer.device,
                                           kv_cache_dtype)

    # What a subclass for another model's layer (GLM-5.3: glm5.py) replaces.
    NAME = NAME
    LAYER_CONFIG = staticmethod(layer_config)
    SHARED_BACKEND = staticmethod(shared_backend)

    def _check_layer(self, head_size, kv_lora_rank, qk_rope_head_dim, kv_cache_dtype):
        if head_size != D_QK or kv_lora_rank != D_V or qk_rope_head_dim != D_QK - D_V:
            raise ValueError(f"{NAME} is for DeepSeek-V3.2's 512 + 64 latent: head_size "
                             f"{head_size}, kv_lora_rank {kv_lora_rank}, qk_rope_head_dim "
                             f"{qk_rope_head_dim}")
        if kv_cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {CACHE_DTYPES} for {NAME}, got "
                             f"{kv_cache_dtype!r}")

    def _check_config(self):
        """Checks of ``self.config`` against the model's buffers (none for V3.2)."""

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping,
                           kv_cache_dtype: str, k_scale, skip_scale: bool = False) -> None:
        """vLLM's own cache write (``concat_and_cache_mla``), under either release's call:
        vLLM 0.32 passes six arguments, 0.33 a seventh, ``skip_scale``
        (``mla_attention.py:811-819``: ``kv_cache_dtype`` is plain fp8 and the layer's
        ``k_scale`` is 1.0, so the kernel may skip multiplying by it). Our caches never take
        ``k_scale`` (``fp8_ds_mla`` carries its own tile scales, bf16 none) and plain fp8 is
        refused at construction, so ``skip_scale=True`` can only mean a cache we cannot read
        reached us."""
        if skip_scale:
            raise ValueError(f"{NAME}: vLLM asked for a plain fp8 cache write (skip_scale=True, "
                             f"kv_cache_dtype={kv_cache_dtype!r}); {NAME} reads only "
                             f"{CACHE_DTYPES} caches")
        # six positional arguments: what both releases' base method accepts
        super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                                   k_scale)

    def reserve_workspace(self) -> None:
        """vLLM 0.33 calls this in its profiling run (``mla_attention.py:948``) to claim
        workspace early; the backend allocated all of its buffers at construction
        (``shared.backend``), so there is nothing left to claim. 0.32 never calls it."""

    def record_logical_topk_ready(self) -> None:
        """vLLM's V3.2 layer calls this after its indexer; the top-k is read on the same
        stream, so there is nothing to signal."""

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: SparseMLAV32Metadata, layer) -> Tuple[torch.Tensor, None]:
        """Attention of every row of ``q`` (``(ql_nope [T, H, 512], q_pe [T, H, 64])`` or one
        ``[T, H, 576]`` tensor) over the cache, with this layer's indexer top-k. Returns the
        latent output ``[T, H, 512]`` and no lse (no context parallelism)."""
        if attn_metadata.batch is None:
            raise ValueError(f"attn_metadata has no batch: not built by {NAME}'s builder")
        if attn_metadata.planner is not self.backend.planner:
            # the attention would read another step's (or no) token -> request plan
            raise ValueError(f"attn_metadata was not planned by this layer's planner: the "
                             f"builder was made for another device or other capacities "
                             f"(layer: {self.backend.device}, {self.config})")
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        T = q.shape[0]
        batch = dataclasses.replace(attn_metadata.batch,
                                    topk_indices=self.topk_indices_buffer[:T])
        out = q.new_empty((T, self.num_heads, D_V))
        self.backend.attend(q, {"kv": kv_c_and_k_pe_cache}, batch, out=out, planned=True)
        return out, None
