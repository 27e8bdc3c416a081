"""FlashMLA-semantics sparse decode and prefill (docs/semantics.md §5) as ``sparse_mla::``
custom ops.

Decode: ``flash_mla_with_kvcache`` on a V4 584 B (or V3.2 656 B) paged cache with a main key
list, an optional extra (compressed) key list and an attention sink. Prefill:
``flash_mla_sparse_fwd`` on a dense bf16 kv. Both reduce to the shared attention core
(ops/attention/): reference.py and triton_impl.py translate the arguments into its key
sources; vendor.py runs FlashMLA itself.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import checks, formats
from sparse_mla.ops.common.dispatch import implementations
from sparse_mla.ops.common.opdef import custom_op
from sparse_mla.ops.flashmla_decode import reference, triton_impl, vendor

MAX_HEADS = 128
HEAD_DIM = {f.name: f.out_dim for f in (formats.V4, formats.V32, formats.V41, formats.V41_FP4,
                                         formats.V41_INLINE, formats.V41_FP4_INLINE)}
# An extra (compressed) cache may hold another record than the main one where both are among
# these: a V4.1 layer's 528 B SWA cache with its 288 B (or 528 B) compressed cache, each V4.1
# record page-footer (vLLM 0.32) or token-inline (vLLM 0.33)
MIXABLE = ("v4",) + tuple(formats.V41_RECORD_OF)
PREFILL_DIMS = (512, 576)     # d_qk of the prefill: V4, V3.2; the output is 512 wide either way
# decode queries: bf16, or e4m3 with an optional fp32 scale (q_scale)
Q_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _check_sink_and_out(attn_sink, h, out, out_shape):
    """``attn_sink`` fp32 [h] (optional) and ``out`` bf16 of ``out_shape``, last dim contiguous."""
    if attn_sink is not None:
        checks.expect_dtype("attn_sink", attn_sink, torch.float32)
        checks.expect_shape("attn_sink", attn_sink, (h,))
    checks.expect_dtype("out", out, torch.bfloat16)
    checks.expect_shape("out", out, out_shape)
    checks.expect_last_dim_contiguous("out", out)


_DECODE = implementations("flashmla_sparse_decode", vendor=vendor.DECODE,
                          triton=triton_impl.decode, reference=reference.decode,
                          triton_planner=triton_impl.plan_decode)


def _extra_format(kv_format, extra_kv_format):
    """The extra cache's record: ``extra_kv_format``, or ``kv_format`` where that is None."""
    return kv_format if extra_kv_format is None else extra_kv_format


def _validate_decode(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
                     extra_topk_length, attn_sink, kv_format, block_size, extra_block_size,
                     extra_kv_format=None, q_scale=None):
    if kv_format not in HEAD_DIM:
        raise ValueError(f"kv_format must be 'v4' (584 B), 'v32' (656 B), 'v41' / 'v41_inline' "
                         f"(528 B) or 'v41_fp4' / 'v41_fp4_inline' (288 B), got {kv_format!r}")
    extra_fmt = _extra_format(kv_format, extra_kv_format)
    if extra_fmt != kv_format and not (kv_format in MIXABLE and extra_fmt in MIXABLE):
        raise ValueError(f"extra_kv_format must be one of {MIXABLE} with kv_format "
                         f"{kv_format!r} (or equal to it), got {extra_kv_format!r}")
    fmt = formats.get_format(kv_format)
    d = HEAD_DIM[kv_format]
    checks.expect_dtype("q", q, Q_DTYPES)
    if q.dim() != 4 or q.shape[3] != d:
        raise ValueError(f"q must have shape [batch, s_q, heads, {d}] for kv_format "
                         f"{kv_format!r}, got {list(q.shape)}")
    b, s_q, h = q.shape[:3]
    if not 1 <= h <= MAX_HEADS:
        raise ValueError(f"q has {h} heads; expected 1..{MAX_HEADS}")
    checks.expect_last_dim_contiguous("q", q)
    bs = checks.paged_cache_block_size("k_cache", k_cache, fmt, block_size)
    checks.expect_dtype("indices", indices, torch.int32)
    checks.expect_shape("indices", indices, (b, s_q, None))
    if topk_length is not None:
        checks.expect_dtype("topk_length", topk_length, torch.int32)
        checks.expect_shape("topk_length", topk_length, (b,))
    extra_bs = None
    if extra_k_cache is None:
        if extra_indices is not None or extra_topk_length is not None:
            raise ValueError("extra_indices_in_kvcache / extra_topk_length need extra_k_cache")
    else:
        if extra_indices is None:
            raise ValueError("extra_k_cache needs extra_indices_in_kvcache")
        try:
            extra_bs = checks.paged_cache_block_size(
                "extra_k_cache", extra_k_cache, formats.get_format(extra_fmt), extra_block_size)
        except ValueError as exc:
            want = (f"the same format as k_cache ({kv_format})" if extra_kv_format is None
                    else f"format {extra_fmt} (extra_kv_format)")
            raise ValueError(f"extra_k_cache must use {want}: {exc}") from None
        checks.expect_dtype("extra_indices_in_kvcache", extra_indices, torch.int32)
        checks.expect_shape("extra_indices_in_kvcache", extra_indices, (b, s_q, None))
        if extra_topk_length is not None:
            checks.expect_dtype("extra_topk_length", extra_topk_length, torch.int32)
            checks.expect_shape("extra_topk_length", extra_topk_length, (b,))
    _check_sink_and_out(attn_sink, h, out, (b, s_q, h, 512))
    checks.expect_dtype("lse", lse, torch.float32)
    checks.expect_shape("lse", lse, (b, h, s_q))
    checks.expect_same_device(q=q, k_cache=k_cache, indices=indices, out=out, lse=lse,
                              topk_length=topk_length, extra_k_cache=extra_k_cache,
                              extra_indices=extra_indices, extra_topk_length=extra_topk_length,
                              attn_sink=attn_sink)
    _check_lengths(q, (("topk_length", topk_length, indices),
                       ("extra_topk_length", extra_topk_length, extra_indices)))
    _check_q_scale(q, q_scale)
    return bs, extra_bs


def _check_q_scale(q, q_scale):
    """``q_scale``: only beside an e4m3 q; fp32, one value (per tensor) or ``[b, s_q, h]``
    (per token and head), on q's device."""
    if q_scale is None:
        return
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q_scale dequantizes an e4m3 q; q is {str(q.dtype)[6:]}")
    checks.expect_dtype("q_scale", q_scale, torch.float32)
    if q_scale.numel() != 1 and tuple(q_scale.shape) != tuple(q.shape[:3]):
        raise ValueError(f"q_scale must hold one value (per tensor) or have shape "
                         f"{list(q.shape[:3])} (per token and head), got {list(q_scale.shape)}")
    checks.expect_same_device(q=q, q_scale=q_scale)


def _check_lengths(q, lists):
    """Each (name, lengths, indices) in ``lists``: lengths in [0, the indices' last dim] (a
    value check: where ``checks.value_checks_enabled``; it reads the device)."""
    if not checks.value_checks_enabled(q, *(lens for _, lens, _ in lists)):
        return
    for name, lens, indices in lists:
        if lens is not None:
            checks.expect_values_in(name, lens, 0, indices.shape[-1], " (its indices' last dim)",
                                    "batch row")


@custom_op("sparse_mla::flashmla_sparse_decode", mutates_args=("out", "lse"),
           caches=("k_cache", "extra_k_cache"), strided=("out", "lse"))
def flashmla_sparse_decode(q: Tensor, k_cache: Tensor, indices: Tensor, out: Tensor, lse: Tensor,
                           topk_length: Optional[Tensor] = None,
                           extra_k_cache: Optional[Tensor] = None,
                           extra_indices: Optional[Tensor] = None,
                           extra_topk_length: Optional[Tensor] = None,
                           attn_sink: Optional[Tensor] = None,
                           softmax_scale: Optional[float] = None, kv_format: str = "v4",
                           block_size: Optional[int] = None,
                           extra_block_size: Optional[int] = None,
                           extra_kv_format: Optional[str] = None,
                           q_scale: Optional[Tensor] = None, impl: str = "auto") -> None:
    """docs/semantics.md §5.1 into ``out`` [b, s_q, h, 512] bf16 and ``lse`` [b, h, s_q] fp32.
    ``extra_kv_format``: the extra cache's record where it differs from ``kv_format`` (both
    among "v4", "v41", "v41_fp4", "v41_inline", "v41_fp4_inline": docs/semantics.md §12).

    An e4m3 ``q`` (DeepSeek's fp8 q projection, as FlashInfer's DSv4 decode takes it) stands
    for ``q.float() * q_scale``: ``q_scale`` fp32 with one value (per tensor; None: 1) or of
    shape [b, s_q, h] (per token and head). The Triton kernels read the e4m3 bytes (half of
    bf16's) and fold a per-tensor scale into the softmax scale; a per-token-head scale is
    applied to q first, rounded to bf16 (docs/semantics.md §5.1)."""
    bs, extra_bs = _validate_decode(
        q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
        extra_topk_length, attn_sink, kv_format, block_size, extra_block_size, extra_kv_format,
        q_scale)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    _DECODE(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
            extra_topk_length, attn_sink, scale, kv_format, bs, extra_bs,
            _extra_format(kv_format, extra_kv_format), q_scale, impl=impl)


@flashmla_sparse_decode.register_fake
def _(q, k_cache, indices, out, lse, topk_length=None, extra_k_cache=None, extra_indices=None,
      extra_topk_length=None, attn_sink=None, softmax_scale=None, kv_format="v4",
      block_size=None, extra_block_size=None, extra_kv_format=None, q_scale=None, impl="auto"):
    _validate_decode(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
                     extra_topk_length, attn_sink, kv_format, block_size, extra_block_size,
                     extra_kv_format, q_scale)


def flash_mla_with_kvcache(q, k_cache, indices, *, topk_length=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None,
                           extra_topk_length=None, softmax_scale=None, kv_format="v4",
                           block_size=None, extra_block_size=None, extra_kv_format=None,
                           out=None, lse=None, impl="auto", q_scale=None):
    """FlashMLA's decode call: returns ``(out [b, s_q, h, 512] bf16, lse [b, h, s_q] fp32)``.
    Pass persistent ``out``/``lse`` buffers to run allocation-free (CUDA graphs).

    Index columns past ``topk_length`` / ``extra_topk_length`` may hold anything. Within them,
    every id outside [0, the cache's slots) marks an unused column (-1 is the usual one) on
    every implementation: FlashMLA itself skips only -1 (docs/semantics.md §5.1), so the vendor path
    maps the others to -1 before calling it. ``q_scale``: an e4m3 q's scale
    (``flashmla_sparse_decode``)."""
    b, s_q, h = q.shape[:3]
    if out is None:
        out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device).transpose(1, 2)
    flashmla_sparse_decode(q, k_cache, indices, out, lse, topk_length, extra_k_cache,
                           extra_indices_in_kvcache, extra_topk_length, attn_sink, softmax_scale,
                           kv_format, block_size, extra_block_size, extra_kv_format,
                           q_scale, impl)
    return out, lse


# ---------------------------------------------------------------------------------------------
# prefill: flash_mla_sparse_fwd on a dense bf16 kv (docs/semantics.md §5.2)

_PREFILL = implementations("flashmla_sparse_prefill", vendor=vendor.PREFILL,
                           triton=triton_impl.prefill, reference=reference.prefill,
                           triton_planner=triton_impl.plan_prefill)


def _validate_prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink):
    checks.expect_dtype("q", q, torch.bfloat16)
    if q.dim() != 3 or q.shape[2] not in PREFILL_DIMS:
        raise ValueError(f"q must have shape [s_q, heads, 512] (DeepSeek-V4) or [s_q, heads, "
                         f"576] (V3.2: 512 latent + 64 RoPE), got {list(q.shape)}")
    s_q, h = q.shape[:2]
    d = q.shape[2]
    if not 1 <= h <= MAX_HEADS:
        raise ValueError(f"q has {h} heads; expected 1..{MAX_HEADS}")
    checks.expect_last_dim_contiguous("q", q)
    checks.expect_dtype("kv", kv, torch.bfloat16)
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != d:
        raise ValueError(f"kv must have shape [s_kv, 1, {d}] (the width of q), got "
                         f"{list(kv.shape)}")
    checks.expect_last_dim_contiguous("kv", kv)
    checks.expect_dtype("indices", indices, torch.int32)
    checks.expect_shape("indices", indices, (s_q, 1, None))
    if topk_length is not None:
        checks.expect_dtype("topk_length", topk_length, torch.int32)
        checks.expect_shape("topk_length", topk_length, (s_q,))
    _check_sink_and_out(attn_sink, h, out, (s_q, h, 512))
    for name, t in (("max_logits", max_logits), ("lse", lse)):
        checks.expect_dtype(name, t, torch.float32)
        checks.expect_shape(name, t, (s_q, h))
    checks.expect_same_device(q=q, kv=kv, indices=indices, out=out, max_logits=max_logits,
                              lse=lse, topk_length=topk_length, attn_sink=attn_sink)
    _check_lengths(q, (("topk_length", topk_length, indices),))


@custom_op("sparse_mla::flashmla_sparse_prefill",
           mutates_args=("out", "max_logits", "lse"), caches=("kv",),
           strided=("out", "max_logits", "lse"))
def flashmla_sparse_prefill(q: Tensor, kv: Tensor, indices: Tensor, out: Tensor,
                            max_logits: Tensor, lse: Tensor, sm_scale: float,
                            topk_length: Optional[Tensor] = None,
                            attn_sink: Optional[Tensor] = None, impl: str = "auto") -> None:
    """docs/semantics.md §5.2. ``q`` [s_q, h, d_qk] and ``kv`` [s_kv, 1, d_qk] bf16 with d_qk
    512 (DeepSeek-V4) or 576 (V3.2: scores over all 576 dims); ``out`` [s_q, h, 512] is the
    first 512 dims of the weighted rows. Key j of query i is valid iff
    0 <= indices[i, 0, j] < s_kv and j < topk_length[i]. lse / max_logits exclude the sink
    (+inf / -inf without keys)."""
    _validate_prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink)
    _PREFILL(q, kv, indices, out, max_logits, lse, topk_length, attn_sink, sm_scale, impl=impl)


@flashmla_sparse_prefill.register_fake
def _(q, kv, indices, out, max_logits, lse, sm_scale, topk_length=None, attn_sink=None,
      impl="auto"):
    _validate_prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink)


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, *, attn_sink=None, topk_length=None,
                         out=None, max_logits=None, lse=None, impl="auto"):
    """FlashMLA's prefill call: returns ``(out, max_logits, lse)``."""
    s_q, h = q.shape[:2]
    out = torch.empty(s_q, h, 512, dtype=torch.bfloat16, device=q.device) if out is None else out
    if max_logits is None:
        max_logits = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h, dtype=torch.float32, device=q.device) if lse is None else lse
    flashmla_sparse_prefill(q, kv, indices, out, max_logits, lse, sm_scale, topk_length,
                            attn_sink, impl)
    return out, max_logits, lse
