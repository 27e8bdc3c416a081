"""DeepSeek-V4 attention over plain caches (docs/semantics.md §2.3, §6), the way vLLM's
FlashInfer DSv4 backend runs it.

Caches ``[num_blocks, block_size, 512]`` of bf16, or of e4m3 with one per-tensor scale
(device tensors: read by the kernels, no host sync). One ``flashinfer_mixed_sparse_indices``
launch builds every row's list (columns ``[0, 128)`` index the SWA pool, the rest the compressed
pool), then ``trtllm_decode_dsv4`` runs twice: decode rows, then prefill rows with their
``cum_seq_lens_q`` rebased (docs/semantics.md §4.5). SWA-only layers pass the SWA pool as the
compressed pool with no compressed columns, as vLLM does.
"""
from __future__ import annotations

from typing import Dict

import torch

from sparse_mla.backends.common.spec import CacheSpec
from sparse_mla.backends.v4.base import V4Backend
from sparse_mla.backends.v4.config import LayerKind
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops import index_combine as ic
from sparse_mla.ops import trtllm_decode as td
from sparse_mla.ops.common import formats
from sparse_mla.ops.trtllm_decode import vendor as td_vendor

D = formats.HEAD_DIM
CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


class TrtllmBackend(V4Backend):
    name = "trtllm"
    OPS = ("fused_qnorm_rope_insert_plain", "insert_plain", "swa_indices_and_lens",
           "c128a_indices_and_lens", "flashinfer_mixed_sparse_indices", "trtllm_decode_dsv4")

    def __init__(self, config, device="cpu", impl="auto", attention_impl=None, planner=None,
                 cache_dtype: torch.dtype = torch.bfloat16, kv_scale: float = 1.0,
                 q_scale: float = 1.0):
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got "
                             f"{cache_dtype}")
        super().__init__(config, device, impl, attention_impl, planner)
        self.cache_dtype = cache_dtype
        T, H, R = config.max_num_tokens, config.num_heads, config.max_num_reqs
        dev = self.device
        self.q_rot = torch.zeros(T, H, D, dtype=cache_dtype, device=dev)
        width = ic.mixed_width(config.window, self.planner.prefill_topk_width,
                               config.compressed_width)
        self.indices = torch.full((T, width), -1, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(T, dtype=torch.int32, device=dev)
        self.prefill_cu = torch.zeros(R + 1, dtype=torch.int32, device=dev)
        self.fp8 = cache_dtype == torch.float8_e4m3fn
        # vLLM runs unit scales today (docs/semantics.md §2.3); any positive pair works. Device
        # tensors: the kernels read them, so changing them needs no re-capture.
        self.kv_scale = torch.tensor([kv_scale], dtype=torch.float32, device=dev)
        self.q_scale_inv = torch.tensor([1.0 / q_scale], dtype=torch.float32, device=dev)
        self.bmm1 = torch.tensor([config.softmax_scale * (q_scale * kv_scale if self.fp8
                                                          else 1.0)],
                                 dtype=torch.float32, device=dev)
        self.bmm2 = self.kv_scale if self.fp8 else torch.ones(1, dtype=torch.float32,
                                                               device=dev)

    def cache_specs(self) -> Dict[str, CacheSpec]:
        cfg = self.config
        specs = {"swa": CacheSpec.plain("swa", cfg.swa_block_size, self.cache_dtype)}
        if cfg.kind.compressed:
            specs["compressed"] = CacheSpec.plain("compressed", cfg.compressed_block_size,
                                                  self.cache_dtype)
        return specs

    def _scales(self):
        return (self.kv_scale, self.q_scale_inv) if self.fp8 else (None, None)

    def _write(self, q, kv, caches, batch, cos_sin_cache, compressed_kv):
        cfg, T = self.config, q.shape[0]
        q_rot = self.q_rot[:T]
        kv_scale, q_scale_inv = self._scales()
        ci.fused_qnorm_rope_insert_plain(q, kv, caches["swa"], batch.swa_slot_mapping,
                                         batch.positions, cos_sin_cache, q_rot, kv_scale,
                                         q_scale_inv, cfg.eps, cfg.apply_q_norm, self.impl)
        if compressed_kv is not None:
            ci.insert_plain(compressed_kv, caches["compressed"], batch.compressed_slot_mapping,
                            kv_scale, self.impl)
        return q_rot

    def _attend(self, q_rot, caches, batch, attn_sink, out):
        cfg, p = self.config, self.planner
        Rd, Td, Tp = batch.num_decodes, batch.num_decode_tokens, batch.num_prefill_tokens
        if q_rot.dtype != self.cache_dtype:
            raise TypeError(f"q must be {self.cache_dtype} for this backend's caches (the "
                            f"rotated q that write returns), got {q_rot.dtype}")
        kind = cfg.kind
        comp_table = batch.compressed_block_table
        dec_comp = dec_lens = None
        if kind is LayerKind.C4A:
            dec_comp = batch.topk_indices[:Td]
        elif kind is LayerKind.C128A:
            dec_comp, dec_lens = p.compressed_indices[:Td], p.compressed_lens[:Td]
        n = Td + Tp
        idx, lens = self.indices[:n], self.lens[:n]
        ic.flashinfer_mixed_sparse_indices(
            p.swa_indices[:Td], dec_comp, dec_lens, p.prefill_topk(batch, Td, Td + Tp),
            batch.query_start_loc, batch.seq_lens, p.token_to_req, batch.swa_block_table,
            comp_table, p.is_valid[:Td] if kind is LayerKind.C4A else None, idx, lens,
            cfg.swa_block_size, cfg.compressed_block_size or cfg.swa_block_size, cfg.window,
            kind.ratio, p.prefill_topk_width, kind is LayerKind.C4A, impl=self.impl)
        comp = caches["compressed"] if kind.compressed else caches["swa"]

        # always a tensor: see ops.trtllm_decode.ops.workspace_arg
        ws = td_vendor.workspace(self.device)

        def run(rows, seq_lens, cu, max_q_len):
            td.trtllm_batch_decode_sparse_mla_dsv4(
                q_rot[rows], caches["swa"], ws, idx[rows], comp, lens[rows], seq_lens,
                out[rows], self.bmm1, self.bmm2, attn_sink, "HND", cu, max_q_len,
                impl=self.attention_impl)
        if Td:
            run(slice(0, Td), batch.seq_lens[:Rd], batch.query_start_loc[:Rd + 1],
                batch.max_decode_query_len)
        if Tp:
            R = batch.num_reqs
            cu = self.prefill_cu[:R - Rd + 1]
            torch.sub(batch.query_start_loc[Rd:R + 1], batch.query_start_loc[Rd], out=cu)
            run(slice(Td, n), batch.seq_lens[Rd:R], cu, batch.max_prefill_query_len)
