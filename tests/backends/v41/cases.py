"""Test plumbing for DeepSeek-V4.1 layers: configs, a harness per layer (the V4 harness over
``V41FlashMLABackend``), and a layer that reads another layer's compressed cache.

The oracle is V4's (``tests/backends/oracle.py``, ``sim.py``): float64 attention from the
history of rows each request wrote, never from the caches. V4.1 changes what it is fed: q
is not RMS-normed, both compressed kinds select entries by the indexer's top-k, each layer's
RoPE table is its own (``theta``), as the model's per-layer YaRN makes it, the compressor's
rows arrive unrotated (the write rotates entry c at position c · ratio), and each cache holds
its rows in its own record (584 B, 528 B MXFP8, 288 B NVFP4: ``RECORDS``).
"""
from __future__ import annotations

import torch

from sparse_mla.backends.v41 import V41FlashMLABackend, V41Kind, V41LayerConfig
from sparse_mla.backends.v41.flashmla import record_format
from sparse_mla.ops.common import formats
from sparse_mla.tests.backends import cases, oracle
from sparse_mla.tests.backends.sim import Simulator

KINDS = (V41Kind.SWA_ONLY, V41Kind.C1A, V41Kind.C2A)
# (swa_record, compressed_record): V4.0's pair (what vLLM runs on SM90 / SM120), V4.1's
# MXFP8 pair (SM100's FLASHMLA_SPARSE_DSV41) and its default MXFP8 + NVFP4 pair.
RECORDS = ((584, 584), (528, 528), (528, 288))
FORMAT = {584: "v4", 528: "v41", 288: "v41_fp4"}
# Different RoPE bases per layer kind: vLLM builds SWA-only layers' RoPE from rope_theta and
# compressed layers' from compress_rope_theta (models/deepseek_v41/common/rope.py).
THETA = {V41Kind.SWA_ONLY: 10000.0, V41Kind.C1A: 160000.0, V41Kind.C2A: 160000.0}
COMP_SEED = 77      # the compressed entries and top-k a source layer and its readers share


def config(kind, heads=8, max_num_tokens=640, max_model_len=1024, topk=64, records=None,
           **kw):
    """``records``: a ``RECORDS`` pair (default: the config's 584 B pair)."""
    if records is not None:
        kw = dict(kw, swa_record=records[0], compressed_record=records[1])
    return V41LayerConfig(num_heads=heads, kind=kind, max_num_tokens=max_num_tokens,
                          max_num_reqs=8, max_model_len=max_model_len, topk=topk, **kw)


def record_ids(records) -> str:
    return f"{records[0]}+{records[1]}"


class Harness(cases.Harness):
    """A V4.1 layer, its poisoned caches and its simulator. ``source``: the harness of the
    layer whose compressed cache this one reads (its config has ``owns_compressed=False``);
    the two simulators draw the same compressed entries and top-k (``COMP_SEED``).
    ``page_pad``: bytes added to every page (pages of several layers in one block, as vLLM's
    hybrid allocator lays them out): blocks ``stride(0)`` apart, more than a page."""

    def __init__(self, cfg, device, seed=0, impl="auto", attention_impl=None, planner=None,
                 source=None, swa_blocks=64, comp_blocks=64, page_pad=0):
        self.name, self.cfg, self.device = "v41_flashmla", cfg, torch.device(device)
        self.backend = V41FlashMLABackend(cfg, device, impl, attention_impl, planner)
        self.fmt = {"swa": record_format(cfg.swa_record, "swa", cfg.record_layout).name,
                    "compressed": record_format(cfg.compressed_record, "compressed",
                                                cfg.record_layout).name}
        comp_seed = COMP_SEED if cfg.kind.compressed else None
        self.sim = Simulator(cfg, device, oracle.Storage(self.fmt["swa"], swa=True), seed=seed,
                             swa_blocks=swa_blocks, comp_blocks=comp_blocks,
                             theta=THETA[cfg.kind], comp_seed=comp_seed,
                             comp_storage=oracle.Storage(self.fmt["compressed"]),
                             rotate_compressed=True)
        self.caches = {
            name: formats.alloc_paged_cache(spec.format, self.sim.num_blocks[name],
                                            spec.block_size, device=device,
                                            page_bytes=spec.page_bytes + page_pad, fill=0xFF)
            for name, spec in self.backend.cache_specs().items()}
        self.source = source
        if source is not None:
            self.caches["compressed"] = source.caches["compressed"]
        self.written = {"swa": set(), "compressed": set()}
        self.cos_sin = self.sim.cos_sin.to(device)
        self.sink = self.sim.sink.to(device)

    def run(self, step, out=None, batch=None, planned=False):
        if self.source is not None:
            # A reader layer: the source's step wrote the entries; this one gets none.
            step.compressed_kv, step.comp_slots = None, []
            step.batch.compressed_slot_mapping = None
        return super().run(step, out, batch, planned)

    def check_untouched(self):
        """As V4's, over the caches this layer owns (a reader's compressed cache is the
        source's, checked there)."""
        if self.source is None:
            return super().check_untouched()
        own = dict(self.caches)
        self.caches = {"swa": own["swa"]}
        try:
            super().check_untouched()
        finally:
            self.caches = own
