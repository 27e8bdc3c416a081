"""GLM-5.3 DSA attention over FlashMLA's V3.2 kernels (docs/semantics.md §13.5).

vLLM keeps the 656 B ``fp8_ds_mla`` record and FlashMLA's d_qk 576 kernels for this no-RoPE
model: the cache's 64 RoPE values are +0.0 and q's last 64 dims are zeros, so the RoPE
product adds exactly 0. This backend takes the model's 512-wide q and kv rows, writes the
record with ``quantize_insert_v32_nope`` and attends with q copied into a persistent 576-wide
buffer whose tail is zeroed once (CUDA-graph safe: no allocation per step). Everything else —
planning, top-k → slots, decode / prefill split, modes — is the V3.2 FlashMLA backend's.

Only the fp8 cache: vLLM's bf16 cache for this model is 512 wide, which FlashMLA's V3.2
prefill kernel (576-wide rows) does not read.
"""
from __future__ import annotations

import torch

from sparse_mla.backends.glm5.config import D_Q, Glm5Config
from sparse_mla.backends.v32.base import BF16, V32Backend
from sparse_mla.backends.v32.config import D_QK
from sparse_mla.backends.v32.flashmla import V32FlashMLABackend
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops.common import checks


class Glm5FlashMLABackend(V32FlashMLABackend):
    name = "glm5_flashmla"
    CONFIG = Glm5Config
    OPS = ("quantize_insert_v32_nope",) + V32FlashMLABackend.OPS[1:]

    def __init__(self, config, device="cpu", impl="auto", attention_impl=None, planner=None,
                 cache_dtype: str = "fp8_ds_mla", fp8_mode: str = "auto"):
        if cache_dtype != "fp8_ds_mla":
            raise ValueError(f"cache_dtype must be 'fp8_ds_mla' for GLM-5.3 (vLLM's bf16 cache "
                             f"is 512 wide, not FlashMLA's 576), got {cache_dtype!r}")
        super().__init__(config, device, impl, attention_impl, planner, cache_dtype, fp8_mode)
        self.q_pad = torch.zeros(config.max_num_tokens, config.num_heads, D_QK, dtype=BF16,
                                 device=self.device)

    def _validate_inputs(self, q, caches, batch, kv, cos_sin_cache, compressed_kv, attention):
        cfg = self.config
        checks.expect_dtype("q", q, BF16)
        if q.dim() != 3 or q.shape[1] != cfg.num_heads or q.shape[2] not in (D_Q, D_QK):
            raise ValueError(f"q must have shape [num_tokens, {cfg.num_heads}, {D_Q}] (the "
                             f"absorbed latent, no RoPE dims), got {list(q.shape)}")
        T = q.shape[0]
        if T > cfg.max_num_tokens:
            raise ValueError(f"q has {T} tokens, more than max_num_tokens={cfg.max_num_tokens}")
        if kv is not None:
            checks.expect_dtype("kv", kv, BF16)
            if kv.dim() != 2 or kv.shape[0] != T or kv.shape[1] != D_Q:
                raise ValueError(f"kv must have shape [{T}, {D_Q}] (the normed latent kv_c; "
                                 f"GLM-5.3 has no k_pe), got {list(kv.shape)}")
            checks.expect_last_dim_contiguous("kv", kv)
            checks.expect_same_device(q=q, kv=kv)
        # The V3.2 checks (batch, top-k, device, values) on the q attention will read.
        q_att = q if q.shape[2] == D_QK else self.q_pad[:T]
        V32Backend._validate_inputs(self, q_att, caches, batch, None, cos_sin_cache,
                                    compressed_kv, attention)

    def attend(self, q, caches, batch, attn_sink=None, out=None, planned=False):
        if q.dim() == 3 and q.shape[2] != D_QK:
            raise ValueError(f"q must be what write() returned ([T, H, {D_QK}], the zero-tailed "
                             f"buffer), got {list(q.shape)}")
        return super().attend(q, caches, batch, attn_sink, out, planned)

    def _write(self, q, kv, caches, batch, cos_sin_cache, compressed_kv):
        ci.quantize_insert_v32_nope(kv, caches["kv"], batch.slot_mapping,
                                    self.config.block_size, "fp32", self.impl)
        T = q.shape[0]
        self.q_pad[:T, :, :D_Q].copy_(q)
        return self.q_pad[:T]
