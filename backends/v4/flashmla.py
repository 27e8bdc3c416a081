"""DeepSeek-V4 attention over caches in FlashMLA's 584 B layout (docs/semantics.md §2.2, §5.4).

Decode rows: one ``flashmla_sparse_decode`` (planned by a step's first layer, run by the
others: ``decode_with_plans``) — the SWA window as the main list, the compressed
list (C4A: the indexer's top-k as global slots; C128A: every completed entry) as the extra
list; every decode token (MTP included) is its own batch row, as vLLM runs it. Prefill rows:
requests in chunks that fit a bounded bf16 workspace; per chunk, ``gather_dequant`` of the
compressed entries and of the window context, ``combine_topk_swa_indices``, then
``flashmla_sparse_prefill`` (docs/semantics.md §4.4).
"""
from __future__ import annotations

from typing import Dict

import torch

from sparse_mla.backends.common.spec import CacheSpec
from sparse_mla.backends.v4.base import V4Backend
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops import flashmla_decode as fd  # registers the ops
from sparse_mla.ops import index_combine as ic
from sparse_mla.ops.common import formats

D = formats.HEAD_DIM


class FlashMLABackend(V4Backend):
    name = "flashmla"
    OPS = ("fused_qnorm_rope_insert_v4", "quantize_insert_v4",
           "swa_indices_and_lens",
           "global_topk_indices_and_lens", "c128a_indices_and_lens", "flashmla_sparse_decode",
           "gather_dequant", "combine_topk_swa_indices", "flashmla_sparse_prefill")

    def __init__(self, config, device="cpu", impl="auto", attention_impl=None, planner=None):
        super().__init__(config, device, impl, attention_impl, planner)
        self.records = self._records()
        T, H = config.max_num_tokens, config.num_heads
        dev = self.device
        self.q_rot = torch.zeros(T, H, D, dtype=torch.bfloat16, device=dev)
        self.decode_lse = torch.empty(T, H, 1, dtype=torch.float32, device=dev)
        self.prefill_lse = torch.empty(T, H, dtype=torch.float32, device=dev)
        self.prefill_max_logits = torch.empty(T, H, dtype=torch.float32, device=dev)
        width = ic.combined_width(self.planner.prefill_topk_width, config.window)
        self.combined = torch.full((T, width), -1, dtype=torch.int32, device=dev)
        self.combined_lens = torch.zeros(T, dtype=torch.int32, device=dev)
        self.workspace = torch.empty(config.prefill_workspace_rows, D, dtype=torch.bfloat16,
                                     device=dev)

    def _records(self) -> Dict[str, formats.PagedFormat]:
        """Each cache's packed record ("swa", "compressed"): the 584 B one (DeepSeek-V4.1's
        backend picks per cache)."""
        return {"swa": formats.V4, "compressed": formats.V4}

    def cache_specs(self) -> Dict[str, CacheSpec]:
        cfg, rec = self.config, self.records
        specs = {"swa": CacheSpec.paged_format("swa", rec["swa"], cfg.swa_block_size)}
        if cfg.kind.compressed:
            specs["compressed"] = CacheSpec.paged_format("compressed", rec["compressed"],
                                                         cfg.compressed_block_size)
        return specs

    def _validate_batch(self, batch):
        self.planner.check_prefill_fits(batch)

    def _write(self, q, kv, caches, batch, cos_sin_cache, compressed_kv):
        cfg, T = self.config, q.shape[0]
        q_rot = self.q_rot[:T]
        ci.fused_qnorm_rope_insert_v4(q, kv, caches["swa"], batch.swa_slot_mapping,
                                      batch.positions, cos_sin_cache, q_rot, cfg.eps,
                                      cfg.swa_block_size, cfg.apply_q_norm, self.impl)
        if compressed_kv is not None:
            ci.quantize_insert_v4(compressed_kv, caches["compressed"],
                                  batch.compressed_slot_mapping, cfg.compressed_block_size,
                                  self.impl)
        return q_rot

    def _attend(self, q_rot, caches, batch, attn_sink, out):
        if batch.num_decode_tokens:
            self.planner.c4a_decode(batch)
            self._decode(q_rot, caches, batch, attn_sink, out)
        if batch.num_prefill_tokens:
            self._prefill(q_rot, caches, batch, attn_sink, out)

    def _decode(self, q_rot, caches, batch, attn_sink, out):
        cfg, p, Td = self.config, self.planner, batch.num_decode_tokens
        extra = {}
        if cfg.kind.compressed:
            extra = dict(extra_k_cache=caches["compressed"],
                         extra_indices=p.compressed_indices[:Td].unsqueeze(1),
                         extra_topk_length=p.compressed_lens[:Td],
                         extra_block_size=cfg.compressed_block_size,
                         extra_kv_format=self.records["compressed"].name)
        fd.decode_with_plans(
            p.op_plans, q_rot[:Td].unsqueeze(1), caches["swa"], p.swa_indices[:Td].unsqueeze(1),
            out[:Td].unsqueeze(1), self.decode_lse[:Td], topk_length=p.swa_lens[:Td],
            attn_sink=attn_sink, softmax_scale=cfg.softmax_scale,
            kv_format=self.records["swa"].name, block_size=cfg.swa_block_size,
            impl=self.attention_impl, **extra)

    def _prefill(self, q_rot, caches, batch, attn_sink, out):
        cfg, p, Rd = self.config, self.planner, batch.num_decodes
        topk = p.prefill_topk_width
        for ch in p.prefill_chunks(batch):
            a, b = Rd + ch.r0, Rd + ch.r1
            kv = self.workspace[:(b - a) * ch.M].view(b - a, ch.M, D)
            if cfg.kind.compressed:
                ci.gather_dequant(kv, caches["compressed"], p.entries[a:b], None,
                                  batch.compressed_block_table[a:b], cfg.compressed_block_size,
                                  0, self.records["compressed"].name, self.impl)
            ci.gather_dequant(kv, caches["swa"], batch.seq_lens[a:b], p.gather_lens[a:b],
                              batch.swa_block_table[a:b], cfg.swa_block_size, ch.N,
                              self.records["swa"].name, self.impl)
            n = ch.t1 - ch.t0
            idx, lens = self.combined[:n], self.combined_lens[:n]
            ic.combine_topk_swa_indices(p.prefill_topk(batch, ch.t0, ch.t1),
                                        batch.query_start_loc[a:b + 1], batch.seq_lens[a:b],
                                        p.gather_lens[a:b], idx, lens, cfg.window,
                                        cfg.kind.ratio, topk, ch.M, ch.N, self.impl)
            fd.flashmla_sparse_prefill(q_rot[ch.t0:ch.t1], kv.view(-1, 1, D), idx.unsqueeze(1),
                                       out[ch.t0:ch.t1], self.prefill_max_logits[:n],
                                       self.prefill_lse[:n], cfg.softmax_scale, lens,
                                       attn_sink, self.attention_impl)
