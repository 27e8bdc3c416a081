"""vLLM's DeepSeek-V4 indexer on sparse_mla where DeepGEMM cannot run (docs/integrations.md,
"The indexer").

vLLM 0.32.0 / 0.33.0 build each DeepSeek-V4 indexer's scoring layer from the name
``SparseAttnIndexer`` in ``vllm.models.deepseek_v4.attention`` (0.32.0 calls it in
``DeepseekV4Indexer.__init__``, 0.33.0 returns it from ``_get_attn_cls``) and quantize its q
with ``fused_indexer_q_rope_quant``, looked up in the same module (0.32.0 inline in
``DeepseekV4Indexer.forward``, 0.33.0 in ``_q_rope_quant``). ``install(module)`` replaces both
names there (plugin.py, CUDA route):

- ``indexer_class(SparseAttnIndexer)``: vLLM's class, unchanged unless ``replaces(config)``
  holds at construction; then its constructor runs with the DeepGEMM check waived and
  ``forward_cuda`` selects on ``indexer.indexer_topk`` (sparse_mla's
  ``indexer_topk_decode``) from the same inputs and metadata.
- ``q_quant(original)``: vLLM's quantizer, or ``indexer_q.q_rope_quant`` (plain PyTorch,
  exact e4m3) once a replacing indexer exists in the process.

``replaces(config)``: the configured attention backend is one of ours (``names.ALL``; every
other backend keeps vLLM's indexer, as every other piece of vLLM) and ``SPARSE_MLA_VLLM_INDEXER``
is ``auto`` (default: ours exactly where vLLM's cannot run: CUDA without an importable
DeepGEMM, or a GPU other than sm_90 / sm_100 — SM120 and sm_8x included), ``sparse_mla``
(always ours) or ``vllm`` (never).
"""
from __future__ import annotations

import contextlib
import os

import torch

from sparse_mla.integration.vllm import indexer, indexer_q, names

ENV = "SPARSE_MLA_VLLM_INDEXER"
MODES = ("auto", "sparse_mla", "vllm")
# DeepGEMM's fp8_mqa_logits / fp8_paged_mqa_logits are built for these majors only.
DEEPGEMM_MAJORS = (9, 10)
# One flag per process: vLLM builds every layer of a model from one config, so a process
# with one replacing indexer has only replacing indexers.
_active = {"q_quant": False}


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def deepgemm_runs(sai_module) -> bool:
    """vLLM's own indexer can run here: CUDA, DeepGEMM importable (the very function vLLM's
    constructor asks), and a GPU DeepGEMM's indexer kernels are built for."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda() or not sai_module.has_deep_gemm():
        return False
    return torch.cuda.get_device_capability()[0] in DEEPGEMM_MAJORS


def replaces(vllm_config, sai_module) -> bool:
    attn = getattr(vllm_config, "attention_config", None)
    if names.lookup(getattr(attn, "backend", None)) is None:
        return False
    which = mode()
    if which == "vllm":
        return False
    return which == "sparse_mla" or not deepgemm_runs(sai_module)


@contextlib.contextmanager
def _deep_gemm_check_waived(sai_module):
    """vLLM's constructor refuses CUDA when ``has_deep_gemm()`` (looked up in its module) is
    false; for our indexer that check does not apply, everything else it sets up does."""
    original = sai_module.has_deep_gemm
    sai_module.has_deep_gemm = lambda: True
    try:
        yield
    finally:
        sai_module.has_deep_gemm = original


def indexer_class(base):
    """A subclass of vLLM's ``SparseAttnIndexer`` (``base``) that decides per layer."""
    import importlib

    from vllm.config import get_current_vllm_config

    sai_module = importlib.import_module(base.__module__)

    class SparseMLAIndexer(base):
        sparse_mla_replacement = True

        def __init__(self, *args, **kwargs):
            ours = replaces(get_current_vllm_config(), sai_module)
            if not ours:
                super().__init__(*args, **kwargs)
                self.sparse_mla = False
                return
            with _deep_gemm_check_waived(sai_module):
                super().__init__(*args, **kwargs)
            _refuse_unsupported(self)
            self.sparse_mla = True
            _active["q_quant"] = True

        def forward_cuda(self, hidden_states, q_quant, k, weights):
            if not self.sparse_mla:
                return super().forward_cuda(hidden_states, q_quant, k, weights)
            return forward(self, hidden_states, q_quant, k, weights)

    SparseMLAIndexer.__qualname__ = SparseMLAIndexer.__name__ = f"SparseMLA{base.__name__}"
    return SparseMLAIndexer


def _refuse_unsupported(layer) -> None:
    """What our forward does not map, refused when the layer is built, not mid-serve."""
    why = []
    if layer.use_fp4_cache:
        why.append("an MXFP4 indexer cache (use_fp4_cache)")
    if layer.dcp_world_size > 1 or layer.use_pcp:
        why.append("decode / prefill context parallelism")
    if not layer.skip_k_cache_insert:
        why.append("the indexer's own K-cache insert (skip_k_cache_insert=False)")
    if getattr(layer, "candidate_blocks", None) is not None:
        why.append("V4.1's two-level candidate selection")
    if why:
        raise NotImplementedError(
            f"sparse_mla's vLLM indexer ({ENV}={mode()}) does not support "
            f"{'; '.join(why)}; run vLLM's own indexer ({ENV}=vllm, on a GPU DeepGEMM runs on)")


def forward(layer, hidden_states, q_quant, k, weights):
    """vLLM's ``forward_cuda`` contract: fills ``layer.topk_indices_buffer`` (request-local
    compressed ids, -1 padded) for this step's tokens and returns it."""
    from vllm.forward_context import get_forward_context

    buffer = layer.topk_indices_buffer
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return buffer                   # profiling / dummy run: no metadata to act on
    if isinstance(q_quant, tuple):
        raise NotImplementedError("sparse_mla's vLLM indexer: MXFP4 q (a (values, scales) "
                                  "pair) is not supported")
    metadata = attn_metadata[layer.k_cache.prefix]
    buffer[:hidden_states.shape[0]] = -1
    indexer.indexer_topk(q_quant, weights, layer.k_cache.kv_cache, metadata,
                         buffer[:, :layer.topk_tokens])
    return buffer


def q_quant(original):
    """Stands in for ``fused_indexer_q_rope_quant`` in vLLM's DeepSeek-V4 attention module:
    ours for the FP8 path once a replacing indexer exists, vLLM's otherwise."""

    def fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                                   index_weights_softmax_scale, index_weights_head_scale,
                                   use_fp4=False, weights_out_dtype=torch.float32):
        if not _active["q_quant"] or use_fp4 or weights_out_dtype != torch.float32:
            return original(positions, index_q, index_q_cos_sin_cache, index_weights,
                            index_weights_softmax_scale, index_weights_head_scale,
                            use_fp4=use_fp4, weights_out_dtype=weights_out_dtype)
        return indexer_q.q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                                      index_weights_softmax_scale, index_weights_head_scale)

    fused_indexer_q_rope_quant.sparse_mla_replacement = True
    fused_indexer_q_rope_quant.wrapped = original
    return fused_indexer_q_rope_quant


def install(module) -> None:
    """Replaces ``SparseAttnIndexer`` and ``fused_indexer_q_rope_quant`` in ``module``
    (vllm.models.deepseek_v4.attention), once."""
    if getattr(module.SparseAttnIndexer, "sparse_mla_replacement", False):
        return
    module.SparseAttnIndexer = indexer_class(module.SparseAttnIndexer)
    module.fused_indexer_q_rope_quant = q_quant(module.fused_indexer_q_rope_quant)
