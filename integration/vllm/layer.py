"""What the plugin's DeepSeek-V4 layers share on every vLLM route: the backend they call and
the two steps they replace.

vLLM's layer runs, per step: q-norm + RoPE of q and the insert of this step's kv rows into
the SWA cache (``_fused_qnorm_rope_kv_insert``), the compressor and indexer (vLLM's,
unchanged: they fill the compressed cache and the indexer's top-k), then the sparse attention
(``forward_mqa``). :class:`SparseMLALayerMixin` replaces exactly the first and the last with
the backend's ``write`` and ``attend``; the mapping of vLLM's metadata is ``mapping``.

Layers of one configuration share one backend object (``shared.backend``: a 61-layer model
allocates one set of buffers per layer kind, not 61).
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context

from sparse_mla.integration.vllm import counters, mapping, names, shared


def shared_backend(which: names.BackendName, cfg, device, cache_dtype=None):
    """The backend of ``which`` for a V4 layer of ``cfg`` (``cache_dtype``: the TRTLLM
    backend's cache element type)."""
    options = {} if cache_dtype is None else {"cache_dtype": cache_dtype}
    return shared.backend(names.backend_class(which), cfg, device, **options)


class SparseMLALayerMixin:
    """Mixed in before a vLLM DeepSeek-V4 attention class; ``sparse_mla_name`` is set by
    :func:`make_layer_class`."""

    sparse_mla_name: names.BackendName = names.SPARSE_MLA

    def _sparse_mla_init(self) -> None:
        vcfg = get_current_vllm_config()
        self._sparse_config = mapping.layer_config(
            num_heads=self.n_local_heads, compress_ratio=self.compress_ratio,
            max_num_tokens=vcfg.scheduler_config.max_num_batched_tokens,
            max_num_reqs=vcfg.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            topk=self.indexer.topk_tokens if self.indexer is not None else 512,
            window=self.window_size, swa_block_size=int(self.swa_cache_layer.block_size),
            compressed_vllm_block_size=(int(vcfg.cache_config.block_size)
                                        if self.compress_ratio > 1 else None),
            softmax_scale=self.scale, eps=self.eps)
        # Built here, not on the first step: that step may be under CUDA-graph capture.
        self._sparse_backend = shared_backend(self.sparse_mla_name, self._sparse_config,
                                              self.attn_sink.device, self._sparse_cache_dtype())

    def _sparse_cache_dtype(self):
        return None

    def _caches(self):
        caches = {"swa": self.swa_cache_layer.kv_cache}
        if self.compress_ratio > 1:
            caches["compressed"] = self.kv_cache
        return caches

    def _step(self, num_tokens: int, positions: torch.Tensor, for_write: bool = False):
        md = get_forward_context().attn_metadata
        swa_md = md[self.swa_cache_layer.prefix]
        comp_md = md.get(self.prefix) if self.compress_ratio > 1 else None
        cfg = self._sparse_config
        if int(swa_md.block_size) != cfg.swa_block_size or (
                comp_md is not None and mapping.compressed_block_size(
                    int(comp_md.block_size), self.compress_ratio) != cfg.compressed_block_size):
            raise ValueError(f"{self.prefix}: vLLM's block sizes (SWA {swa_md.block_size}, "
                             f"compressed {getattr(comp_md, 'block_size', None)}) differ from "
                             f"the ones the layer was built for ({cfg})")
        # vLLM's indexer fills topk_indices_buffer after the cache insert, so at write time
        # it still holds the previous layer's rows; the write reads no top-k and gets none.
        topk = self.topk_indices_buffer if self.compress_ratio == 4 and not for_write else None
        batch = mapping.batch_description(swa_md, comp_md, positions, num_tokens, cfg.kind,
                                          topk, write_only=for_write)
        return self._sparse_backend, batch

    def _fused_qnorm_rope_kv_insert(self, q, kv, positions, attn_metadata):
        if not isinstance(attn_metadata, dict):
            return super()._fused_qnorm_rope_kv_insert(q, kv, positions, attn_metadata)
        backend, batch = self._step(q.shape[0], positions, for_write=True)
        q_rot = backend.write(q, kv, self._caches(), batch, self.rotary_emb.cos_sin_cache)
        counters.record(self.prefix, "write")
        return q_rot

    def forward_mqa(self, q, kv, positions, output) -> None:
        if get_forward_context().attn_metadata is None:
            output.zero_()       # profile / warm-up run, as vLLM's layers do
            return
        backend, batch = self._step(q.shape[0], positions)
        H = self.n_local_heads
        backend.attend(q[:, :H], self._caches(), batch, self.attn_sink[:H], output[:, :H])
        counters.record(self.prefix, "attend")


_CLASSES: dict = {}


def make_layer_class(base: type, which: names.BackendName, **extra) -> type:
    """The layer class of backend name ``which`` over vLLM's ``base`` (``extra``: the route's
    own methods), built once per (base, name): a route asked twice gives the same class."""
    key = (base, which.name)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"SparseMLA_{base.__name__}_{which.name}",
                             (SparseMLALayerMixin, base), {"sparse_mla_name": which, **extra})
    return _CLASSES[key]
