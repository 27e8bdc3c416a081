"""DeepSeek-V4.1 attention over packed caches, composed as vLLM 0.32.0's
``DeepseekV4FlashMLAAttention`` (``vllm/models/deepseek_v41/nvidia/flashmla.py``) composes it.

The step is V4's FlashMLA-layout step (``backends/v4/flashmla.py``): decode rows through one
``flashmla_sparse_decode`` (the SWA window as the main list, the indexer's top-k as global
compressed slots as the extra list), prefill requests in workspace chunks (``gather_dequant``
of the compressed entries and the window context, ``combine_topk_swa_indices``, then
``flashmla_sparse_prefill``, index width ``round_up(topk + window, 128)`` = 640). What V4.1
changes is in the config (``V41LayerConfig``): both compressed kinds read the top-k, q is not
RMS-normed, 32-token SWA pages, and a layer may read a compressed cache another layer owns
(``owns_compressed=False``): such a layer validates that cache like its own but never writes
it, and does not list it among the caches it owns (``cache_specs``; ``read_specs`` lists
every cache a step reads).

Records: each cache's is a config value (bytes per token): the SWA cache 584 B (V4.0's, what
vLLM writes for V4.1 on SM90 / SM120) or 528 B (MXFP8), the compressed cache also 288 B
(NVFP4); ``record_layout`` says whether the 528 B / 288 B records are page-footer (vLLM
0.32.0) or token-inline (vLLM 0.33.0). The write runs V4.1's inserts in the configured
record (``fused_rope_insert_v41``, ``compressed_insert_v41``), the decode reads each list in
its cache's record (``kv_format`` / ``extra_kv_format``) and the prefill gathers each cache in
its own.

``compressed_kv`` is what V4.1's compressor hands its cache writer: one normed, not yet
rotated row per token (``[num_tokens, 512]``); the write rotates row t at position
``(pos // ratio) · ratio`` and stores it where ``compressed_slot_mapping[t] >= 0`` and
``(pos + 1) % ratio == 0`` (docs/semantics.md §12).
"""
from __future__ import annotations

from typing import Dict

from sparse_mla.backends.common.spec import CacheSpec
from sparse_mla.backends.v4.flashmla import FlashMLABackend
from sparse_mla.backends.v41.config import V41LayerConfig
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops.common import formats

# (bytes per token, record_layout) -> format; the 584 B record has one layout
_RECORDS = {(584, "footer"): formats.V4, (584, "inline"): formats.V4,
            (528, "footer"): formats.V41, (288, "footer"): formats.V41_FP4,
            (528, "inline"): formats.V41_INLINE, (288, "inline"): formats.V41_FP4_INLINE}


def record_format(record: int, cache: str, layout: str = "footer") -> formats.PagedFormat:
    """The ``formats`` paged record of ``record`` bytes per token (584, 528 or 288), its
    V4.1 records laid out per ``layout`` ("footer": vLLM 0.32.0, "inline": vLLM 0.33.0)."""
    try:
        return _RECORDS[(record, layout)]
    except KeyError:
        sizes = sorted({r for r, _ in _RECORDS}, reverse=True)
        raise ValueError(f"{cache}_record must be one of {sizes} (bytes per token) and the "
                         f"layout 'footer' or 'inline', got {record!r}, {layout!r}") from None


class V41FlashMLABackend(FlashMLABackend):
    name = "v41_flashmla"
    CONFIG = V41LayerConfig
    OPS = ("fused_rope_insert_v41", "compressed_insert_v41") + tuple(
        op for op in FlashMLABackend.OPS
        if op not in ("fused_qnorm_rope_insert_v4", "quantize_insert_v4"))

    def _records(self) -> Dict[str, formats.PagedFormat]:
        cfg = self.config
        rec = {"swa": record_format(cfg.swa_record, "swa", cfg.record_layout)}
        if cfg.kind.compressed:
            rec["compressed"] = record_format(cfg.compressed_record, "compressed",
                                              cfg.record_layout)
        return rec

    def cache_specs(self) -> Dict[str, CacheSpec]:
        """The caches this layer owns: without ``owns_compressed``, the SWA cache only."""
        specs = self.read_specs()
        if not self.config.owns_compressed:
            specs.pop("compressed")
        return specs

    def read_specs(self) -> Dict[str, CacheSpec]:
        """Every cache a step reads, a source layer's compressed cache included."""
        return super().cache_specs()

    def _validate_inputs(self, q, caches, batch, kv, cos_sin_cache, compressed_kv, attention):
        cfg = self.config
        if not cfg.owns_compressed and (compressed_kv is not None
                                        or batch.compressed_slot_mapping is not None):
            raise ValueError("compressed_kv and batch.compressed_slot_mapping must be None: "
                             "this layer reads a source layer's compressed cache and never "
                             "writes it (the source layer's step does)")
        if compressed_kv is not None and compressed_kv.dim() == 2 \
                and compressed_kv.shape[0] != q.shape[0]:
            raise ValueError(f"compressed_kv must have one row per token ([{q.shape[0]}, 512]: "
                             f"the write rotates each at its token's position), got "
                             f"{list(compressed_kv.shape)}")
        super()._validate_inputs(q, caches, batch, kv, cos_sin_cache, compressed_kv, attention)

    def _write(self, q, kv, caches, batch, cos_sin_cache, compressed_kv):
        cfg, T = self.config, q.shape[0]
        q_rot = self.q_rot[:T]
        ci.fused_rope_insert_v41(q, kv, caches["swa"], batch.swa_slot_mapping, batch.positions,
                                 cos_sin_cache, q_rot, cfg.swa_block_size,
                                 self.records["swa"].name, self.impl)
        if compressed_kv is not None:
            ci.compressed_insert_v41(compressed_kv, caches["compressed"],
                                     batch.compressed_slot_mapping, batch.positions,
                                     cos_sin_cache, cfg.kind.ratio, cfg.compressed_block_size,
                                     self.records["compressed"].name, None, self.impl)
        return q_rot
