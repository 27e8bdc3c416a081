"""DeepSeek-V4.1 attention over packed caches, composed as vLLM 0.32.0's
``DeepseekV4FlashMLAAttention`` (``vllm/models/deepseek_v41/nvidia/flashmla.py``) composes it.

The step is V4's FlashMLA-layout step (``backends/flashmla``): decode rows through one
``flashmla_sparse_decode`` (the SWA window as the main list, the indexer's top-k as global
compressed slots as the extra list), prefill requests in workspace chunks (``gather_dequant``
of the compressed entries and the window context, ``combine_topk_swa_indices``, then
``flashmla_sparse_prefill``, index width ``round_up(topk + window, 128)`` = 640). What V4.1
changes is in the config (``V41LayerConfig``): both compressed kinds read the top-k, q is not
RMS-normed, 32-token SWA pages, and a layer may read a compressed cache another layer owns
(``owns_compressed=False``): such a layer validates that cache like its own but never writes
it, and does not list it among the caches it owns (``cache_specs``; ``read_specs`` lists
every cache a step reads).

Records: each cache's is a config value (bytes per token). Today the backend writes and
reads the 584 B record (the one vLLM writes for V4.1 on SM90 / SM120); 528 B / 288 B are
refused by name (``WIRED_RECORDS``) until their inserts, gathers and decode reads are wired.
"""
from __future__ import annotations

from typing import Dict

from sparse_mla.backends.common.spec import CacheSpec
from sparse_mla.backends.flashmla.backend import FlashMLABackend
from sparse_mla.backends.v41.config import V41LayerConfig
from sparse_mla.ops.common import formats


# Records this backend writes and reads today (SWA insert, compressed insert, prefill gather,
# decode). The 528 B / 288 B records join when the ops for all four exist (issue 52 item 3).
WIRED_RECORDS = (584,)


def record_format(record: int, cache: str) -> formats.PagedFormat:
    """The ``formats`` paged record of ``record`` bytes per token that this backend runs."""
    if record not in WIRED_RECORDS:
        raise ValueError(f"{cache}_record={record}: the {record} B record is not wired into "
                         f"this backend yet (it runs {list(WIRED_RECORDS)} B; the 528 B / "
                         f"288 B records need their inserts, gathers and decode reads)")
    for fmt in formats.PAGED_FORMATS.values():
        if fmt.bytes_per_token == record and fmt.out_dim == formats.HEAD_DIM:
            return fmt
    raise ValueError(f"{cache}_record={record}: ops.common.formats has no {record} B record")


class V41FlashMLABackend(FlashMLABackend):
    name = "v41_flashmla"
    CONFIG = V41LayerConfig
    QFOLD = False   # the unfused write for now (the decode op's fold also takes RoPE only)

    def _records(self) -> Dict[str, formats.PagedFormat]:
        cfg = self.config
        rec = {"swa": record_format(cfg.swa_record, "swa")}
        if cfg.kind.compressed:
            rec["compressed"] = record_format(cfg.compressed_record, "compressed")
            if rec["compressed"] is not rec["swa"]:
                raise ValueError(f"swa_record={cfg.swa_record} with compressed_record="
                                 f"{cfg.compressed_record}: the decode reads both lists with "
                                 f"one record in this build; give both caches the same one")
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
        super()._validate_inputs(q, caches, batch, kv, cos_sin_cache, compressed_kv, attention)
