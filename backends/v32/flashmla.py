"""DeepSeek-V3.2 attention in FlashMLA's layouts, composed as vLLM's FlashMLA sparse backend
composes FlashMLA's kernels (docs/semantics.md §2.1, §4.1, §5).

Caches ``[num_blocks, block_size, 656]`` uint8 (``fp8_ds_mla``: 512 e4m3, 4 fp32 scales, 64
bf16 RoPE dims per token) or ``[num_blocks, block_size, 576]`` bf16.

- bf16 cache: every row (decode and prefill) through ``flashmla_sparse_prefill`` over the
  whole cache viewed as ``[slots, 1, 576]``, indices = global slots.
- fp8 cache, "separate" mode: decode rows through ``flashmla_sparse_decode`` (global slots);
  prefill requests in chunks that fit the bf16 workspace: ``gather_dequant`` of each
  request's whole context, indices → workspace rows, ``flashmla_sparse_prefill``.
- fp8 cache, "mixed" mode: every row through ``flashmla_sparse_decode`` as one batch. vLLM
  uses it when the local heads are few (< 32): FlashMLA's prefill pads heads to 64/128 and
  the decode kernel then costs less than gather + padded prefill.
"""
from __future__ import annotations

from typing import Dict

import torch

from sparse_mla.backends.common.spec import CacheSpec
from sparse_mla.backends.v32.base import BF16, V32Backend
from sparse_mla.backends.v32.config import D_QK
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops import flashmla_decode as fd

CACHE_DTYPES = ("fp8_ds_mla", "bfloat16")
FP8_MODES = ("auto", "separate", "mixed")
MIN_HEADS_FOR_BF16_PREFILL = 32     # vLLM's threshold for the fp8 cache's "mixed" mode


class V32FlashMLABackend(V32Backend):
    name = "v32_flashmla"
    OPS = ("quantize_insert_v32", "insert_plain", "convert_req_index_to_global",
           "flashmla_sparse_decode", "gather_dequant", "flashmla_sparse_prefill")

    def __init__(self, config, device="cpu", impl="auto", attention_impl=None, planner=None,
                 cache_dtype: str = "fp8_ds_mla", fp8_mode: str = "auto"):
        """``cache_dtype``: "fp8_ds_mla" (656 B) or "bfloat16" (576 wide), vLLM's names.
        ``fp8_mode``: "separate" / "mixed" (see the module doc); "auto" picks as vLLM does."""
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_dtype!r}")
        if fp8_mode not in FP8_MODES:
            raise ValueError(f"fp8_mode must be one of {FP8_MODES}, got {fp8_mode!r}")
        super().__init__(config, device, impl, attention_impl, planner)
        self.fp8 = cache_dtype == "fp8_ds_mla"
        if fp8_mode == "auto":
            fp8_mode = "mixed" if config.num_heads < MIN_HEADS_FOR_BF16_PREFILL else "separate"
        self.mode = (fp8_mode if self.fp8 else "bf16")
        T, H = config.max_num_tokens, config.num_heads
        dev = self.device
        self.lse = torch.empty(T, H, 1, dtype=torch.float32, device=dev)
        self.max_logits = torch.empty(T, H, dtype=torch.float32, device=dev)
        rows = config.prefill_workspace_rows if self.mode == "separate" else 0
        self.workspace = torch.empty(rows, D_QK, dtype=BF16, device=dev)

    def cache_specs(self) -> Dict[str, CacheSpec]:
        bs = self.config.block_size
        if self.fp8:
            return {"kv": CacheSpec.paged_v32("kv", bs)}
        return {"kv": CacheSpec.plain("kv", bs, BF16, D_QK)}

    def _check_caches(self, caches) -> None:
        super()._check_caches(caches)
        if not self.fp8 and not caches["kv"].is_contiguous():
            # the prefill kernel reads it as one [slots, 1, 576] tensor
            raise ValueError("caches['kv'] (bf16) must be contiguous: the prefill reads it as "
                             "[num_blocks * block_size, 1, 576]")

    def _validate_batch(self, batch):
        if self.mode == "separate":      # the only mode that gathers prefill rows
            self.planner.check_prefill_fits(batch)

    def _attend(self, q, caches, batch, attn_sink, out):
        p, n, Td = self.planner, batch.num_tokens, batch.num_decode_tokens
        if not n:
            return
        if self.mode == "bf16":
            p.global_slots(batch, 0, n)
            self._prefill(q[:n], caches["kv"].view(-1, 1, D_QK), p.slots[:n], out[:n])
        elif self.mode == "mixed":
            p.global_slots(batch, 0, n)
            self._decode(q, caches, 0, n, out)
        else:
            if Td:
                p.global_slots(batch, 0, Td)
                self._decode(q, caches, 0, Td, out)
            if batch.num_prefill_tokens:
                self._separate_prefill(q, caches, batch, out)

    def _decode(self, q, caches, t0, t1, out):
        cfg = self.config
        fd.decode_with_plans(
            self.planner.op_plans, q[t0:t1].unsqueeze(1), caches["kv"],
            self.planner.slots[t0:t1].unsqueeze(1),
            out[t0:t1].unsqueeze(1), self.lse[t0:t1], softmax_scale=cfg.softmax_scale,
            kv_format="v32", block_size=cfg.block_size, impl=self.attention_impl)

    def _prefill(self, q, kv, idx, out):
        n = q.shape[0]
        fd.flashmla_sparse_prefill(q, kv, idx.unsqueeze(1), out, self.max_logits[:n],
                                   self.lse[:n, :, 0], self.config.softmax_scale, None, None,
                                   self.attention_impl)

    def _separate_prefill(self, q, caches, batch, out):
        cfg, p, Rd = self.config, self.planner, batch.num_decodes
        for ch in p.prefill_chunks(batch):
            a, b = Rd + ch.r0, Rd + ch.r1
            ws = self.workspace[:(b - a) * ch.M].view(b - a, ch.M, D_QK)
            ci.gather_dequant(ws, caches["kv"], batch.seq_lens[a:b], None,
                              batch.block_table[a:b], cfg.block_size, 0, "v32", self.impl)
            p.workspace_rows(batch, ch)
            self._prefill(q[ch.t0:ch.t1], ws.view(-1, 1, D_QK), p.slots[ch.t0:ch.t1],
                          out[ch.t0:ch.t1])
