"""vLLM's GLM-5.3 (glm5next) kpool indexer on sparse_mla's ``ops/indexer_kpool`` where vLLM's
cannot run (docs/integrations.md, "GLM-5.3").

vLLM 0.32.0 / 0.33.0 build each glm5next DSA layer's indexer op from the name
``SparseAttnIndexerKpool`` in ``vllm.models.glm5next.common.attention`` (``Indexer.__init__``)
and rotate + quantize its q with ``fwht128_quant_fp8``, looked up in the same module
(``Indexer.forward``). vLLM's op needs CUDA with DeepGEMM (``fp8_fp4_mqa_logits``,
``fp8_fp4_paged_mqa_logits``; its constructor refuses CUDA without it) plus vLLM's CUDA
``_C`` top-k and gather ops: nothing of it runs on CPU, a 4090 or SM120. ``install(module)``
replaces both names there (plugin.py, both routes):

- ``indexer_class(SparseAttnIndexerKpool)``: vLLM's class, unchanged unless ``replaces``
  holds at construction; then ``forward_cuda`` (which vLLM's ``forward_native`` and so its
  CPU dispatch also call) inserts this step's keys with ``kpool_k_insert`` (pooled cache +
  tail ring) and fills ``topk_indices_buffer[:T, :topk + kpool - 1]`` with
  ``kpool_topk_decode``: every row, decode or prefill, as a one-token request at its own
  position over its request's pooled-cache block-table row.
- ``q_quant(original)``: vLLM's Triton ``fwht128_quant_fp8``, or ours (plain PyTorch, exact
  e4m3, ``ops/indexer_kpool/reference.fwht128_quant``) once a replacing indexer exists.

``replaces(config)``: the configured attention backend is ``SPARSE_MLA_GLM5`` and
``SPARSE_MLA_VLLM_INDEXER`` (shared with DeepSeek-V4's indexer, ``indexer_layer.py``) is
``auto`` (ours where vLLM's cannot run: CPU, CUDA without DeepGEMM or a GPU other than sm_90 /
sm_100), ``sparse_mla`` (always) or ``vllm`` (never).
"""
from __future__ import annotations

import importlib

import torch

from sparse_mla.integration.vllm import indexer, indexer_layer, names, shared
from sparse_mla.ops.indexer_kpool import kpool_k_insert, kpool_topk_decode
from sparse_mla.ops.indexer_kpool import reference as kpool_reference

# scale_fmt of our pooled cache: we write and read it, so it only has to agree with itself;
# fp32 reads on every route (ue8m0 bytes only on the reference route of the decode op)
SCALE_FMT = "fp32"
_active = {"q_quant": False}


def replaces(vllm_config, sai_module) -> bool:
    attn = getattr(vllm_config, "attention_config", None)
    selected = getattr(attn, "backend", None)
    if getattr(selected, "name", selected) != names.GLM5:
        return False
    which = indexer_layer.mode()
    if which == "vllm":
        return False
    return which == "sparse_mla" or not indexer_layer.deepgemm_runs(sai_module)


def indexer_class(base):
    """A subclass of vLLM's ``SparseAttnIndexerKpool`` (``base``) that decides per layer."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.config import get_current_vllm_config

    sai_module = importlib.import_module(base.__module__)
    # as vLLM's own op: under a breakable CUDA-graph capture the step runs eagerly between
    # graph segments (the prefill rows' candidate bound is a host read)
    step_eagerly = eager_break_during_capture(forward)

    class SparseMLAKpoolIndexer(base):
        sparse_mla_replacement = True

        def __init__(self, *args, **kwargs):
            if not replaces(get_current_vllm_config(), sai_module):
                super().__init__(*args, **kwargs)
                self.sparse_mla = False
                return
            with indexer_layer._deep_gemm_check_waived(sai_module):
                super().__init__(*args, **kwargs)
            _refuse_unsupported(self)
            self.sparse_mla = True
            _active["q_quant"] = True

        def forward_cuda(self, hidden_states, q_quant, k, weights, *, gate_score=None,
                         compress_ape=None, index_kpool=1, positions=None):
            if not self.sparse_mla:
                return super().forward_cuda(hidden_states, q_quant, k, weights,
                                            gate_score=gate_score, compress_ape=compress_ape,
                                            index_kpool=index_kpool, positions=positions)
            return step_eagerly(self, hidden_states, q_quant, k, weights, gate_score,
                                compress_ape, index_kpool, positions)

    SparseMLAKpoolIndexer.__qualname__ = SparseMLAKpoolIndexer.__name__ = \
        f"SparseMLA{base.__name__}"
    return SparseMLAKpoolIndexer


def _refuse_unsupported(layer) -> None:
    """What our forward does not map, refused when the layer is built, not mid-serve."""
    why = []
    if layer.use_fp4_cache:
        why.append("an MXFP4 indexer cache (use_fp4_cache)")
    if layer.dcp_world_size > 1:
        why.append("decode context parallelism")
    if layer.tail_cache is None:
        why.append("a kpool indexer without its tail cache")
    if why:
        raise NotImplementedError(
            f"sparse_mla's GLM-5.3 indexer ({indexer_layer.ENV}={indexer_layer.mode()}) does "
            f"not support {'; '.join(why)}; run vLLM's own indexer ({indexer_layer.ENV}=vllm, "
            f"on a GPU DeepGEMM runs on)")


def forward(layer, hidden_states, q_quant, k, weights, gate_score, compress_ape, kpool,
            positions):
    """vLLM's ``forward_cuda`` contract: this step's keys into the pooled cache and tail ring,
    then ``layer.topk_indices_buffer`` rows (request-local token ids, -1 padded) for this
    step's tokens; returns the buffer."""
    from vllm.forward_context import get_forward_context

    buffer = layer.topk_indices_buffer
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return buffer                   # profiling / dummy run: no metadata to act on
    if isinstance(q_quant, tuple):
        raise NotImplementedError("sparse_mla's GLM-5.3 indexer: MXFP4 q (a (values, scales) "
                                  "pair) is not supported")
    for name, v in (("gate_score", gate_score), ("compress_ape", compress_ape),
                    ("positions", positions)):
        if v is None:
            raise ValueError(f"sparse_mla's GLM-5.3 indexer needs {name} (index_kpool="
                             f"{kpool})")
    tail_prefix = layer.tail_cache.prefix
    if tail_prefix not in attn_metadata:
        raise ValueError(f"no attention metadata for the tail cache {tail_prefix!r}")
    step(attn_metadata[layer.k_cache.prefix], attn_metadata[tail_prefix],
         layer.k_cache.kv_cache, layer.tail_cache.kv_cache, k, gate_score, compress_ape,
         positions, q_quant, weights, buffer, layer.topk_tokens, kpool,
         insert=not layer.skip_k_cache_insert)
    return buffer


def step(metadata, tail_metadata, kv_cache, tail_cache, k, gate_score, compress_ape, positions,
         q_quant, weights, buffer, topk, kpool, insert=True, impl=None):
    """One layer's indexer step on vLLM's two metadata objects (the pooled cache's, the tail
    ring's), without vLLM: insert this step's keys (``insert``), then -1 the step's rows of
    ``buffer`` and fill their first ``topk + kpool - 1`` columns. ``impl``: the ops' route
    (default: the plugin's for the device, ``shared.kernel_impl``)."""
    T = metadata.slot_mapping.shape[0]
    impl = impl or shared.kernel_impl(kv_cache.device)
    if insert:
        kpool_k_insert(k[:T], gate_score[:T], compress_ape, positions[:T], metadata.slot_mapping,
                       tail_metadata.slot_mapping[:T], kv_cache, tail_cache, kpool,
                       scale_fmt=SCALE_FMT, impl=impl)
    buffer[:q_quant.shape[0]] = -1
    topk_rows(q_quant, weights, kv_cache, metadata, positions[:T],
              buffer[:, :topk + kpool - 1], kpool, impl)


def topk_rows(q_quant, weights, kv_cache, metadata, positions, out, kpool, impl="auto"):
    """``out[t]`` for each of the step's tokens ``t``: the token at ``positions[t]`` as a
    one-token request (``seq_lens`` = position + 1, so its own causal pool bound and tail)
    over its request's row of the pooled cache's block table, from vLLM's
    ``DeepseekV32IndexerMetadata`` (pool-granular, as the kpool cache spec makes it)."""
    seq = (positions.to(torch.int64) + 1).to(torch.int32)
    if metadata.num_prefills > 0 and metadata.prefill is not None:
        for chunk in metadata.prefill.chunks:
            rows = slice(chunk.token_start, chunk.token_end)
            if chunk.token_end <= chunk.token_start:
                continue
            starts = chunk.local_cu_seq_lens
            if starts is None:
                starts = chunk.cu_seq_lens
            # a row's request from its row-start tag (pool-granular offsets into the gathered
            # keys); a request without a complete pool ties with the next one, harmlessly:
            # its rows have no pool candidate, and the tail is from the position alone
            req = torch.searchsorted(starts, chunk.cu_seqlen_ks, right=True) - 1
            rseq = seq[rows]
            _topk(q_quant[rows], weights[rows], kv_cache, rseq, chunk.block_table[
                req.clamp_min(0)], out[rows], kpool, int(rseq.max()) // kpool, impl)
    if metadata.num_decodes > 0 and metadata.decode is not None:
        n = metadata.num_decode_tokens
        _, table = indexer.decode_rows(metadata.decode, n)
        _topk(q_quant[:n], weights[:n], kv_cache, seq[:n], table, out[:n], kpool, None, impl)
    return out


def _topk(q, weights, kv_cache, seq, table, out, kpool, max_candidates, impl):
    kpool_topk_decode(q, weights, kv_cache, seq, table, out, kpool, next_n=1,
                      block_size=kv_cache.shape[1], max_candidates=max_candidates,
                      scale_fmt=SCALE_FMT, impl=impl)


def q_quant(original):
    """Stands in for ``fwht128_quant_fp8`` in vLLM's glm5next attention module: ours once a
    replacing indexer exists, vLLM's Triton kernel otherwise."""

    def fwht128_quant_fp8(q):
        if not _active["q_quant"]:
            return original(q)
        vals, scale = kpool_reference.fwht128_quant(q)
        return vals, scale.unsqueeze(-1)

    fwht128_quant_fp8.sparse_mla_replacement = True
    fwht128_quant_fp8.wrapped = original
    return fwht128_quant_fp8


def install(module) -> None:
    """Replaces ``SparseAttnIndexerKpool`` and ``fwht128_quant_fp8`` in ``module``
    (vllm.models.glm5next.common.attention), once."""
    if getattr(module.SparseAttnIndexerKpool, "sparse_mla_replacement", False):
        return
    module.SparseAttnIndexerKpool = indexer_class(module.SparseAttnIndexerKpool)
    module.fwht128_quant_fp8 = q_quant(module.fwht128_quant_fp8)
